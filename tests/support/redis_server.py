"""A real Redis for tests: testcontainers when a Docker engine answers, else a redis-server process.

The container runs the official redis:7-alpine where it is present or can be pulled, else the local
stand-in scripts/compose-check.sh builds from Debian (kaiten-local/redis:7); with neither, the
process. Its port is published on 127.0.0.1 only. KAITEN_TEST_REDIS=docker or =process insists on
one way (CI runs both); the default, auto, takes the container where it can. On a machine without
an engine, Kaiten's own (scripts/dockerd.sh, on its own socket) serves when named:
    bash scripts/dockerd.sh start && DOCKER_HOST=$(bash scripts/dockerd.sh host) KAITEN_TEST_REDIS=docker pytest

Ryuk, testcontainers' reaper, is an image on Docker Hub: it is used only where it is present, else
disabled, and RedisServer.stop() removes its container itself (each is named after the test
process, so a run killed half-way leaves them findable: docker ps -a -f name=kaiten-test-redis-).
"""
from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


OFFICIAL_IMAGE = "redis:7-alpine"
LOCAL_IMAGE = "kaiten-local/redis:7"
MODES = ("auto", "docker", "process")
CONTAINER_PREFIX = "kaiten-test-redis-"   # then the test process's pid: docker ps -f name=kaiten-test-redis-PID-


def docker_available() -> bool:
    try:
        import docker
        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


def _has_image(client, name: str) -> bool:
    import docker
    try:
        client.images.get(name)
        return True
    except docker.errors.DockerException:
        return False


def docker_redis_image() -> str | None:
    """The Redis image to run: the official one (present or pulled), else the local one, else None."""
    import docker
    client = docker.from_env(timeout=60)
    if _has_image(client, OFFICIAL_IMAGE):
        return OFFICIAL_IMAGE
    try:
        client.images.pull(OFFICIAL_IMAGE)
        return OFFICIAL_IMAGE
    except docker.errors.DockerException:
        pass
    return LOCAL_IMAGE if _has_image(client, LOCAL_IMAGE) else None


@functools.cache   # cache: decided once per test session
def redis_image() -> str | None:
    """The image the tests' Redis runs in, or None for a redis-server process (KAITEN_TEST_REDIS)."""
    mode = os.environ.get("KAITEN_TEST_REDIS", "auto")
    if mode not in MODES:
        raise RuntimeError(f"KAITEN_TEST_REDIS={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "process":
        return None
    image = docker_redis_image() if docker_available() else None
    if image is None and mode == "docker":
        raise RuntimeError(f"KAITEN_TEST_REDIS=docker, but no Docker engine answers or it has neither "
                           f"{OFFICIAL_IMAGE} nor {LOCAL_IMAGE} (bash scripts/compose-check.sh builds the latter)")
    return image


def describe() -> str:
    """How this session's Redis runs, for pytest's header."""
    try:
        image = redis_image()
    except RuntimeError as e:
        return f"none ({e})"
    return f"testcontainers, image {image}" if image else "a redis-server process"


def _disable_ryuk_unless_present() -> None:
    from testcontainers.core.config import testcontainers_config
    if os.environ.get("TESTCONTAINERS_RYUK_DISABLED") is not None:
        return   # the user decided
    import docker
    if not _has_image(docker.from_env(timeout=10), testcontainers_config.ryuk_image):
        testcontainers_config.ryuk_disabled = True


def _wait_ready(port: int, timeout: float = 20.0) -> None:
    import redis
    deadline = time.monotonic() + timeout
    while True:
        try:
            if redis.Redis(host="127.0.0.1", port=port, socket_timeout=1).ping():
                return
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class RedisServer:
    """A Redis on a fixed local port that can be stopped and restarted empty (no persistence)."""

    def __init__(self):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen | None = None
        self._container = None
        self._dir = tempfile.mkdtemp(prefix="kaiten-redis-")
        self.image = redis_image()
        self.use_docker = self.image is not None

    def start(self) -> "RedisServer":
        if self.use_docker:
            from testcontainers.core.container import DockerContainer
            _disable_ryuk_unless_present()
            self._container = (DockerContainer(self.image)
                               .with_name(f"{CONTAINER_PREFIX}{os.getpid()}-{self.port}-{time.monotonic_ns()}")
                               .with_command('redis-server --save "" --appendonly no'))
            self._container.ports["6379/tcp"] = ("127.0.0.1", self.port)   # published on loopback only
            self._container.start()
        else:
            exe = shutil.which("redis-server")
            if exe is None:
                raise RuntimeError("neither a Docker engine nor redis-server is available "
                                   "(apt-get install redis-server)")
            self._proc = subprocess.Popen(
                [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", self._dir, "--logfile", ""],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_ready(self.port)
        return self

    def stop(self) -> None:
        if self._container is not None:
            self._container.stop()
            self._container = None
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def restart_empty(self) -> None:
        """Kill Redis and start a fresh, empty one on the same port."""
        self.stop()
        self.start()
