"""`python -m asyncexec`: the `asyncexec` command line."""

import sys

from asyncexec.entrypoints.cli import main

sys.exit(main())
