"""Redis clients from `TIDEGATE_REDIS_URL`: one server, or a master watched by Sentinel.

Every process builds its Redis clients and its Celery broker here, from the one URL, so the
broker, the token streams, the leases, the heartbeats and pub/sub always reach the same
master. Two forms:

    redis://[[user]:password@]host[:port][/db]     one server, read by redis-py's from_url
    (also rediss:// and unix://)

    sentinel://[[user]:password@]host[:port][;host[:port]...][/db]?master=NAME
        [&sentinel_password=SECRET]

The Sentinel form lists the sentinels to ask (`;` or `,` between them, port 26379 when
left out), the name they monitor the master under (`sentinel monitor NAME ...`), and the
DB on that master. Credentials before `@` are the master's (and its replicas'), as
`masterauth` has them; `sentinel_password` is the sentinels' own `requirepass`, if any.
TLS to a Sentinel-managed master is not supported.

How a failover is survived:
- redis-py's Sentinel-managed pools ask a sentinel for the master's address on every new
  connection; a connection that reaches a demoted master gets READONLY, which redis-py
  turns into a reconnect. A command in flight when the master dies fails with a
  ConnectionError and is retried (FAILOVER_RETRIES) on a connection to whatever master
  the sentinels name by then: refused, with backoff, until they have promoted a replica.
  `_FailoverConnection` makes that reconnect ask the sentinels (redis-py's does not).
- Celery's broker uses kombu's Sentinel transport, which builds the same pools:
  kombu wants `sentinel://h:p;sentinel://h:p` and the master's name in
  `broker_transport_options["master_name"]` (kombu/transport/redis.py, SentinelChannel);
  `celery_broker` writes both. Celery reconnects its consumer after a lost connection
  (tasks/broker.py keeps that from killing a worker).
- Replication is asynchronous: writes acknowledged by the old master in its last
  milliseconds can be missing on the new one. The store is the truth; what Redis lost is
  rebuilt from it (the reconciler), never assumed.

Every client is bounded in time: a connection not made within its connect timeout, or a
reply not read within its socket timeout, fails with redis-py's TimeoutError or
ConnectionError (a RedisError: the API answers 503, a worker retries), so a blackholed
Redis (a host that accepts and never answers, a partition) costs a call its timeout, never
a thread for good. `timeouts()` gives both; these clients and the Celery broker
(`celery_broker`) take them by default. A blocking read (XREAD BLOCK, BRPOP, a pub/sub
wait) needs a socket timeout longer than its block: the API's SSE client has its own
(api/deps.py), kombu's BRPOP blocks 1 s, a worker's cancel listener polls every 1 s.
On a Sentinel URL a failed command is retried (FAILOVER_RETRIES), each try bounded so: a
blackholed master or sentinel fails a command after its 16 tries' timeouts plus the
backoff's 12.5 s (about 90 s at the default socket timeout), the price of riding out a
failover; a plain URL fails it after one timeout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict, cast
from urllib.parse import parse_qs, quote, unquote

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.cluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.asyncio.sentinel import SentinelManagedConnection as AsyncSentinelConnection
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.commands.policies import (
    CommandPolicies,
    PolicyResolver,
    RequestPolicy,
    ResponsePolicy,
    StaticPolicyResolver,
)
from redis.connection import parse_url
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelManagedConnection

PLAIN_SCHEMES = ("redis://", "rediss://", "unix://")
# Token streams only (TIDEGATE_STREAMS_URL): a Redis Cluster, named by some of its nodes.
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
CLUSTER_FORM = "redis+cluster://[[user]:password@]host:port[,host:port...]"
CLUSTER_PORT = 6379
SENTINEL_SCHEME = "sentinel://"
SENTINEL_PORT = 26379
SENTINEL_FORM = "sentinel://[[user]:password@]host[:port][;host[:port]...][/db]?master=NAME"
QUERY_KEYS = ("master", "sentinel_password")
# How long a command on a Sentinel-managed client keeps trying while there is no master:
# sleeps of 0.1, 0.2, 0.4, 0.8, then 1 s, 15 retries, about 12.5 s. A failover takes the
# sentinels' down-after-milliseconds plus a second or two (5 s is a common setting). Past
# that the command raises ConnectionError (the API answers 503). redis-py's from_url
# clients retry nothing by default; plain URLs keep that.
FAILOVER_BACKOFF = ExponentialBackoff(cap=1.0, base=0.05)
FAILOVER_RETRIES = 15
# Defaults of TIDEGATE_REDIS_CONNECT_TIMEOUT_S and TIDEGATE_REDIS_SOCKET_TIMEOUT_S (and of
# any client made without settings). A reply on a LAN takes well under a millisecond; a
# Redis busy with a slow command or a fork for its snapshot, a few hundred.
CONNECT_TIMEOUT_S = 2.0
SOCKET_TIMEOUT_S = 5.0


class Timeouts(TypedDict):
    """redis-py's connection options for a connect and a reply timeout, as `timeouts()`
    gives them: every client here takes them (`sync_client(url, **timeouts)`)."""

    socket_connect_timeout: float
    socket_timeout: float


class _SentinelOptions(Timeouts, total=False):
    """How a client talks to the sentinels themselves (`_sentinel_kwargs`)."""

    retry: Retry | AsyncRetry
    password: str


class _ClusterOptions(Timeouts, total=False):
    """A Redis Cluster client's options, from a `redis+cluster://` URL."""

    username: str | None
    password: str | None
    ssl: bool
    max_connections: int


def timeouts(connect_s: float = CONNECT_TIMEOUT_S,
             socket_s: float = SOCKET_TIMEOUT_S) -> Timeouts:
    """redis-py's connection options for a connect and a reply timeout."""
    return {"socket_connect_timeout": connect_s, "socket_timeout": socket_s}


@dataclass(frozen=True)
class SentinelTarget:
    """A Sentinel URL, parsed."""

    sentinels: tuple[tuple[str, int], ...]  # (host, port) of each sentinel, in URL order
    master: str  # the name the sentinels monitor the master under
    db: int = 0  # the DB number on the master
    username: str | None = field(default=None, repr=False)  # the master's ACL user
    password: str | None = field(default=None, repr=False)  # the master's password
    sentinel_password: str | None = field(default=None, repr=False)  # the sentinels' own


def is_sentinel(url: str) -> bool:
    return url.startswith(SENTINEL_SCHEME)


def validate(url: str) -> str:
    """`url` if either form reads it; ValueError naming what is wrong otherwise."""
    if is_sentinel(url):
        parse_sentinel(url)
        return url
    if not url.startswith(PLAIN_SCHEMES):
        raise ValueError(f"must start with redis://, rediss://, unix:// or {SENTINEL_SCHEME} "
                         f"(Sentinel: {SENTINEL_FORM})")
    try:
        parse_url(url)  # type: ignore[no-untyped-call]
    except ValueError as exc:
        raise ValueError(f"not a Redis URL ({exc})") from None
    return url


def parse_sentinel(url: str) -> SentinelTarget:
    """A `sentinel://` URL's parts; ValueError naming the part at fault, with the form."""
    rest = url.removeprefix(SENTINEL_SCHEME)
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    params = _query(query)
    if not params.get("master"):
        raise ValueError(f"names no master (?master=NAME); the form is {SENTINEL_FORM}")
    return SentinelTarget(
        sentinels=_hosts(hosts), master=params["master"], db=_db(path),
        username=unquote(username) or None, password=unquote(password) or None,
        sentinel_password=params.get("sentinel_password") or None)


def _query(query: str) -> dict[str, str]:
    params = parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(params) - set(QUERY_KEYS))
    if unknown:
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)}; known: "
                         f"{', '.join(QUERY_KEYS)}")
    return {name: values[-1] for name, values in params.items()}


def _hosts(hosts: str) -> tuple[tuple[str, int], ...]:
    items = [item.strip() for item in hosts.replace(",", ";").split(";")]
    if not any(items):
        raise ValueError(f"names no sentinel host; the form is {SENTINEL_FORM}")
    return tuple(_host_port(item) for item in items if item)


def _host_port(item: str, default_port: int = SENTINEL_PORT,
               what: str = "sentinel") -> tuple[str, int]:
    if item.startswith("["):  # an IPv6 address: [::1]:26379
        host, _, port = item[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = item.partition(":")
    if not host or (port and not port.isdigit()) or not 0 < int(port or default_port) < 65536:
        raise ValueError(f"{what} {item!r} is not host[:port]")
    return host, int(port or default_port)


def _db(path: str) -> int:
    if not path:
        return 0
    if not path.isdigit():
        raise ValueError(f"database {path!r} is not a number")
    return int(path)


def _sentinel_kwargs(target: SentinelTarget, bounds: Timeouts,
                     retry: Retry | AsyncRetry) -> _SentinelOptions:
    """How to talk to the sentinels themselves: the client's socket options (as redis-py
    does when not told otherwise), their own password, and `retry`: none. A master lookup
    is already retried by the command's failover retry; redis-py's default for a client
    (3 retries, backoff up to 10 s) inside each of those made a blackholed sentinel cost
    minutes, not FAILOVER_RETRIES times its timeout."""
    out = _SentinelOptions(socket_connect_timeout=bounds["socket_connect_timeout"],
                           socket_timeout=bounds["socket_timeout"], retry=retry)
    if target.sentinel_password:
        out["password"] = target.sentinel_password
    return out


def _master_kwargs(target: SentinelTarget) -> dict[str, int | str | None]:
    return {"db": target.db, "username": target.username, "password": target.password}


class _FailoverConnection(SentinelManagedConnection):
    """Asks the sentinels for the master on every reconnect. redis-py (7.x) reconnects a
    dropped connection inside a command's retry to the address it had, the dead master,
    until the retries run out (redis/redis-py#3874); only a connection taken fresh from the
    pool asked the sentinels. Here both do, one lookup per attempt: the command's own retry
    paces the attempts (a nested retry would multiply the wait)."""

    def connect_check_health(self, check_health: bool = True,
                             retry_socket_connect: bool = True) -> None:
        # connect_to() (after the lookup) passes retry_socket_connect=False; a reconnect
        # from send_command passes True: look the master up first.
        if retry_socket_connect and self.connection_pool.is_master:
            master = self.connection_pool.get_master_address()
            self.connect_to(master)  # type: ignore[no-untyped-call]
            return
        super().connect_check_health(check_health=check_health,
                                     retry_socket_connect=retry_socket_connect)


class _AsyncFailoverConnection(AsyncSentinelConnection):
    """_FailoverConnection for asyncio clients."""

    async def connect_check_health(self, check_health: bool = True,
                                   retry_socket_connect: bool = True) -> None:
        if retry_socket_connect and self.connection_pool.is_master:
            master = await self.connection_pool.get_master_address()
            await self.connect_to(master)  # type: ignore[no-untyped-call]
            return
        await super().connect_check_health(check_health=check_health,
                                           retry_socket_connect=retry_socket_connect)


def sync_client(url: str, *, socket_connect_timeout: float = CONNECT_TIMEOUT_S,
                socket_timeout: float = SOCKET_TIMEOUT_S) -> redis.Redis:
    """A client of the master, bounded by redis-py's two timeout options (`timeouts()`)."""
    options = timeouts(socket_connect_timeout, socket_timeout)
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **options)
    target = parse_sentinel(url)
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        list(target.sentinels),
        sentinel_kwargs=_sentinel_kwargs(target, options, Retry(NoBackoff(), 0)),
        retry=Retry(FAILOVER_BACKOFF, FAILOVER_RETRIES), **options)
    return cast(redis.Redis, sentinel.master_for(  # type: ignore[no-untyped-call]
        target.master, connection_class=_FailoverConnection, **_master_kwargs(target)))


class _BlockingSentinelPool(AsyncSentinelPool, aioredis.BlockingConnectionPool):
    """Sentinel's master lookup (its connection class and ownership check) with the
    blocking pool's bounded wait for a free connection."""


def async_client(url: str, *, max_connections: int | None = None,
                 pool_timeout_s: float | None = None,
                 socket_connect_timeout: float = CONNECT_TIMEOUT_S,
                 socket_timeout: float = SOCKET_TIMEOUT_S) -> aioredis.Redis:
    """An asyncio client of the master, on a pool of at most `max_connections` (None: no
    bound). With `pool_timeout_s`, a command waits that long for a free connection, then
    fails with ConnectionError; without, a full pool fails at once. The timeouts default
    to `timeouts()`."""
    options = timeouts(socket_connect_timeout, socket_timeout)
    pool_kwargs: dict[str, float | None] = {"max_connections": max_connections}
    if pool_timeout_s is not None:  # a blocking pool
        pool_kwargs = {"max_connections": max_connections or 50, "timeout": pool_timeout_s}
    if not is_sentinel(url):
        if pool_timeout_s is not None:
            pool = aioredis.BlockingConnectionPool.from_url(url, **pool_kwargs, **options)
            return aioredis.Redis.from_pool(pool)
        return aioredis.Redis.from_url(url, max_connections=max_connections, **options)
    target = parse_sentinel(url)
    sentinel = AsyncSentinel(  # type: ignore[no-untyped-call]
        list(target.sentinels),
        sentinel_kwargs=_sentinel_kwargs(target, options, AsyncRetry(NoBackoff(), 0)),
        retry=AsyncRetry(FAILOVER_BACKOFF, FAILOVER_RETRIES), **options)
    pool_class = _BlockingSentinelPool if pool_timeout_s is not None else AsyncSentinelPool
    return cast(aioredis.Redis, sentinel.master_for(
        target.master, redis_class=aioredis.Redis, connection_pool_class=pool_class,
        connection_class=_AsyncFailoverConnection, **_master_kwargs(target), **pool_kwargs))


class BrokerOptions(Timeouts, total=False):
    """Celery's broker_transport_options that `celery_broker` adds: the timeouts, and for
    Sentinel, the master's name and how to talk to the sentinels."""

    master_name: str
    sentinel_kwargs: _SentinelOptions


def celery_broker(url: str, bounds: Timeouts | None = None) -> tuple[str, BrokerOptions]:
    """The broker URL Celery (kombu) reads, and the transport options it needs on top of
    the app's own: the timeouts (`bounds`, redis-py's options as `timeouts()` gives them;
    default `timeouts()`), which kombu hands to every connection it makes, and for
    Sentinel, kombu's `sentinel://h:p/db;sentinel://...` form and the master's name."""
    bounds = timeouts() if bounds is None else bounds
    if not is_sentinel(url):
        return url, BrokerOptions(socket_connect_timeout=bounds["socket_connect_timeout"],
                                  socket_timeout=bounds["socket_timeout"])
    target = parse_sentinel(url)
    auth = ""
    if target.username or target.password:
        auth = f"{quote(target.username or '', safe='')}:{quote(target.password or '', safe='')}@"
    broker = ";".join(f"sentinel://{auth}{_netloc(host, port)}/{target.db}"
                      for host, port in target.sentinels)
    # kombu passes `sentinel_kwargs` as they are to the sentinels' clients (redis-py
    # copies the socket options into them only when none are given).
    options = BrokerOptions(
        master_name=target.master, socket_connect_timeout=bounds["socket_connect_timeout"],
        socket_timeout=bounds["socket_timeout"],
        sentinel_kwargs=_SentinelOptions(socket_connect_timeout=bounds["socket_connect_timeout"],
                                         socket_timeout=bounds["socket_timeout"]))
    if target.sentinel_password:
        options["sentinel_kwargs"]["password"] = target.sentinel_password
    return broker, options


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# -- token streams: TIDEGATE_STREAMS_URL ---------------------------------------------------
# A job's stream, lease and cancel key may live apart from the broker: on a Redis of their
# own, or on a Redis Cluster, whose shards then share the fleet's token traffic (one Redis
# carried about two GPUs' worth of tokens: bench/README.md). Their keys carry a hash tag
# (tidegate/keys.py `job_tag`), so a job's keys sit on one shard, and the jobs of one tag
# share a slot: one script call appends many jobs' events, one XREAD reads many streams.


@dataclass(frozen=True)
class ClusterTarget:
    """A `redis+cluster://` URL, parsed: the nodes to learn the cluster's layout from."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool = False
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)


def is_cluster(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEMES)


def is_cluster_client(client: object) -> bool:
    """Whether `client` (sync or asyncio) talks to a Redis Cluster: its multi-key commands
    and scripts then take keys of one slot only."""
    return isinstance(client, redis.cluster.RedisCluster | aiocluster.RedisCluster)


def parse_cluster(url: str) -> ClusterTarget:
    """A `redis+cluster://` URL's parts; ValueError naming the part at fault, with the form."""
    scheme, _, rest = url.partition("://")
    netloc, _, path = rest.partition("/")
    if path.strip("/") not in ("", "0"):
        raise ValueError(f"a Redis Cluster has no database but 0 (got /{path}); the form is "
                         f"{CLUSTER_FORM}")
    userinfo, _, hosts = netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    items = [item.strip() for item in hosts.split(",")]
    if not any(items):
        raise ValueError(f"names no node; the form is {CLUSTER_FORM}")
    return ClusterTarget(tuple(_host_port(item, CLUSTER_PORT, "node") for item in items if item),
                         tls=scheme == "rediss+cluster", username=unquote(username) or None,
                         password=unquote(password) or None)


def validate_streams(url: str) -> str:
    """TIDEGATE_STREAMS_URL: empty (the streams live on TIDEGATE_REDIS_URL), a Redis, a
    Sentinel-managed master, or a Redis Cluster; ValueError naming what is wrong."""
    if not url:
        return url
    if is_cluster(url):
        parse_cluster(url)
        return url
    try:
        return validate(url)
    except ValueError as exc:
        raise ValueError(f"{exc}; or a Redis Cluster: {CLUSTER_FORM}") from None


def _cluster_kwargs(target: ClusterTarget, bounds: Timeouts) -> _ClusterOptions:
    out = _ClusterOptions(socket_connect_timeout=bounds["socket_connect_timeout"],
                          socket_timeout=bounds["socket_timeout"], username=target.username,
                          password=target.password)
    if target.tls:
        out["ssl"] = True
    return out


class _ScriptsByKeys(StaticPolicyResolver):
    """redis-py's (7.x) cluster pipeline routes a command its static policies do not name
    by asking the server for its keys (COMMAND GETKEYS, a round trip to one node) for
    every EVALSHA queued: measured, a third of one shard's CPU under the workers' appends,
    and a round trip per script call in the worker (bench/README.md). Named here, a script
    is routed by its declared keys, as RedisCluster.determine_slot already does outside a
    pipeline."""

    _KEYED = CommandPolicies(request_policy=RequestPolicy.DEFAULT_KEYED,
                             response_policy=ResponsePolicy.DEFAULT_KEYED)

    def resolve(self, command_name: str) -> CommandPolicies | None:
        if command_name in ("evalsha", "eval"):
            return self._KEYED
        return super().resolve(command_name)

    def with_fallback(self, fallback: PolicyResolver) -> PolicyResolver:
        return _ScriptsByKeys(fallback)


class _StreamsCluster(redis.cluster.RedisCluster):
    """RedisCluster whose pipelines route by the client's policies (_ScriptsByKeys):
    redis-py's pipeline() builds each pipeline with the default ones."""

    def pipeline(self, transaction: bool | None = None,
                 shard_hint: str | None = None) -> redis.cluster.ClusterPipeline:
        pipe = cast(redis.cluster.ClusterPipeline,
                    super().pipeline(transaction, shard_hint))  # type: ignore[no-untyped-call]
        pipe._policy_resolver = self._policy_resolver
        return pipe


# The token streams' client: one Redis (or a Sentinel-managed master), or a Redis Cluster
# (sync_streams_client). Code that takes either names this type.
StreamsClient = redis.Redis | redis.cluster.RedisCluster
StreamsPipeline = redis.client.Pipeline | redis.cluster.ClusterPipeline  # of either
# The same for asyncio (async_streams_client).
AsyncStreamsClient = aioredis.Redis | aiocluster.RedisCluster


def sync_streams_client(url: str, *, socket_connect_timeout: float = CONNECT_TIMEOUT_S,
                        socket_timeout: float = SOCKET_TIMEOUT_S) -> StreamsClient:
    """A client of the token streams' Redis (`url`, TIDEGATE_STREAMS_URL, or the main Redis's
    URL when that is empty): redis-py's RedisCluster for a cluster, which follows MOVED
    answers and a failover's new layout, retrying a command on a connection error
    (cluster_error_retry_attempts); else `sync_client`."""
    if not is_cluster(url):
        return sync_client(url, socket_connect_timeout=socket_connect_timeout,
                           socket_timeout=socket_timeout)
    target = parse_cluster(url)
    return _StreamsCluster(
        startup_nodes=[redis.cluster.ClusterNode(h, p)  # type: ignore[no-untyped-call]
                       for h, p in target.nodes],
        policy_resolver=_ScriptsByKeys(),
        **_cluster_kwargs(target, timeouts(socket_connect_timeout, socket_timeout)))


def async_streams_client(url: str, *, max_connections: int | None = None,
                         pool_timeout_s: float | None = None,
                         socket_connect_timeout: float = CONNECT_TIMEOUT_S,
                         socket_timeout: float = SOCKET_TIMEOUT_S) -> AsyncStreamsClient:
    """`sync_streams_client` for asyncio: a cluster's client bounds each node's pool by
    `max_connections` (its own default when None)."""
    if not is_cluster(url):
        return async_client(url, max_connections=max_connections,
                            pool_timeout_s=pool_timeout_s,
                            socket_connect_timeout=socket_connect_timeout,
                            socket_timeout=socket_timeout)
    target = parse_cluster(url)
    options = _cluster_kwargs(target, timeouts(socket_connect_timeout, socket_timeout))
    if max_connections is not None:
        options["max_connections"] = max_connections
    return aiocluster.RedisCluster(
        startup_nodes=[aiocluster.ClusterNode(h, p) for h, p in target.nodes], **options)
