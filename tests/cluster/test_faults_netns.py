"""Kaiten across hosts under real network faults (issue 21): network namespaces as hosts, a Redis
primary + 2 replicas + 3 sentinels, 2 engine processes, 2 gateway processes, the clients on
their own host (tests/support/fault_scenarios.py). Runs as root where `ip netns` works; skips elsewhere.
The scenarios share one deployment, in order (the first kills the primary for good)."""
from __future__ import annotations

import shutil

import pytest

from tests.support import netns_hosts

pytestmark = [pytest.mark.timeout(300)]
why_not = netns_hosts.available() or (None if shutil.which("redis-server") else "needs redis-server")
if why_not:
    pytest.skip(f"network-namespace fault tests: {why_not}", allow_module_level=True)

from tests.support.fault_scenarios import (PROMPTS, Deployment, Settings, impaired_gateways, kill_primary,  # noqa: E402
                                           outcome, partition_engine, partition_gateway)

N_TOKENS = 200


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from engine_worker import LLM, SamplingParams
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB")
    return [c.text for c in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True))]


@pytest.fixture(scope="module")
def deployment(tiny_model_dir):
    d = Deployment.start(Settings(str(tiny_model_dir), max_tokens=N_TOKENS))
    try:
        yield d
    finally:
        d.stop()


def test_1_sigkill_the_primary(deployment, reference):
    run = kill_primary(deployment)
    o = outcome(run, reference)
    print(f"\nscenario 1: {o}, {run['killed']} -> {run['promoted']} after {run['promoted_after_s']} s, "
          f"new request answered after {run['new_request_answered_after_s']} s")
    assert o["completed"] == 8 and o["errors"] == 0 and o["unequal"] == 0 and o["lost"] == 0, o
    assert run["new_request_answered_after_s"] is not None and run["new_request_answered_after_s"] <= 5.0


def test_2_partition_an_engine_for_10_s(deployment, reference):
    run = partition_engine(deployment, 10.0)
    o = outcome(run, reference)
    print(f"\nscenario 2: {o}; after the heal: {outcome(run['after_heal'], reference)}; engines {run['engines_after_heal']}")
    assert o["completed"] == 8 and o["errors"] == 0 and o["unequal"] == 0 and o["lost"] == 0, o
    assert max(run["running_at_fault"].values()) >= 4, run          # the victim held half the streams or more
    assert 0.0 < o["max_stall_s"] <= 3.0 + 1.0, o    # moved within 3 s (+ 1 s of load): the janitor or the watchdog
    assert all(c is not None for c in run["engines_after_heal"].values())   # both heartbeat again
    after = outcome(run["after_heal"], reference)
    assert after["completed"] == 8 and after["unequal"] == 0, after


def test_3_partition_a_gateway(deployment, reference):
    run = partition_gateway(deployment)
    g0 = {i for i in range(len(PROMPTS)) if i % 2 == 0}           # streams 0, 2, 4, 6 went to g0
    o = outcome(run, reference, affected=g0)
    print(f"\nscenario 3: {o}")
    assert set(o["error_streams"]) == g0 and o["error_codes"] == ["reply_channel_lost"], o
    assert o["completed"] == 4 and o["unequal"] == 0 and o["lost"] == 0, o
    assert run["orphans_stopped"] == 4, run["engines"]          # g0's requests: stopped, not run to their end


def test_4_loss_and_delay_between_gateways_and_redis(deployment, reference):
    run = impaired_gateways(deployment)
    o, base = outcome(run, reference), outcome(run["baseline"], reference)
    print(f"\nscenario 4 ({run['impairment']}): {o}; baseline {base}")
    assert base["completed"] == 8 and o["completed"] == 8 and o["errors"] == 0 and o["unequal"] == 0, (o, base)
    assert o["lost"] == 0, o
    # Throughput against the baseline is a benchmark figure (bench/serving/faults.py), not asserted here:
    # two cores shared with other tests make it vary by more than the 10% the goal allows.
