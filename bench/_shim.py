"""The one shim: `python bench/e2e.py` runs as `python -m bench.e2e` does.

A file run puts bench/ first on `sys.path`, not the checkout, so neither `bench` nor the
server's packages would import; a checkout need not be installed. Each script calls
`run_as_module(__file__)` before its imports when it runs as a file: the checkout takes
bench/'s place on `sys.path` and the script runs again as its module, so both ways of
running it are one (one copy of each module, `__package__` set, the same argv).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_as_module(file: str) -> None:
    """Run the script at `file` as the module bench.<its name>, then exit with its status:
    the file run's own module stops here, before it imports anything of the checkout."""
    sys.path[0] = str(ROOT)  # the script's folder, which a file run put first
    runpy.run_module(f"bench.{Path(file).stem}", run_name="__main__", alter_sys=True)
    raise SystemExit(0)
