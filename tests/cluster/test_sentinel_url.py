"""The redis+sentinel:// URL form (shared/redis_conn.py): parsing, errors, redaction, and that
every client factory builds a sentinel-backed client from it (no server needed to build one)."""
from __future__ import annotations

import pytest
import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel

from shared.redis_conn import (SentinelURL, async_redis_client, is_sentinel_url, parse_sentinel_url,
                               redact_url, redis_client)


def test_parse_sentinels_service_db_password():
    su = parse_sentinel_url("redis+sentinel://:s%40cret@10.0.0.1:26379,10.0.0.2:26380,sentinel-3/kaiten/2")
    assert su == SentinelURL((("10.0.0.1", 26379), ("10.0.0.2", 26380), ("sentinel-3", 26379)), "kaiten", 2,
                             None, "s@cret")
    assert parse_sentinel_url("redis+sentinel://h:1/m") == SentinelURL((("h", 1),), "m", 0)
    assert parse_sentinel_url("REDIS+SENTINEL://u:p@[::1]:5/m").sentinels == (("::1", 5),)
    assert parse_sentinel_url("redis+sentinel://u:p@h:5/m").username == "u"


@pytest.mark.parametrize("url", ["redis+sentinel://h:1", "redis+sentinel://h:1/", "redis+sentinel:///m",
                                 "redis+sentinel://h:x/m", "redis+sentinel://h:1/m/x", "redis+sentinel://h:1/m/0/1",
                                 "redis+sentinel://:hunter2@h:99999/m", "redis://h:1/0"])
def test_bad_urls_are_clear_errors_without_the_password(url):
    with pytest.raises(ValueError) as e:
        parse_sentinel_url(url)
    assert "hunter2" not in str(e.value) and "SERVICE" in str(e.value) or "sentinel" in str(e.value)


def test_redact_url():
    assert redact_url("redis://:hunter2@h:6379/0") == "redis://:[redacted]@h:6379/0"
    assert redact_url("redis+sentinel://u:hunter2@a:1,b:2/m") == "redis+sentinel://u:[redacted]@a:1,b:2/m"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    assert not is_sentinel_url("redis://h:6379/0")


def test_every_factory_builds_a_sentinel_client():
    url = "redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/kaiten/3"
    r = redis_client(url, client_name="c")
    pool = r.connection_pool
    assert isinstance(pool, redis.sentinel.SentinelConnectionPool) and pool.service_name == "kaiten"
    assert pool.connection_kwargs["db"] == 3 and pool.connection_kwargs["password"] == "pw"
    assert [s.connection_pool.connection_kwargs["port"] for s in pool.sentinel_manager.sentinels] == [1, 2]
    assert pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs["password"] is None
    ar = async_redis_client(url)
    assert isinstance(ar.connection_pool, redis.asyncio.sentinel.SentinelConnectionPool)
    assert not isinstance(ar.connection_pool, redis.asyncio.BlockingConnectionPool)
    bounded = async_redis_client(url, max_connections=4, pool_wait_s=1.5)
    assert isinstance(bounded.connection_pool, redis.asyncio.sentinel.SentinelConnectionPool)
    assert isinstance(bounded.connection_pool, redis.asyncio.BlockingConnectionPool)
    assert bounded.connection_pool.max_connections == 4 and bounded.connection_pool.timeout == 1.5
    plain = async_redis_client("redis://127.0.0.1:1/0", max_connections=4, pool_wait_s=1.5)
    assert type(plain.connection_pool) is redis.asyncio.BlockingConnectionPool
    assert plain.connection_pool.max_connections == 4
