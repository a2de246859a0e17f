"""The training loop and what it uses: the optimizer and LR schedule, metrics, the hung-step watchdog."""
