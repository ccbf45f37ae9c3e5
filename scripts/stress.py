"""Stress test the runtime: `python scripts/stress.py --duration 60 --kill-worker-every 20` (see --help).

The same tool as `asyncexec stress`; it lives in `asyncexec.stress`.
"""

from __future__ import annotations

import sys

from asyncexec.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["stress", *sys.argv[1:]]))
