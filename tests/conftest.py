"""What both floors share: the environment, set before anything reads the settings (so no
test ever touches the Redis or database of a running demo), a temp root and the test
checkpoint. `tests/unit/` starts no process and opens no socket; `tests/stack/` (its own
conftest) starts a private Redis, the database and real worker and API processes.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest

from tidegate_tools.procs import free_port

ROOT = Path(__file__).resolve().parent.parent
TMP = Path(tempfile.mkdtemp(prefix="tidegate-tests-"))
REDIS_PORT = free_port()

os.environ.update({
    "TIDEGATE_REDIS_URL": f"redis://127.0.0.1:{REDIS_PORT}/0",
    "TIDEGATE_DATABASE_URL": f"sqlite:///{TMP / 'tidegate.db'}",
    "TIDEGATE_DATA_DIR": str(ROOT / "data"),
    "TIDEGATE_MODEL": str(ROOT / "data" / "models" / "tidegate-test"),
    "TIDEGATE_LANES_FILE": str(ROOT / "tests" / "lanes.toml"),
    "TIDEGATE_NAMESPACE": "tgtest",
    "TIDEGATE_HEARTBEAT_S": "0.5",
    "TIDEGATE_KV_CACHE_GIB": "1",
    # vLLM's model in its engine core process, as on one GPU: each of the suite's ~35
    # worker starts spawns one process fewer that imports vLLM (docs/settings.md).
    "TIDEGATE_VLLM_CPU_EXECUTOR": "uni",
    # No process binds the default metrics ports (a demo on this machine may hold them);
    # tidegate_tools.procs gives the workers and schedulers it starts free ones.
    "TIDEGATE_WORKER_METRICS_PORT": "0",
    "TIDEGATE_SCHEDULER_METRICS_PORT": "0",
    # The tests' webhook receivers listen on 127.0.0.1 (tests/stack/test_webhooks.py).
    "TIDEGATE_WEBHOOK_ALLOW_PRIVATE": "true",
    # A rolling restart's wait for the new process (tests/stack/test_standby.py): in two
    # full runs on a loaded 2-core machine, a restarted worker's vLLM took over 5 minutes
    # to start (it takes seconds when the test runs alone).
    "TIDEGATE_RESTART_TIMEOUT_S": "600",
    # The fault-injection control commands (workers/fault_commands.py) on every worker the
    # tests start: tests/stack/test_worker_faults.py and test_standby.py use them.
    "TIDEGATE_FAULT_COMMANDS": "true",
})

@pytest.fixture(scope="session")
def tmp_root() -> Path:
    return TMP


@pytest.fixture(scope="session")
def model_path() -> Path:
    from tidegate_tools.testmodel import build_test_model

    return build_test_model(Path(os.environ["TIDEGATE_MODEL"]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """TIDEGATE_SHUFFLE_MODULES=<seed> (`make test-shuffled`): the test modules in an order
    shuffled by the seed, each module's tests in their file order, so a module that
    counts on another running before or after it fails. The order is the files' by default.

    Modules only, not pytest-randomly's every level: tests of one module share its
    module-scoped processes (a vLLM worker) in an order they are written for."""
    seed = os.environ.get("TIDEGATE_SHUFFLE_MODULES")
    if not seed:
        return
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = sorted(modules)
    random.Random(seed).shuffle(order)
    items[:] = [item for module in order for item in modules[module]]


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = os.environ.get("TIDEGATE_SHUFFLE_MODULES")
    return f"test modules shuffled, seed {seed} (TIDEGATE_SHUFFLE_MODULES)" if seed else None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The temp root goes once every test passed (a full run leaves about 90 MB of logs
    and databases); after a failure it stays, for the processes' logs. Session fixtures
    have stopped their processes by now."""
    if exitstatus == pytest.ExitCode.OK:
        shutil.rmtree(TMP, ignore_errors=True)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter,
                            exitstatus: int) -> None:
    if exitstatus != pytest.ExitCode.OK:
        terminalreporter.write_line(f"the processes' logs and databases are kept in {TMP}")
