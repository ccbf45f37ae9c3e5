"""`python -m asyncexec.worker`: a worker process's entry point (see `asyncexec.worker.proc`)."""

import sys

from asyncexec.worker.proc import main

sys.exit(main())
