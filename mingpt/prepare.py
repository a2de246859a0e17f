"""`python -m mingpt.prepare INPUT... --out DIR`: tokenize a corpus once, in parallel, into a
prepared dataset (see mingpt/data/prepare.py)."""

import sys

from mingpt.data.prepare import main

if __name__ == "__main__":
    sys.exit(main())
