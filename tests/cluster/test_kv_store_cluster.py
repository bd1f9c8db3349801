"""The KV store on a real Redis Cluster (three redis-server nodes, slots spread over them) through
the redis+cluster:// URL form (shared/redis_conn.py): chunks written by one store are read back
by another, across nodes; and the URL form's parsing."""
from __future__ import annotations

import random
import shutil
import subprocess
import tempfile

import pytest
import torch

from engine_worker.engine.kv_connector import ChunkRef, FetchRequest, SaveChunk
from engine_worker.engine.kv_layout import KVLayout
from engine_worker.kv_store.redis_store import RedisKVStore
from shared.redis_conn import ClusterURL, parse_cluster_url, redact_url, redis_client
from tests.support.engine_support import wait_until
from shared.launcher import port_is_free

pytestmark = pytest.mark.timeout(120)


def test_parse_cluster_urls():
    assert parse_cluster_url("redis+cluster://:s%40cret@10.0.0.1:7000,10.0.0.2") == ClusterURL(
        (("10.0.0.1", 7000), ("10.0.0.2", 6379)), None, "s@cret")
    assert parse_cluster_url("REDIS+CLUSTER://u:p@[::1]:7001").nodes == (("::1", 7001),)
    assert redact_url("redis+cluster://:hunter2@h:1") == "redis+cluster://:[redacted]@h:1"
    for bad in ("redis+cluster://", "redis+cluster://h:x", "redis://h:1/0"):
        with pytest.raises(ValueError):
            parse_cluster_url(bad)


def cluster_ports(n: int) -> list[int]:
    """Free ports whose cluster bus ports (10000 higher, so below 55536) are free too."""
    rng, out = random.Random(), []
    while len(out) < n:
        p = rng.randrange(20000, 30000)
        if p not in out and port_is_free("127.0.0.1", p) and port_is_free("127.0.0.1", p + 10000):
            out.append(p)
    return out


@pytest.fixture
def cluster():
    exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if not exe or not cli:
        pytest.skip("redis-server and redis-cli are needed for a Redis Cluster")
    workdir = tempfile.mkdtemp(prefix="kaiten-cluster-")
    ports = cluster_ports(3)
    procs = [subprocess.Popen([exe, "--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                               "--cluster-config-file", f"{workdir}/nodes-{p}.conf", "--save", "", "--appendonly",
                               "no", "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for p in ports]
    try:
        for p in ports:
            wait_until(lambda: subprocess.run([cli, "-p", str(p), "ping"], capture_output=True).stdout.strip()
                       == b"PONG", 40)
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas", "0",
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        wait_until(lambda: b"cluster_state:ok" in subprocess.run([cli, "-p", str(ports[0]), "cluster", "info"],
                                                                  capture_output=True).stdout, 30)
        yield "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def test_chunks_written_on_a_cluster_are_read_back_across_its_nodes(cluster):
    layout = KVLayout.build("m", torch.float16, 16, 2, 2, 8, chunk_tokens=16)
    refs = [ChunkRef((1000 + i,), tuple(range(i, i + 16))) for i in range(24)]
    kv = [torch.randn(1, *layout.block_shape()).half() for _ in refs]
    writer = RedisKVStore(cluster, layout)
    for ref, x in zip(refs, kv):
        assert writer.save(SaveChunk("", ref, x))
    writer.close()
    assert writer.stats().saved_chunks == len(refs) and writer.stats().errors == 0
    client = redis_client(cluster)
    sizes = [client.get_redis_connection(node).dbsize() for node in client.get_nodes()]
    assert sum(sizes) == len(refs) and sum(1 for n in sizes if n) >= 2, sizes     # spread over the nodes
    reader = RedisKVStore(cluster, layout)
    try:
        reader.fetch(FetchRequest(7, "", 0, refs + [ChunkRef((5,), tuple(range(16)))]))
        (result,) = wait_until(reader.done, 20)
        assert result.ticket == 7 and result.num_chunks == len(refs)
        assert torch.equal(result.kv, torch.cat(kv))
        assert reader.stats().miss_chunks == 1
    finally:
        reader.close()
