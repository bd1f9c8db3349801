import os

# Tests run several torch processes (engines, gateways, the HF reference) on few cores. OpenMP
# threads that spin-wait on a busy core make every op wait a scheduler quantum (~10 ms), so each
# process gets one thread. Set before torch is imported; subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Engines started as processes (kaiten engine, kaiten up) run the eager forward: the compiled one
# has its own HF-equality tests (test_engine.py), and a cold compile in every process would
# dominate the suite's time on two cores.
os.environ.setdefault("KAITEN_ENFORCE_EAGER", "1")
# ... and serve no /metrics port unless a test gives one (tests run engines side by side).
os.environ.setdefault("KAITEN_METRICS_PORT", "0")

import pytest

from tests.support.redis_server import RedisServer
from tests.support.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with a ChatML BPE tokenizer (fp32 weights)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def redis_server():
    """One real Redis for the session. Tests must use their own key prefixes or flush it."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    import redis
    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url


def pytest_report_header(config):
    from tests.support.redis_server import describe
    return f"redis: {describe()}"
