"""Redis connection factory: one place that sets timeouts, health checks and retries.

Every Kaiten process gets its Redis clients from here::

    from shared.redis_conn import redis_client, async_redis_client
    r = redis_client(url)                    # redis.Redis (sync), bytes in and out
    ar = async_redis_client(url)             # redis.asyncio.Redis
    ps = ar.pubsub()                         # pub/sub shares the same settings

Settings:

- the hiredis parser (pinned in pyproject; redis-py picks it up automatically when installed);
- explicit ``socket_connect_timeout`` and ``socket_timeout``, so a dead or wedged Redis surfaces as
  ``redis.ConnectionError``/``redis.TimeoutError`` instead of a hang. The read timeout must be longer
  than any ``BLOCK`` the caller uses (``min_socket_timeout_for_block``);
- ``health_check_interval``: an idle connection is PINGed before reuse, so a connection broken while
  idle (Redis restarted) is noticed and replaced instead of failing the first command;
- ``Retry`` with exponential backoff and jitter on connection and timeout errors: a command that
  fails because its connection broke is retried on a fresh connection a few times before the error
  reaches the caller. Callers that must never stall long (the engine loop) pass ``retries=0`` or 1
  and handle the outage themselves.
- responses are bytes (``decode_responses=False``): payloads are msgpack.
"""
from __future__ import annotations

import redis
import redis.asyncio
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.config import DEFAULT_REDIS_URL

# Errors worth a retry on a new connection (BusyLoadingError: Redis is starting and loading data).
RETRY_ERRORS = (RedisConnectionError, RedisTimeoutError, redis.exceptions.BusyLoadingError)

DEFAULT_SOCKET_TIMEOUT = 5.0
DEFAULT_CONNECT_TIMEOUT = 2.0
DEFAULT_HEALTH_CHECK_INTERVAL = 15
DEFAULT_RETRIES = 3


def hiredis_available() -> bool:
    from redis.utils import HIREDIS_AVAILABLE
    return bool(HIREDIS_AVAILABLE)


def min_socket_timeout_for_block(block_ms: int, margin_s: float = 1.0) -> float:
    """The smallest read timeout that lets a ``BLOCK block_ms`` command return normally."""
    return block_ms / 1000.0 + margin_s


def _kwargs(socket_timeout: float | None, socket_connect_timeout: float | None,
            health_check_interval: int, client_name: str | None, max_connections: int | None,
            decode_responses: bool) -> dict:
    kw = dict(
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_connect_timeout,
        socket_keepalive=True,
        health_check_interval=health_check_interval,
        decode_responses=decode_responses,
        retry_on_error=list(RETRY_ERRORS),
    )
    if client_name:
        kw["client_name"] = client_name
    if max_connections is not None:
        kw["max_connections"] = max_connections
    return kw


def redis_client(url: str = DEFAULT_REDIS_URL, *, socket_timeout: float | None = DEFAULT_SOCKET_TIMEOUT,
                 socket_connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT,
                 health_check_interval: int = DEFAULT_HEALTH_CHECK_INTERVAL,
                 retries: int = DEFAULT_RETRIES, backoff_base: float = 0.05, backoff_cap: float = 1.0,
                 client_name: str | None = None, max_connections: int | None = None,
                 decode_responses: bool = False) -> redis.Redis:
    """A synchronous client (redis.Redis) with Kaiten's timeouts, health checks and retries."""
    from redis.retry import Retry
    retry = Retry(ExponentialWithJitterBackoff(cap=backoff_cap, base=backoff_base), retries,
                  supported_errors=RETRY_ERRORS)
    return redis.Redis.from_url(
        url, retry=retry,
        **_kwargs(socket_timeout, socket_connect_timeout, health_check_interval, client_name,
                  max_connections, decode_responses))


def async_redis_client(url: str = DEFAULT_REDIS_URL, *, socket_timeout: float | None = DEFAULT_SOCKET_TIMEOUT,
                       socket_connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT,
                       health_check_interval: int = DEFAULT_HEALTH_CHECK_INTERVAL,
                       retries: int = DEFAULT_RETRIES, backoff_base: float = 0.05, backoff_cap: float = 1.0,
                       client_name: str | None = None, max_connections: int | None = None,
                       decode_responses: bool = False) -> redis.asyncio.Redis:
    """An asyncio client (redis.asyncio.Redis) with the same settings as ``redis_client``.

    For a pub/sub connection that waits for messages, call ``get_message(timeout=...)`` with a
    timeout below ``socket_timeout`` (or pass ``socket_timeout=None`` for a dedicated subscriber
    client): the health check keeps the idle subscription verified.
    """
    from redis.asyncio.retry import Retry
    retry = Retry(ExponentialWithJitterBackoff(cap=backoff_cap, base=backoff_base), retries,
                  supported_errors=RETRY_ERRORS)
    return redis.asyncio.Redis.from_url(
        url, retry=retry,
        **_kwargs(socket_timeout, socket_connect_timeout, health_check_interval, client_name,
                  max_connections, decode_responses))
