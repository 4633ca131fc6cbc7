"""Settings of where tidegate's state lives: Redis (the broker, heartbeats, the token
streams), the store, the local data folder, the model and the lanes file, and the bounds on
every call to Redis and PostgreSQL. One group of `tidegate.settings.Settings`' fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypedDict

from pydantic import BaseModel, Field, field_validator

from tidegate import redisconn
from tidegate.lanes import DEFAULT_LANES_FILE

DATA_DIR = Path("data")


class StoreTimeouts(TypedDict):
    """The Store's keyword arguments for its bounds (store/engine.py)."""

    connect_timeout_s: int
    statement_timeout_s: float


class ConnectionSettings(BaseModel):
    """Redis, the database, local files, the model and the lanes file."""

    data_dir: Path = Field(
        DATA_DIR,
        description="Where tidegate keeps its local files: the test and fetched checkpoints "
        "(models/), the SQLite database when TIDEGATE_DATABASE_URL is empty, the development "
        "webhook key, the demo's logs.")
    # Broker, token streams, heartbeats: one server, or sentinel://... (tidegate/redisconn.py)
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis for the broker, heartbeats, and the token streams and leases unless "
        "TIDEGATE_STREAMS_URL puts them apart: "
        "redis://[:PASSWORD@]host:6379/0, or a master behind Redis Sentinel, "
        "sentinel://host:26379;host2:26379/0?master=NAME (docs/operations.md, Redis Sentinel).")
    # Token streams apart from the broker (tidegate/redisconn.py, "token streams").
    streams_url: str = Field(
        "",
        description="Redis for the jobs' token streams, leases and cancel keys, apart from the "
        "broker: redis://..., sentinel://..., or a Redis Cluster, "
        "redis+cluster://host:7000,host2:7000 (the shards share the token traffic). Empty: "
        "TIDEGATE_REDIS_URL. Every process of a deployment must name the same one.")
    database_url: str = Field(
        "",
        description="The store: sqlite:///PATH or postgresql://...; empty: the SQLite file "
        "tidegate.db in TIDEGATE_DATA_DIR.")
    # Every call to Redis or PostgreSQL is bounded (the invariant): past a bound it fails,
    # and the API answers 503 with Retry-After, a worker retries. Redis (tidegate/
    # redisconn.py): connecting, and each reply. PostgreSQL (store/engine.py): connecting,
    # in whole seconds (libpq's least is 2), and each statement, which the server cancels
    # (0: no bound); the defaults are store/engine.py's.
    redis_connect_timeout_s: float = Field(
        redisconn.CONNECT_TIMEOUT_S, gt=0,
        description="Every Redis client (API, workers, scheduler, the Celery broker, Sentinel's "
        "sentinels): a connection not made in this long fails (the API answers 503 with "
        "Retry-After, a worker retries).")
    redis_socket_timeout_s: float = Field(
        redisconn.SOCKET_TIMEOUT_S, gt=0,
        description="The same clients: a reply not read in this long fails. The API's SSE client "
        "waits TIDEGATE_SSE_KEEPALIVE_S + 10 s (its XREAD blocks 1 s); on a Sentinel URL a "
        "command is tried 16 times over about 12.5 s, each try so bounded.")
    database_connect_timeout_s: int = Field(
        5, ge=2,
        description="PostgreSQL: a connection not made in this long fails (whole seconds, at "
        "least 2, libpq's least); a peer that stops acknowledging is dropped after 10 s (TCP "
        "keepalives, tcp_user_timeout).")
    database_statement_timeout_s: float = Field(
        30.0, ge=0,
        description="PostgreSQL's statement_timeout on every connection: the server cancels a "
        "statement running longer (0: no bound). Migrations (tidegate db upgrade) are not "
        "bounded.")
    model: str = Field(
        "",
        description="A Hugging Face checkpoint folder the workers load; the API names the model "
        "by its last part (and reads only its tokenizer, or none when TIDEGATE_TOKENIZER is set). "
        "Empty: the toy test checkpoint, TIDEGATE_DATA_DIR/models/tidegate-test, for a worker; "
        "make demo and tidegate up serve SmolLM2-135M-Instruct (tidegate_tools/realmodel.py).")
    lanes_file: Path = Field(
        DEFAULT_LANES_FILE,
        description="The lanes file: each lane's queue, precision, engine pools, limits, workers "
        "and peaks, and the [service_tiers] table (the lane fields below).")
    # Pub/sub channels ignore the Redis DB number: tidegate's keys and channels get this prefix.
    namespace: str = Field(
        "tidegate",
        description="Prefix of tidegate's own Redis keys and channels and of each worker's direct "
        "queue. The lanes' queues are named by the lanes file and Celery's own keys have no "
        "prefix: two deployments on one Redis need a database number each (the /N of "
        "TIDEGATE_REDIS_URL) and a namespace each (pub/sub channels ignore the database "
        "number).")

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str) -> str:
        return redisconn.validate(v)  # one server, or Sentinel (tidegate/redisconn.py)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        # A job's keys carry a hash tag in braces (tidegate/keys.py): a brace before it
        # would make Redis Cluster hash the wrong part.
        if not v or "{" in v or "}" in v or any(c.isspace() for c in v):
            raise ValueError("must be a non-empty name without braces or spaces")
        return v

    @field_validator("streams_url")
    @classmethod
    def _streams_url(cls, v: str) -> str:
        return redisconn.validate_streams(v)

    @field_validator("database_url")
    @classmethod
    def _db_scheme(cls, v: str) -> str:
        if v and not v.startswith(("sqlite", "postgresql")):
            raise ValueError("must be a sqlite:// or postgresql:// URL")
        return v

    @property
    def redis_timeouts(self) -> redisconn.Timeouts:
        """redis-py's timeout options: `redisconn.sync_client(url, **redis_timeouts)`."""
        return redisconn.timeouts(self.redis_connect_timeout_s, self.redis_socket_timeout_s)

    @property
    def streams_redis_url(self) -> str:
        """Where the token streams live: TIDEGATE_STREAMS_URL, else TIDEGATE_REDIS_URL."""
        return self.streams_url or self.redis_url

    @property
    def store_timeouts(self) -> StoreTimeouts:
        """The Store's timeouts: `Store(settings.db_url, **settings.store_timeouts)`."""
        return StoreTimeouts(connect_timeout_s=self.database_connect_timeout_s,
                             statement_timeout_s=self.database_statement_timeout_s)

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'tidegate.db').resolve()}"
