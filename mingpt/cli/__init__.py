"""Command-line tools, installed as mingpt-generate, mingpt-snapshot and mingpt-rendezvous
(training itself is mingpt/main.py, for torchrun, or mingpt-train)."""
