"""Command-line tools: mingpt-torchrun (launch.py), mingpt-rendezvous (rendezvous.py), mingpt-doctor,
mingpt-snapshot, mingpt-generate and mingpt-export. Training itself is mingpt/main.py (mingpt-train),
preparing data mingpt/cli/prepare.py (mingpt-prepare)."""
