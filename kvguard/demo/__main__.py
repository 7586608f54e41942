"""`python -m kvguard.demo` (`make demo`): the same as `kvguard demo`, through the command line's
error handling."""

import sys

from ..cli import main

sys.exit(main(["demo", *sys.argv[1:]]))
