"""`python -m kvguard.audit` runs the audit CLI (kvguard.audit.cli)."""

import sys

from .cli import main

sys.exit(main())
