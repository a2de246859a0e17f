"""python -m mingpt.snapshot list|show|verify STORE: the same tool as mingpt-snapshot."""

import sys

from mingpt.cli.snapshot import main

sys.exit(main())
