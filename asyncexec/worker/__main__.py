"""`python -m asyncexec.worker`: a worker process's entry point (see `asyncexec.worker.proc`)."""

import logging
import os
import sys

from asyncexec.worker.proc import main

code = main(sys.argv[1:])
# Everything this process owns is released by now; skip interpreter teardown, which with torch,
# gloo and transformers loaded takes seconds (it joins their threads) and adds nothing.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
