"""`tidegate status`: the fleet from its heartbeats, and the scheduler's recent actions."""

from __future__ import annotations

import json
import time

from tidegate import redisconn
from tidegate.fleet import read_fleet, recent_actions
from tidegate.records import EngineStats, Heartbeat
from tidegate.settings import Settings


def print_fleet(settings: Settings) -> None:
    client = redisconn.sync_client(settings.redis_url)
    _print_workers(read_fleet(client, settings.namespace))
    actions = [a for a in recent_actions(client, settings.namespace, 50)
               if a.get("action") != "tick"][-10:]
    if actions:
        print("\nrecent scheduler actions:")
        for a in actions:
            detail = {k: v for k, v in a.items() if k not in ("ts", "action")}
            when = time.strftime("%H:%M:%S", time.localtime(a["ts"]))
            print(f"  {when} {a['action']:20} {json.dumps(detail)}")


def _print_workers(fleet: list[Heartbeat]) -> None:
    if not fleet:
        print("no worker is heartbeating")
        return
    head = (f"{'worker':32} {'state':8} {'lanes':8} {'pool':9} {'engine':7} {'kv dtype':8} "
            f"{'kv tokens':>9} {'slots':>5} {'run':>4} {'wait':>4} {'kv use':>6} {'hit':>6} "
            f"{'alloc ms':>8} {'evict':>7} {'policy':7} {'metrics':>7} lora")
    print(head)
    for w in fleet:
        print(_row(w))


def _row(w: Heartbeat) -> str:
    s = w.stats or EngineStats()
    kv = w.kv_cache_dtype if w.kv_cache_dtype != "auto" else w.dtype
    return (f"{w.name[:32]:32} {w.state:8} {','.join(w.lanes):8} "
            f"{w.pool:9} {w.engine or '-':7} {kv:8} "
            f"{s.kv_capacity_tokens:>9} {w.slots:>5} {s.running:>4} {s.waiting:>4} "
            f"{s.kv_usage:>6.1%} {s.prefix_hit_rate:>6.1%} "
            f"{_ms(s.avg_cache_allocation_latency_ms):>8} {s.kv_evictions:>7} "
            f"{s.kv_policy or '-':7} {_port(w.metrics_port):>7} {','.join(w.lora) or '-'}")


def _port(port: int) -> str:
    """Where the worker serves /metrics, on its host: chosen at its start where the
    configured port was taken (workers/metrics.py)."""
    return f":{port}" if port else "-"


def _ms(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, int | float) else "-"
