"""A real Redis for tests: testcontainers when a Docker engine answers, else a redis-server process.

The container runs the official redis:7-alpine where it is present or can be pulled, else the local
stand-in scripts/compose-check.sh builds from Debian (kaiten-local/redis:7); with neither, the
process. Its port is published on 127.0.0.1 only.
"""
from __future__ import annotations

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


def docker_available() -> bool:
    try:
        import docker
        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


def docker_redis_image() -> str | None:
    """The Redis image to run: the official one (present or pulled), else the local one, else None."""
    import docker
    client = docker.from_env(timeout=60)
    try:
        client.images.get(OFFICIAL_IMAGE)
        return OFFICIAL_IMAGE
    except docker.errors.DockerException:
        pass
    try:
        client.images.pull(OFFICIAL_IMAGE)
        return OFFICIAL_IMAGE
    except docker.errors.DockerException:
        pass
    try:
        client.images.get(LOCAL_IMAGE)
        return LOCAL_IMAGE
    except docker.errors.DockerException:
        return None


def _has_image(name: str) -> bool:
    import docker
    try:
        docker.from_env(timeout=10).images.get(name)
        return True
    except docker.errors.DockerException:
        return False


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
        self.image = docker_redis_image() if docker_available() else None
        self.use_docker = self.image is not None

    def start(self) -> "RedisServer":
        if self.use_docker:
            from testcontainers.core.config import testcontainers_config
            from testcontainers.core.container import DockerContainer
            if os.environ.get("TESTCONTAINERS_RYUK_DISABLED") is None and not _has_image(testcontainers_config.ryuk_image):
                testcontainers_config.ryuk_disabled = True   # its image lives on Docker Hub; stop() cleans up
            self._container = DockerContainer(self.image).with_command('redis-server --save "" --appendonly no')
            self._container.ports["6379/tcp"] = ("127.0.0.1", self.port)
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
