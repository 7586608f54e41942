"""`python -m kvguard`: the `kvguard` command (kvguard/cli.py)."""

import sys

from .cli import main

sys.exit(main())
