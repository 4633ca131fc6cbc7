"""What `pip install` of the server puts at the top of site-packages: `tidegate_server`
only, with the server's packages inside it, and entry points (the command, the vLLM
plugins) that go through it. A CRM app's own `api/` or `tasks.py`, and PyPI
distributions of such names, are then neither shadowed nor shadowing."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("api", "tasks", "workers", "scheduler", "store", "tidegate", "tidegate_tools",
          "migrations")


@pytest.fixture(scope="module")
def wheel(tmp_root: Path) -> Iterator[Path]:
    """The server's wheel, built from a copy of its sources (a build leaves build/ behind)."""
    src, out = tmp_root / "server-src", tmp_root / "server-wheel"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in (*LAYERS, "tidegate_server"):
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "--disable-pip-version-check", "-w", str(out),
                    str(src)], check=True, timeout=600, capture_output=True)
    (built,) = out.glob("tidegate-*.whl")
    yield built


def test_the_wheel_holds_one_top_level_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/", 1)[0] for name in names}
    assert tops == {"tidegate_server", wheel.name.split("-")[0] + "-0.1.0.dist-info"}
    for layer in LAYERS:
        assert any(n.startswith(f"tidegate_server/{layer}/") for n in names), layer
    assert "tidegate_server/tidegate/lanes.toml" in names  # data files came along
    assert "tidegate_server/migrations/versions/0010_api_keys.py" in names
    points = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "tidegate = tidegate_server:main" in points
    assert "tidegate_kv = tidegate_server:register_kv" in points


def test_installed_the_server_packages_are_seen_only_through_its_entry(wheel: Path,
                                                                       tmp_root: Path) -> None:
    env_dir = tmp_root / "server-venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    python = str(env_dir / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps",
                    "--disable-pip-version-check", str(wheel)], check=True, timeout=600)
    probe = ("import importlib.util as u, sys\n"
             f"layers = {LAYERS!r}\n"
             "before = [m for m in layers if u.find_spec(m)]\n"
             "import tidegate_server\n"
             "tidegate_server.use_server_packages()\n"
             "after = {m: u.find_spec(m).origin for m in layers if m != 'migrations'}\n"
             "print(before, all('/site-packages/tidegate_server/' in o for o in after.values()))")
    out = subprocess.run([python, "-c", probe], check=True, capture_output=True, text=True,
                         timeout=60, cwd="/").stdout.strip()
    assert out == "[] True"
