"""What the `tidegate` distribution puts at the top of site-packages: this package only.

The server's packages keep their folders in the repository (api/, tasks/, workers/,
scheduler/, store/, tidegate/, tidegate_tools/, migrations/) and import one another by
those names. Installed, they live inside this package's folder, where nothing else sees
them: a CRM app's own `api/` or `tasks.py`, or a PyPI distribution of such a name, neither
shadows them nor is shadowed. Every way into the server comes through here and puts that
folder first on `sys.path` for its own process: the `tidegate` command
(`python -m tidegate_server`), the vLLM plugin entry points, and the processes the
server starts (tidegate_tools/procs.py). From a checkout, the folder is the repository.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# Installed: the server's packages sit beside this file. A checkout: at the repository root.
ROOT = _HERE if (_HERE / "api").is_dir() else _HERE.parent


def use_server_packages() -> None:
    """Make the server's packages importable by their own names, ahead of any other."""
    root = str(ROOT)
    if not sys.path or sys.path[0] != root:
        sys.path.insert(0, root)


def main() -> None:
    """The `tidegate` command."""
    use_server_packages()
    from tidegate_tools.cli import main as cli_main

    cli_main()


def register_kv() -> None:
    """vLLM plugin: session-priority KV eviction and allocation timing (off unless a
    tidegate worker asked for it: workers/vllm_patches/)."""
    use_server_packages()
    from workers.vllm_patches.kvcache import register

    register()


def register_wakeup() -> None:
    """vLLM plugin: the shared-memory ring's recheck (workers/vllm_patches/wakeup.py)."""
    use_server_packages()
    from workers.vllm_patches.wakeup import register

    register()


def register_priority() -> None:
    """vLLM plugin: a more urgent request takes a slot from a less urgent one
    (workers/vllm_patches/priority.py)."""
    use_server_packages()
    from workers.vllm_patches.priority import register

    register()
