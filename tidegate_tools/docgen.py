"""The generated parts of the docs: docs/settings.md, from the settings class
(tidegate/settings.py) and the lane model (tidegate/lanes.py) with the shipped lanes file,
and the table of contents at the top of each page under docs/.

`make docs` (or `tidegate docs`, or `python -m tidegate_tools.docgen`) writes them; with
`--check` it writes nothing and exits 1 naming what is stale. tests/unit/test_docs.py
fails when a setting or lane field has no description or a generated part is stale, so a
new setting is documented by its `Field(description=...)`, and one command brings the
pages up to date.
"""

from __future__ import annotations

import argparse
import re
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, time
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from tidegate.lanes import (
    DEFAULT_LANES_FILE,
    KvPolicy,
    Lane,
    PeakSpec,
    load_lanes,
    load_service_tiers,
)
from tidegate.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SETTINGS_DOC = DOCS / "settings.md"
ENV_PREFIX = str(Settings.model_config.get("env_prefix", ""))
# The table of contents of a page sits between these two lines.
TOC_START, TOC_END = "<!-- toc -->", "<!-- /toc -->"

# Settings by topic: the first group whose test takes a field's name holds it; the last
# takes every name, so a new setting is always listed.
GROUPS: list[tuple[str, str, Callable[[str], bool]]] = [
    ("Connections and store", "Redis, the database, and where local files go.",
     lambda n: n in ("data_dir", "namespace") or n.startswith(("redis_", "database_"))),
    ("Model and engines", "What the workers load and how each engine is sized.",
     lambda n: n in ("model", "tokenizer", "lanes_file", "engine_slots", "max_model_len",
                     "sim_profile", "lora_adapters", "session_affinity")
     or n.startswith("kv_")),
    ("API and admission", "The API process: its address, and the bounds every request meets.",
     lambda n: n.startswith(("api_", "auth_", "max_", "sse_"))),
    ("Batch API and files", "Batches, uploads and each tenant's quotas.",
     lambda n: n.startswith(("batch_", "tenant_")) and not n.endswith("_retention_days")),
    ("Retention", "What is purged, and when (docs/operations.md, What is kept).",
     lambda n: "retention" in n),
    ("Webhooks", "The webhook sender (`tidegate webhooks`) and its URL policy.",
     lambda n: n.startswith("webhook_")),
    ("Workers, streams and recovery", "Heartbeats, leases, token streams and retries.",
     lambda n: n in ("stream_maxlen", "stream_ttl_s", "hot_prefix_ttl_s", "heartbeat_s",
                     "max_attempts", "io_retry_s")),
    ("Scheduler", "The control plane: ticks, the reconciler, health, pre-warming, replays.",
     lambda n: n.startswith(("scheduler_tick", "reconcile_", "replay_")) or n in (
         "alloc_latency_threshold_ms", "restart_timeout_s", "prewarm")),
    ("Operations", "Metrics, logs, traces and Flower.",
     lambda n: n.startswith(("metrics_", "log_", "otlp_", "flower_"))
     or n.endswith("_metrics_port")),
    ("Other settings", "Settings of no group above.", lambda n: True),
]


# ---- rendering one field --------------------------------------------------------------


def env_name(field: str) -> str:
    return f"{ENV_PREFIX}{field}".upper()


def type_name(annotation: Any) -> str:
    """A field's type as a reader writes it: `int`, `fp8` or none, a list of strings."""
    origin = get_origin(annotation)
    if origin is Literal:
        return " or ".join(f"`{v}`" for v in get_args(annotation))
    if origin in (Union, types.UnionType):
        parts = [a for a in get_args(annotation) if a is not type(None)]
        name = " or ".join(type_name(a) for a in parts)
        return f"{name} or none" if len(parts) < len(get_args(annotation)) else name
    if origin is list:
        (item,) = get_args(annotation)
        return f"list of {type_name(item)}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table"
    names = {Path: "path", datetime: "datetime", time: "time (HH:MM)", str: "string",
             bool: "bool", int: "int", float: "number"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def bounds(info: FieldInfo) -> str:
    """The field's numeric bounds, as `> 0` or `1-65535`."""
    marks = {type(m).__name__: m for m in info.metadata}
    low = _mark(marks, ("Gt", "> ", "gt"), ("Ge", ">= ", "ge"))
    high = _mark(marks, ("Lt", "< ", "lt"), ("Le", "<= ", "le"))
    if low and high and low[0] == ">= " and high[0] == "<= ":
        return f"{value_text(low[1])}-{value_text(high[1])}"
    text = [f"{op}{value_text(v)}" for op, v in (low, high) if op]
    if "MinLen" in marks:
        text.append(f"at least {marks['MinLen'].min_length}")
    return ", ".join(text)


def _mark(marks: dict[str, object], *kinds: tuple[str, str, str]) -> tuple[str, Any]:
    """The first of `kinds` (annotated_types class, its sign, its attribute) present."""
    for kind, sign, attr in kinds:
        if kind in marks:
            return sign, getattr(marks[kind], attr)
    return "", None


def value_text(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, Path):
        try:
            return str(value.resolve().relative_to(ROOT))
        except ValueError:
            return str(value)
    return str(value)


def default_text(name: str, info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if value is None:
        return "unset"
    if value == "" or value == []:
        return "empty"
    if isinstance(value, BaseModel):
        return "defaults (below)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    text = f"`{value_text(value)}`"
    if isinstance(value, int) and "bytes" in name and value >= 1024 and value % 1024 == 0:
        text += f" ({_binary(value)})"
    return text


def _binary(n: int) -> str:
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n //= 1024
        if n < 1024 or n % 1024:
            return f"{n} {unit}"
    return f"{n} TiB"


def cell(text: str) -> str:
    """Description text for a table cell: pipes escaped, setting names as code."""
    text = " ".join(text.split()).replace("|", "\\|")
    return re.sub(r"(?<!`)\b(TIDEGATE_[A-Z0-9_]+)\b(?!`)", r"`\1`", text)


def undocumented(settings: type[BaseModel] = Settings,
                 lane_models: Sequence[tuple[type[BaseModel], str]] = (
                     (Lane, "lane"), (KvPolicy, "kv_policy"), (PeakSpec, "peaks"))) -> list[str]:
    """Every setting and lane field without a description (the docs test wants none)."""
    missing = [env_name(n) for n, f in settings.model_fields.items() if not _described(f)]
    for model, where in lane_models:
        missing += [f"{where}.{n}" for n, f in model.model_fields.items() if not _described(f)]
    return missing


def _described(info: FieldInfo) -> bool:
    return bool(info.description and info.description.strip())


# ---- docs/settings.md -----------------------------------------------------------------


HEADER = """\
# Settings reference

<!-- Generated by `make docs` (tidegate_tools/docgen.py) from tidegate/settings.py and
tidegate/lanes.py with tidegate/lanes.toml. Do not edit: change a field's description
there and run `make docs`. -->

Every tidegate process reads its settings from the environment, `{prefix}<NAME>`,
validated at start: a bad value stops the process with a message naming the setting.
The lanes (classes of traffic, each with its own queue, precision and limits) are a TOML
file, `{prefix}LANES_FILE`; a bad lane stops the process naming the lane and the field.
Where each setting matters is in the other pages: [architecture](architecture.md),
[API](api.md), [operations](operations.md), [security model](security.md).
"""


def settings_page() -> str:
    groups = _grouped()
    parts = [HEADER.format(prefix=ENV_PREFIX), TOC_START, "", TOC_END, "",
             "## Environment settings", ""]
    for title, intro, fields in groups:
        parts += [f"### {title}", "", intro, "", "| variable | type | default | what |",
                  "|---|---|---|---|"]
        for name, info in fields:
            kind = type_name(info.annotation)
            limit = bounds(info)
            kind = f"{kind} ({limit})" if limit else kind
            parts.append(f"| `{env_name(name)}` | {kind} | {default_text(name, info)} | "
                         f"{cell(info.description or '')} |")
        parts.append("")
    parts += _lanes_part()
    return with_toc("\n".join(parts).rstrip("\n") + "\n")


def _grouped() -> list[tuple[str, str, list[tuple[str, FieldInfo]]]]:
    taken: dict[str, list[tuple[str, FieldInfo]]] = {title: [] for title, _, _ in GROUPS}
    for name, info in Settings.model_fields.items():
        title = next(t for t, _, test in GROUPS if test(name))
        taken[title].append((name, info))
    return [(t, intro, taken[t]) for t, intro, _ in GROUPS if taken[t]]


LANES_INTRO = """\
## Lanes file

`{prefix}LANES_FILE` (shipped: `tidegate/lanes.toml`) holds one `[lanes.NAME]` table
per lane, and a `[service_tiers]` table mapping OpenAI's `service_tier` onto lanes. Priority
is public 0-9, 9 the most urgent. A field left out takes its default.
"""


def _field_table(model: type[BaseModel], skip: Sequence[str] = ()) -> list[str]:
    rows = ["| field | type | default | what |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        kind = type_name(info.annotation)
        limit = bounds(info)
        kind = f"{kind} ({limit})" if limit else kind
        rows.append(f"| `{name}` | {kind} | {default_text(name, info)} | "
                    f"{cell(info.description or '')} |")
    return rows


def _lanes_part() -> list[str]:
    lanes = load_lanes(DEFAULT_LANES_FILE)
    tiers = load_service_tiers(DEFAULT_LANES_FILE, lanes)
    parts = [LANES_INTRO.format(prefix=ENV_PREFIX), "### Lane fields", "",
             "`[lanes.NAME]`; the lane's name is the table's NAME.", "",
             *_field_table(Lane, skip=("name",)), "",
             "### KV cache policy fields", "",
             "`[lanes.NAME.kv_policy]`: session-priority eviction "
             "(workers/kvcache/policy.py explains each number; priorities on TensorRT-LLM's "
             "0-100 retention scale, higher kept longer).", "", *_field_table(KvPolicy), "",
             "### Peak window fields", "",
             "`[[lanes.NAME.peaks]]`, one table per declared peak window "
             "(scheduler/peaks.py).", "", *_field_table(PeakSpec), "",
             "### Shipped lanes", "",
             "What `tidegate/lanes.toml` sets, each field's value as tidegate reads it.", "",
             "| field | " + " | ".join(f"`{n}`" for n in lanes) + " |",
             "|---|" + "---|" * len(lanes)]
    for name in Lane.model_fields:
        if name in ("name", "description"):
            continue
        values = [_lane_value(getattr(lane, name)) for lane in lanes.values()]
        parts.append(f"| `{name}` | " + " | ".join(values) + " |")
    parts += ["", "### Service tiers", "",
              "`[service_tiers]` in the shipped file: OpenAI's `service_tier` -> lane.", "",
              "| tier | lane |", "|---|---|"]
    parts += [f"| `{tier}` | `{lane}` |" for tier, lane in tiers.items()]
    return [*parts, ""]


def _lane_value(value: object) -> str:
    if isinstance(value, KvPolicy):
        changed = {k: v for k, v in value if v != KvPolicy.model_fields[k].default}
        return ", ".join(f"{k} {value_text(v)}" for k, v in changed.items()) or "defaults"
    if value is None or value == []:
        return "-"
    if isinstance(value, list):
        return ", ".join(cell(str(v)) if isinstance(v, str) else cell(repr(v)) for v in value)
    if isinstance(value, bool):
        return str(value).lower()
    return cell(value_text(value))


# ---- tables of contents ---------------------------------------------------------------


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(text: str) -> Iterator[tuple[int, str, str]]:
    """(level, title, anchor) of each heading outside code blocks, anchors made unique
    as GitHub makes them (a repeat gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        match = None if fenced else re.match(r"^(#{1,6}) +(.+?) *#*$", line)
        if not match:
            continue
        base = anchor(match[2])
        count = seen.get(base, 0)
        seen[base] = count + 1
        yield len(match[1]), match[2], base if count == 0 else f"{base}-{count}"


def toc(text: str) -> str:
    """The contents list of a page: its `##` and `###` headings, `###` indented."""
    lines = ["**Contents**", ""]
    for level, title, slug in headings(text):
        if level in (2, 3):
            indent = "  " * (level - 2)
            lines.append(f"{indent}- [{title.replace('`', '')}](#{slug})")
    return "\n".join(lines)


def with_toc(text: str) -> str:
    """The page with the block between TOC_START and TOC_END replaced by its contents."""
    start, end = text.find(TOC_START), text.find(TOC_END)
    if start < 0 or end < start:
        return text
    return f"{text[:start]}{TOC_START}\n{toc(text)}\n{text[end:]}"


# ---- the command ----------------------------------------------------------------------


def generated() -> dict[Path, str]:
    """Every generated page, as it should read: settings.md, and each page's contents."""
    pages = {SETTINGS_DOC: settings_page()}
    for path in sorted(DOCS.glob("*.md")):
        if path != SETTINGS_DOC:
            pages[path] = with_toc(path.read_text())
    return pages


def stale() -> list[Path]:
    return [p for p, text in generated().items() if not p.exists() or p.read_text() != text]


def run(check: bool = False) -> int:
    missing = undocumented()
    if missing:
        print("no description (add Field(description=...)): " + ", ".join(missing),
              file=sys.stderr)
    if check:
        for path in stale():
            print(f"stale: {path.relative_to(ROOT)} (run `make docs`)", file=sys.stderr)
        return 1 if missing or stale() else 0
    DOCS.mkdir(exist_ok=True)
    for path, text in generated().items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 1 if missing else 0


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tidegate_tools.docgen", description=__doc__)
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    sys.exit(run(p.parse_args(argv).check))


if __name__ == "__main__":
    main()
