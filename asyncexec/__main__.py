"""`python -m asyncexec`: the `asyncexec` command line."""

import sys

from asyncexec.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
