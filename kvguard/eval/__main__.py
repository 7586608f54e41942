"""`python -m kvguard.eval`: `kvguard eval`, the fidelity harness (kvguard/eval/cli.py)."""

import sys

from .cli import main

sys.exit(main())
