"""`python -m audit` runs the audit CLI (audit.cli)."""

import sys

from .cli import main

sys.exit(main())
