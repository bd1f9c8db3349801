"""A real Redis for tests: testcontainers when a Docker engine answers, else a redis-server process."""
from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def docker_available() -> bool:
    try:
        import docker
        docker.from_env(timeout=3).ping()
        return True
    except Exception:
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
        self.use_docker = docker_available()

    def start(self) -> "RedisServer":
        if self.use_docker:
            from testcontainers.core.container import DockerContainer
            self._container = (DockerContainer("redis:7-alpine")
                               .with_bind_ports(6379, self.port)
                               .with_command('redis-server --save "" --appendonly no'))
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
