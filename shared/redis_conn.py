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

Sentinel: ``redis+sentinel://[[user]:password@]host:port[,host:port...]/SERVICE[/DB]`` names the
sentinels (port 26379 when left out) and the master's service name. Every client made here then
asks the sentinels for the current primary when it connects, so after a promotion a broken
connection is replaced by one to the new primary. The password is the primary's (the sentinels are
asked without one). ``redact_url`` shows any URL without its password, for logs and errors.

Cluster: ``redis+cluster://[[user]:password@]host:port[,host:port...]`` names nodes of a Redis
Cluster (port 6379 when left out); the client learns the others and routes each key to its slot's
node (synchronous clients only: the shared KV store uses it, engine_worker/kv_store/).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote

import redis
import redis.asyncio
import redis.asyncio.sentinel
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


SENTINEL_SCHEME = "redis+sentinel://"
DEFAULT_SENTINEL_PORT = 26379


@dataclass(slots=True, frozen=True)
class SentinelURL:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None


CLUSTER_SCHEME = "redis+cluster://"
DEFAULT_CLUSTER_PORT = 6379


@dataclass(slots=True, frozen=True)
class ClusterURL:
    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None


def is_cluster_url(url: str) -> bool:
    return url.lower().startswith(CLUSTER_SCHEME)


def parse_cluster_url(url: str) -> ClusterURL:
    """``redis+cluster://:pw@h1:7000,h2:7001`` -> its nodes and password."""
    if not is_cluster_url(url):
        raise ValueError(f"{redact_url(url)}: not a {CLUSTER_SCHEME} URL")
    netloc = url[len(CLUSTER_SCHEME):].split("?", 1)[0].split("/", 1)[0]
    username, password, hosts = _userinfo(netloc)
    nodes = tuple(_host_port(h, url, DEFAULT_CLUSTER_PORT) for h in hosts.split(",") if h)
    if not nodes:
        raise ValueError(f"{redact_url(url)}: expected {CLUSTER_SCHEME}[:password@]host:port[,host:port...]")
    return ClusterURL(nodes, username, password)


def _userinfo(netloc: str) -> tuple[str | None, str | None, str]:
    """(username, password, hosts) of a URL's netloc; "secret@host": the whole userinfo is the
    password, as redis-py reads it."""
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        return None, None, hosts
    user, colon, pw = userinfo.partition(":")
    if not colon:
        return None, unquote(user), hosts
    return unquote(user) or None, unquote(pw), hosts


def is_sentinel_url(url: str) -> bool:
    return url.lower().startswith(SENTINEL_SCHEME)


def _host_port(item: str, url: str, default_port: int = DEFAULT_SENTINEL_PORT) -> tuple[str, int]:
    host, sep, port = item.rpartition(":") if not item.endswith("]") else (item, "", "")
    if not sep:
        host, port = item, str(default_port)
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{redact_url(url)}: bad sentinel address {item!r} (want host:port)")
    return host, int(port)


def parse_sentinel_url(url: str) -> SentinelURL:
    """``redis+sentinel://:pw@h1:26379,h2:26379/mymaster/0`` -> its sentinels, service, db, password."""
    if not is_sentinel_url(url):
        raise ValueError(f"{redact_url(url)}: not a {SENTINEL_SCHEME} URL")
    rest = url[len(SENTINEL_SCHEME):].split("?", 1)[0]
    netloc, _, path = rest.partition("/")
    username, password, hosts = _userinfo(netloc)
    sentinels = tuple(_host_port(h, url) for h in hosts.split(",") if h)
    parts = [p for p in path.split("/") if p]
    if not sentinels or not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError(f"{redact_url(url)}: expected {SENTINEL_SCHEME}[:password@]host:port[,host:port...]"
                         "/SERVICE[/DB]")
    return SentinelURL(sentinels, unquote(parts[0]), int(parts[1]) if len(parts) == 2 else 0, username, password)


_PASSWORD = re.compile(r"(?<=://)([^/@]*?):([^/@]*)@")


def redact_url(url: str) -> str:
    """A Redis URL as it may be logged: ``redis://:secret@h/0`` -> ``redis://:[redacted]@h/0``."""
    return _PASSWORD.sub(lambda m: f"{m.group(1)}:[redacted]@", url)


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


class _BlockingSentinelPool(redis.asyncio.sentinel.SentinelConnectionPool, redis.asyncio.BlockingConnectionPool):
    """The sentinel pool (asks the sentinels for the primary on connect) with the blocking pool's wait."""


def _retry(retry_cls, retries: int, backoff_base: float, backoff_cap: float):
    return retry_cls(ExponentialWithJitterBackoff(cap=backoff_cap, base=backoff_base), retries,
                     supported_errors=RETRY_ERRORS)


def _sentinel_kwargs(kw: dict) -> dict:
    """The sentinels' own connections: short timeouts (a query must never wait like a subscriber's
    read), no password, no client name; a sentinel that does not answer is skipped for the next."""
    t = kw.get("socket_connect_timeout") or DEFAULT_CONNECT_TIMEOUT
    return {"socket_timeout": t, "socket_connect_timeout": t, "socket_keepalive": True}


def redis_client(url: str = DEFAULT_REDIS_URL, *, socket_timeout: float | None = DEFAULT_SOCKET_TIMEOUT,
                 socket_connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT,
                 health_check_interval: int = DEFAULT_HEALTH_CHECK_INTERVAL,
                 retries: int = DEFAULT_RETRIES, backoff_base: float = 0.05, backoff_cap: float = 1.0,
                 client_name: str | None = None, max_connections: int | None = None,
                 decode_responses: bool = False) -> redis.Redis:
    """A synchronous client (redis.Redis) with Kaiten's timeouts, health checks and retries."""
    from redis.retry import Retry
    kw = _kwargs(socket_timeout, socket_connect_timeout, health_check_interval, client_name,
                 max_connections, decode_responses)
    kw["retry"] = _retry(Retry, retries, backoff_base, backoff_cap)
    if is_cluster_url(url):
        return _cluster_client(url, kw)
    if is_sentinel_url(url):
        from redis.sentinel import Sentinel
        su = parse_sentinel_url(url)
        sentinel = Sentinel(list(su.sentinels), sentinel_kwargs=_sentinel_kwargs(kw))
        return sentinel.master_for(su.service, redis_class=redis.Redis, db=su.db, username=su.username,
                                   password=su.password, **kw)
    return redis.Redis.from_url(url, **kw)


def _cluster_client(url: str, kw: dict):
    from redis.cluster import ClusterNode, RedisCluster
    cu = parse_cluster_url(url)
    kw = {k: v for k, v in kw.items() if k not in ("health_check_interval", "retry_on_error")}
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in cu.nodes], username=cu.username,
                        password=cu.password, **kw)


def async_redis_client(url: str = DEFAULT_REDIS_URL, *, socket_timeout: float | None = DEFAULT_SOCKET_TIMEOUT,
                       socket_connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT,
                       health_check_interval: int = DEFAULT_HEALTH_CHECK_INTERVAL,
                       retries: int = DEFAULT_RETRIES, backoff_base: float = 0.05, backoff_cap: float = 1.0,
                       client_name: str | None = None, max_connections: int | None = None,
                       decode_responses: bool = False, pool_wait_s: float | None = None) -> redis.asyncio.Redis:
    """An asyncio client (redis.asyncio.Redis) with the same settings as ``redis_client``.

    For a pub/sub connection that waits for messages, call ``get_message(timeout=...)`` with a
    timeout below ``socket_timeout`` (or pass ``socket_timeout=None`` for a dedicated subscriber
    client): the health check keeps the idle subscription verified.

    With ``pool_wait_s`` (and ``max_connections``) the pool blocks: a command that finds every
    connection busy waits up to ``pool_wait_s`` for one instead of failing at once.
    """
    from redis.asyncio.retry import Retry
    kw = _kwargs(socket_timeout, socket_connect_timeout, health_check_interval, client_name,
                 max_connections, decode_responses)
    kw["retry"] = _retry(Retry, retries, backoff_base, backoff_cap)
    if is_cluster_url(url):
        raise ValueError(f"{redact_url(url)}: a Redis Cluster serves only the KV store (--kv-store-url)")
    blocking = pool_wait_s is not None
    if blocking:
        kw["timeout"] = pool_wait_s
    if is_sentinel_url(url):
        su = parse_sentinel_url(url)
        sentinel = redis.asyncio.sentinel.Sentinel(list(su.sentinels), sentinel_kwargs=_sentinel_kwargs(kw))
        pool_class = _BlockingSentinelPool if blocking else redis.asyncio.sentinel.SentinelConnectionPool
        return sentinel.master_for(su.service, redis_class=redis.asyncio.Redis, connection_pool_class=pool_class,
                                   db=su.db, username=su.username, password=su.password, **kw)
    if blocking:
        pool = redis.asyncio.BlockingConnectionPool.from_url(url, **kw)
        return redis.asyncio.Redis.from_pool(pool)
    return redis.asyncio.Redis.from_url(url, **kw)

