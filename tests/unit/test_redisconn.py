"""TIDEGATE_REDIS_URL's two forms (tidegate/redisconn.py): what each is read as, the
clients and the Celery broker built from it, and the error a malformed one gets at start.
Nothing here connects: clients connect on their first command."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio as aioredis
from pydantic import ValidationError

from tidegate import redisconn
from tidegate.settings import Settings

URL = "sentinel://:s3cret@10.0.0.1:26380;10.0.0.2/3?master=main"


def test_sentinel_url_names_sentinels_master_db_and_password() -> None:
    target = redisconn.parse_sentinel(URL)
    assert target.sentinels == (("10.0.0.1", 26380), ("10.0.0.2", 26379))
    assert (target.master, target.db, target.password) == ("main", 3, "s3cret")
    comma = redisconn.parse_sentinel("sentinel://a:1,[::1]:2?master=m&sentinel_password=x")
    assert comma.sentinels == (("a", 1), ("::1", 2)) and comma.db == 0
    assert comma.sentinel_password == "x" and comma.password is None


@pytest.mark.parametrize(("url", "says"), [
    ("sentinel://10.0.0.1:26379/0", "master=NAME"),
    ("sentinel://10.0.0.1:port/0?master=m", "'10.0.0.1:port' is not host[:port]"),
    ("sentinel://10.0.0.1:70000?master=m", "not host[:port]"),
    ("sentinel:///0?master=m", "no sentinel host"),
    ("sentinel://h/zero?master=m", "database 'zero'"),
    ("sentinel://h?master=m&service=x", "unknown parameter(s) service"),
    ("http://127.0.0.1:6379", "sentinel://"),
    ("redis://127.0.0.1:port/0", "not a Redis URL"),
])
def test_malformed_url_is_refused_at_start_naming_the_fault(url: str, says: str) -> None:
    with pytest.raises(ValidationError) as err:
        Settings(redis_url=url)
    assert err.value.errors()[0]["loc"] == ("redis_url",)
    assert says in str(err.value)


def test_plain_url_keeps_redis_py_from_url() -> None:
    url = "redis://127.0.0.1:6390/2"
    assert redisconn.celery_broker(url) == (url, redisconn.timeouts())
    client = redisconn.sync_client(url)
    assert client.connection_pool.connection_kwargs["port"] == 6390
    bounded = redisconn.async_client(url, max_connections=7, pool_timeout_s=1.5)
    assert isinstance(bounded.connection_pool, aioredis.BlockingConnectionPool)
    assert (bounded.connection_pool.max_connections, bounded.connection_pool.timeout) == (7, 1.5)


def test_celery_broker_is_kombus_sentinel_form_with_the_master_name() -> None:
    broker, options = redisconn.celery_broker(
        URL.replace("?master=main", "?master=main&sentinel_password=p"))
    assert broker == "sentinel://:s3cret@10.0.0.1:26380/3;sentinel://:s3cret@10.0.0.2:26379/3"
    bounds = redisconn.timeouts()
    assert options == {"master_name": "main", **bounds,
                       "sentinel_kwargs": {**bounds, "password": "p"}}


def test_sentinel_clients_ask_the_sentinels_for_the_master() -> None:
    client = redisconn.sync_client(URL, socket_timeout=3)
    pool = client.connection_pool
    assert isinstance(pool, redis.sentinel.SentinelConnectionPool)
    assert pool.service_name == "main" and pool.connection_kwargs["db"] == 3
    assert issubclass(pool.connection_class, redis.sentinel.SentinelManagedConnection)
    assert pool.connection_kwargs["retry"].get_retries() == redisconn.FAILOVER_RETRIES
    sentinels = pool.sentinel_manager.sentinels
    assert [s.connection_pool.connection_kwargs["port"] for s in sentinels] == [26380, 26379]

    bounded = redisconn.async_client(URL, max_connections=5, pool_timeout_s=2.0)
    apool = bounded.connection_pool
    assert isinstance(apool, aioredis.BlockingConnectionPool)
    assert isinstance(apool, aioredis.sentinel.SentinelConnectionPool)
    assert (apool.max_connections, apool.timeout, apool.service_name) == (5, 2.0, "main")


# -- TIDEGATE_STREAMS_URL: the token streams apart, maybe on a Redis Cluster ---------------

def test_cluster_url_names_its_nodes_credentials_and_tls() -> None:
    target = redisconn.parse_cluster("redis+cluster://app:pw@10.0.0.1:7000,10.0.0.2,[::1]:7002")
    assert target.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002))
    assert (target.username, target.password, target.tls) == ("app", "pw", False)
    assert redisconn.parse_cluster("rediss+cluster://h:7000/0").tls


@pytest.mark.parametrize(("url", "says"), [
    ("redis+cluster://", "names no node"),
    ("redis+cluster://h:7000/3", "no database but 0"),
    ("redis+cluster://h:port", "'h:port' is not host[:port]"),
    ("cluster://h:7000", "redis+cluster://"),
])
def test_malformed_streams_url_is_refused_at_start_naming_the_fault(url: str, says: str) -> None:
    with pytest.raises(ValidationError) as err:
        Settings(streams_url=url)
    assert err.value.errors()[0]["loc"] == ("streams_url",)
    assert says in str(err.value)


def test_streams_url_empty_means_the_main_redis_and_a_cluster_gets_a_cluster_client() -> None:
    assert Settings(streams_url="").streams_redis_url == Settings().redis_url
    sync = redisconn.sync_streams_client("redis://127.0.0.1:6379/0")
    assert isinstance(sync, redis.Redis) and not redisconn.is_cluster_client(sync)
    with pytest.raises(ValidationError):  # a brace would move the job keys' hash tag
        Settings(namespace="tg{x}")
