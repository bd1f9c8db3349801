"""tests/support/redis_server.py: the tests' Redis as a container (testcontainers) or a process, by KAITEN_TEST_REDIS."""
from __future__ import annotations

import os

import pytest
import redis

from tests.support import redis_server
from tests.support.redis_server import RedisServer


@pytest.fixture
def mode(monkeypatch):
    """Sets KAITEN_TEST_REDIS for one test; the session's decision is restored afterwards."""
    def set_mode(value: str) -> None:
        monkeypatch.setenv("KAITEN_TEST_REDIS", value)
        redis_server.redis_image.cache_clear()
    yield set_mode
    monkeypatch.undo()
    redis_server.redis_image.cache_clear()


def _roundtrip(server: RedisServer) -> None:
    r = redis.Redis.from_url(server.url)
    r.set("k", "v")
    assert r.get("k") == b"v"
    server.restart_empty()   # empty again, same port
    assert redis.Redis.from_url(server.url).get("k") is None


def test_unknown_mode_is_a_clear_error(mode):
    mode("podman")
    with pytest.raises(RuntimeError, match="KAITEN_TEST_REDIS='podman'"):
        RedisServer()
    assert "none (KAITEN_TEST_REDIS='podman'" in redis_server.describe()


def test_process_mode_runs_redis_server(mode):
    mode("process")
    server = RedisServer().start()
    try:
        assert not server.use_docker and server._proc.poll() is None
        _roundtrip(server)
    finally:
        server.stop()
    assert redis_server.describe() == "a redis-server process"


@pytest.mark.skipif(not redis_server.docker_available(), reason="no Docker engine answers")
def test_docker_mode_runs_a_container_published_on_loopback_and_removes_it(mode):
    import docker
    mode("docker")
    server = RedisServer().start()
    client = docker.from_env()
    try:
        assert server.use_docker
        container = client.containers.get(server._container.get_wrapped_container().id)
        assert container.image.tags[0] in (redis_server.OFFICIAL_IMAGE, redis_server.LOCAL_IMAGE)
        assert container.name.startswith(f"{redis_server.CONTAINER_PREFIX}{os.getpid()}-")
        binding = container.attrs["HostConfig"]["PortBindings"]["6379/tcp"][0]
        assert binding == {"HostIp": "127.0.0.1", "HostPort": str(server.port)}
        _roundtrip(server)
        cid = server._container.get_wrapped_container().id
    finally:
        server.stop()
    with pytest.raises(docker.errors.NotFound):
        client.containers.get(cid)
    assert redis_server.describe().startswith("testcontainers, image ")
