"""Session fixtures: a private Redis, a private SQLite database, the test checkpoint, and a
stack of real processes (API + one Celery worker per lane hosting vLLM on CPU).

The environment is set before anything reads the settings, so no test ever touches the
Redis or database of a running demo. Every process started here is stopped at the end,
whatever the outcome.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tidegate.procs import free_port

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
})

pytest_plugins = ["tests.stack"]


@pytest.fixture(scope="session")
def tmp_root() -> Path:
    return TMP


@pytest.fixture(scope="session")
def model_path() -> Path:
    from tidegate.testmodel import build_test_model

    return build_test_model(Path(os.environ["TIDEGATE_MODEL"]))


@pytest.fixture(scope="session")
def redis_server(tmp_root: Path) -> Iterator[str]:
    from tidegate.procs import start_redis

    proc = start_redis(REDIS_PORT, tmp_root / "logs")
    try:
        yield os.environ["TIDEGATE_REDIS_URL"]
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def migrated_db() -> str:
    from store import upgrade

    url = os.environ["TIDEGATE_DATABASE_URL"]
    upgrade(url)
    return url
