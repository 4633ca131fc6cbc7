"""One beat across scheduler replicas: celery-redbeat, its schedule and its lock in Redis.

Every `tidegate scheduler` runs an embedded beat, but only the one holding redbeat's lock
(`keys.beat_lock`) sends the periodic tasks; the others wait to take the lock over. The
schedule lives in Redis too, so no replica writes a schedule file. The per-period locks in
scheduler/service.py (`take_period`) stay as a second guard: a tick sent twice in one
period still acts once.

redbeat itself ends its beat on the first Redis error of a tick (its lock's extend is not
retried) or when its lock was lost (an expiry during a stall, or a Redis failover that lost
the last writes); its worker would then run on with no beat. `OneBeat` keeps the beat
alive instead: it stands by and takes the lock again once it is free.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from redbeat import RedBeatScheduler
from redbeat.schedulers import LUA_EXTEND_TO_SCRIPT, get_redis
from redis.exceptions import LockError
from redis.lock import Lock

from tidegate import keys, redisconn
from tidegate.settings import Settings

log = logging.getLogger("tidegate.scheduler")

# The holder renews its lock at least this often (celery's beat_max_loop_interval), and a
# waiting beat asks for it this often.
BEAT_LOOP_MAX_S = 5.0
# A lock outlives its last renewal this long: past a Redis failover (the sentinels'
# down-after time plus a promotion), so the holder keeps it through one; short enough
# that a replica takes over within half a minute of its holder being killed.
BEAT_LOCK_S = 30.0
# redbeat's Redis calls retry a lost connection this long before the tick gives up.
BEAT_REDIS_RETRY_S = 15.0


def beat_config(settings: Settings) -> dict[str, object]:
    """The Celery settings that make the embedded beat redbeat's, on the deployment's
    Redis (one server or Sentinel) under its namespace."""
    loop_s = min(settings.reconcile_s, settings.scheduler_tick_s, BEAT_LOOP_MAX_S)
    url, options = redbeat_redis(settings.redis_url)
    return {
        "beat_scheduler": f"{OneBeat.__module__}.{OneBeat.__qualname__}",
        "beat_max_loop_interval": loop_s,
        "redbeat_redis_url": url,
        "redbeat_redis_options": {**options, "retry_period": BEAT_REDIS_RETRY_S},
        "redbeat_key_prefix": keys.beat_prefix(settings.namespace),
        "redbeat_lock_key": keys.beat_lock(settings.namespace),
        "redbeat_lock_timeout": max(BEAT_LOCK_S, 5 * loop_s),
    }


def redbeat_redis(url: str) -> tuple[str, dict[str, Any]]:
    """redbeat's URL and client options for a TIDEGATE_REDIS_URL: a plain URL as it is;
    Sentinel (tidegate/redisconn.py) as redbeat reads it, `redis-sentinel://` with the
    sentinels, the master's name, its DB and credentials in the options."""
    if not redisconn.is_sentinel(url):
        return url, {}
    target = redisconn.parse_sentinel(url)
    options: dict[str, Any] = {"sentinels": list(target.sentinels),
                               "service_name": target.master, "db": target.db,
                               "password": target.password}
    if target.username:
        options["username"] = target.username
    if target.sentinel_password:
        options["sentinel_kwargs"] = {"password": target.sentinel_password}
    return "redis-sentinel://", options


class OneBeat(RedBeatScheduler):  # type: ignore[misc]  # redbeat has no type hints
    """redbeat's scheduler, sending only while it holds the lock, and never ended by a
    lost lock or a Redis outage: it stands by and tries again after `max_interval`."""

    lock: Lock | None  # redis-py's Lock while this beat has one (redbeat's attribute)

    def tick(self, *args: object, **kwargs: object) -> float:
        try:
            if not self._hold_lock():
                return float(self.max_interval)  # another beat sends the schedule
            self._keep_schedule()
            return float(super().tick(*args, **kwargs))  # renews the lock, sends what is due
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("beat: Redis unreachable (%s); trying again in %g s",
                        type(exc).__name__, self.max_interval)
        except LockError:  # it expired between the check and the renewal
            log.warning("beat: lost its lock; taking it again when it is free")
        return float(self.max_interval)

    def _hold_lock(self) -> bool:
        """Whether this beat holds the lock now, taking it if it is free."""
        if self.lock is None:  # its first take failed (Redis down at start)
            self.lock = self._new_lock()
        if self.lock.owned():
            return True
        if self.lock.acquire(blocking=False):
            log.info("beat: took the lock %s; this beat sends the schedule", self.lock_key)
            return True
        return False

    def _keep_schedule(self) -> None:
        """The schedule written again when Redis lost it (restarted empty, or a failover
        that lost the last writes): redbeat writes it only at its start, and a beat whose
        schedule is gone sends nothing, the reconciler that rebuilds Redis included."""
        if not get_redis(self.app).exists(self.app.redbeat_conf.schedule_key):
            log.warning("beat: the schedule is gone from Redis; writing it again")
            self.setup_schedule()

    def _new_lock(self) -> Lock:
        """The lock as redbeat's start takes it (redbeat.schedulers, beat_init)."""
        client = get_redis(self.app)
        lock = client.lock(self.lock_key, timeout=self.lock_timeout, sleep=self.max_interval)
        lock.lua_extend = client.register_script(LUA_EXTEND_TO_SCRIPT)
        return lock
