"""Reading worker heartbeats: the fleet as the scheduler and `tidegate status` see it."""

from __future__ import annotations

import json
from typing import Any

import redis

from tidegate import keys
from tidegate.settings import Settings


def read_fleet(client: redis.Redis, namespace: str) -> list[dict[str, Any]]:
    fleet = []
    for key in client.scan_iter(match=keys.worker_heartbeat_pattern(namespace), count=100):
        raw = client.get(key)
        if raw:
            fleet.append(json.loads(raw))
    return sorted(fleet, key=lambda w: w["name"])


def print_fleet(settings: Settings) -> None:
    fleet = read_fleet(redis.Redis.from_url(settings.redis_url), settings.namespace)
    if not fleet:
        print("no worker is heartbeating")
        return
    head = f"{'worker':36} {'state':9} {'lanes':10} {'engine':7} {'kv dtype':8} {'kv tokens':>9} " \
           f"{'run':>4} {'wait':>4} {'kv use':>6} {'prefix hit':>10}"
    print(head)
    for w in fleet:
        s = w.get("stats", {})
        print(f"{w['name'][:36]:36} {w['state']:9} {','.join(w['lanes']):10} "
              f"{w.get('engine', '-'):7} {w['kv_cache_dtype']:8} "
              f"{s.get('kv_capacity_tokens', 0):>9} {s.get('running', 0):>4} "
              f"{s.get('waiting', 0):>4} {s.get('kv_usage', 0.0):>6.1%} "
              f"{s.get('prefix_hit_rate', 0.0):>10.1%}")
