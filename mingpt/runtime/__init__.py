"""The process runtime, below everything that trains: torchrun's environment and the process group
(distributed.py), how a process ends: its exit codes, the signals that stop it, its error report
(exits.py), the job's secret and signed stores (trust.py), dying with the agent (orphan.py),
atomic local files (storage.py), checks at every start (preflight.py), files from the package
registry (registry.py) and the terminal (console.py)."""
