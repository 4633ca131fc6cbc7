"""Reading worker heartbeats: the fleet as the scheduler and `tidegate status` see it."""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from tidegate import keys
from tidegate.settings import Settings


def read_fleet(client: redis.Redis, namespace: str) -> list[dict[str, Any]]:
    fleet = []
    for key in client.scan_iter(match=keys.worker_heartbeat_pattern(namespace), count=100):
        raw: Any = client.get(key)
        if raw:
            fleet.append(json.loads(raw))
    return sorted(fleet, key=lambda w: w["name"])


def recent_actions(client: redis.Redis, namespace: str, count: int = 10) -> list[dict[str, Any]]:
    entries: Any = client.xrevrange(keys.scheduler_actions(namespace), count=count)
    return [json.loads(fields[b"a"]) for _, fields in reversed(entries)]


def print_fleet(settings: Settings) -> None:
    client = redis.Redis.from_url(settings.redis_url)
    fleet = read_fleet(client, settings.namespace)
    _print_workers(fleet)
    actions = [a for a in recent_actions(client, settings.namespace, 50)
               if a.get("action") != "tick"][-10:]
    if actions:
        print("\nrecent scheduler actions:")
        for a in actions:
            detail = {k: v for k, v in a.items() if k not in ("ts", "action")}
            when = time.strftime("%H:%M:%S", time.localtime(a["ts"]))
            print(f"  {when} {a['action']:20} {json.dumps(detail)}")


def _print_workers(fleet: list[dict[str, Any]]) -> None:
    if not fleet:
        print("no worker is heartbeating")
        return
    head = (f"{'worker':32} {'state':8} {'lanes':8} {'pool':9} {'engine':7} {'kv dtype':8} "
            f"{'kv tokens':>9} {'slots':>5} {'run':>4} {'wait':>4} {'kv use':>6} {'hit':>6} "
            f"{'alloc ms':>8} {'evict':>7} {'policy':7} lora")
    print(head)
    for w in fleet:
        s = w.get("stats", {})
        kv = w["kv_cache_dtype"] if w["kv_cache_dtype"] != "auto" else w["dtype"]
        print(f"{w['name'][:32]:32} {w['state']:8} {','.join(w['lanes']):8} "
              f"{w.get('pool', '-'):9} {w.get('engine', '-'):7} {kv:8} "
              f"{s.get('kv_capacity_tokens', 0):>9} {w.get('slots', 0):>5} "
              f"{s.get('running', 0):>4} {s.get('waiting', 0):>4} "
              f"{s.get('kv_usage', 0.0):>6.1%} {s.get('prefix_hit_rate', 0.0):>6.1%} "
              f"{_ms(s.get('avg_cache_allocation_latency_ms')):>8} {s.get('kv_evictions', 0):>7} "
              f"{s.get('kv_policy') or '-':7} {','.join(w.get('lora', [])) or '-'}")


def _ms(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, int | float) else "-"
