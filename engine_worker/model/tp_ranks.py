"""The processes of a tensor-parallel engine: rank 0 is the engine (worker loop, scheduler,
sampling); it starts ranks 1..N-1 (`python -m engine_worker.tp_rank`), which build the same
model runner on their share of the weights and then run every step rank 0 sends them. Their
all-reduces go through shared memory (backend shm: tp_comm.ShmComm) or torch.distributed (gloo,
nccl: tp_dist.DistComm, one GPU a rank).

Lifetimes: a rank dies with rank 0 (PR_SET_PDEATHSIG), and rank 0 with any rank: a thread waits
on the ranks' pidfds and, when one exits, aborts the all-reduce and ends the engine's process at
once (os._exit), so its heartbeat stops and the gateways fail its streams over as for any dead
engine. A rank that waits in an all-reduce for one that died throws (the shm op checks the rank's
pid; gloo sees the connection close, and a torch.distributed collective times out), so no rank is
left waiting.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading

import torch

from engine_worker.model.cpu_binding import rank_cpus
from engine_worker.model.lora_layers import LoraBatch
from engine_worker.model.tensor_parallel import TPRank
from engine_worker.model.tp_comm import CHANNEL_BYTES, LogitsGather, Region, ShmComm, StepChannel
from engine_worker.model.tp_dist import DistComm, rendezvous
from kernels.interface import AttentionMetadata
from shared.config import EngineConfig

log = logging.getLogger(__name__)

EXIT_RANK_DIED = 70


def pin(cpus: list[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)


class RankGroup:
    """Rank 0's view of the other ranks: their processes, the step channel to them, and the
    all-reduce they share over `backend` (shm, gloo or nccl; `tp`: rank 0's TPRank on `device`)."""

    def __init__(self, config: EngineConfig, model_dir: str, backend: str, device: torch.device):
        world = config.tensor_parallel_size
        cpus = rank_cpus(config.cpu_binding, world)
        self.channel_region = Region.create("kaiten-tp-steps", CHANNEL_BYTES)
        comm_args, comm_fds = self._rendezvous(backend, world)
        self.procs: list[subprocess.Popen] = []
        self.comm: ShmComm | DistComm | None = None
        writes, acks = [], []
        self._closing = False
        child_config = json.dumps(dataclasses.asdict(config))
        for rank in range(1, world):
            read_end, write_end = os.pipe()
            ack_read, ack_write = os.pipe()
            cmd = [sys.executable, "-m", "engine_worker.tp_rank", "--rank", str(rank), "--world", str(world),
                   "--backend", backend, *comm_args,
                   "--channel-fd", str(self.channel_region.fd), "--channel-bytes", str(self.channel_region.size),
                   "--pipe-fd", str(read_end), "--ack-fd", str(ack_write), "--parent", str(os.getpid()),
                   "--model-dir", model_dir,
                   "--cpus", ",".join(map(str, cpus[rank])) if cpus else "", "--config", child_config]
            self.procs.append(subprocess.Popen(cmd, pass_fds=(*comm_fds, self.channel_region.fd, read_end, ack_write)))
            os.close(read_end)
            os.close(ack_write)
            writes.append(write_end)
            acks.append(ack_read)
        self._affinity = os.sched_getaffinity(0)      # restored at close (an offline LLM's process goes on)
        pin(cpus[0] if cpus else None)
        self._watcher = threading.Thread(target=self._watch, name="kaiten-tp-watch", daemon=True)
        self._watcher.start()        # before joining, which waits for every rank: one that dies first ends it
        self.comm = self._join(backend, world, device)
        self.tp = TPRank(0, world, self.comm)
        self.channel = StepChannel(self.channel_region, writes, acks)
        log.info("tensor parallelism (%s): %d ranks (pids %s), cores %s", backend, world,
                 ", ".join([str(os.getpid())] + [str(p.pid) for p in self.procs]),
                 " | ".join(",".join(map(str, c)) for c in cpus) if cpus else "not pinned")

    def _rendezvous(self, backend: str, world: int) -> tuple[list[str], tuple[int, ...]]:
        """What the other ranks join the communicator through, as flags of their command line and
        the descriptors they inherit: the all-reduce's and the logits' regions (shm), or rank 0's
        store, by its port (torch.distributed)."""
        if backend != "shm":
            self.store = rendezvous(world)
            return ["--dist-port", str(self.store.port)], ()
        self.comm_region = Region.create("kaiten-tp-allreduce", ShmComm.region_bytes(world))
        self.logits_region = Region.create("kaiten-tp-logits", LogitsGather.region_bytes(world))
        return (["--comm-fd", str(self.comm_region.fd), "--comm-bytes", str(self.comm_region.size),
                 "--logits-fd", str(self.logits_region.fd), "--logits-bytes", str(self.logits_region.size)],
                (self.comm_region.fd, self.logits_region.fd))

    def _join(self, backend: str, world: int, device: torch.device) -> ShmComm | DistComm:
        if backend == "shm":
            return ShmComm(self.comm_region, 0, world, self.logits_region)
        return DistComm(backend, self.store, 0, world, device)

    def send(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             lora: LoraBatch | None, rows: torch.Tensor, prompt_rows: torch.Tensor | None) -> None:
        self.channel.send(ids, positions, meta, lora, rows, prompt_rows)

    def call(self, name: str, *args) -> None:
        """Every other rank's runner runs `name`(*args) (tp_rank.py); returns once they have."""
        self.channel.call(name, *args)

    def _watch(self) -> None:
        fds = {os.pidfd_open(p.pid): p for p in self.procs}
        ready, _, _ = select.select(list(fds), [], [])
        if self._closing:
            return
        proc = fds[ready[0]]
        code = proc.wait()
        log.error("tensor-parallel rank %d (pid %d) exited with %s; stopping this engine",
                  self.procs.index(proc) + 1, proc.pid, code)
        if self.comm is not None:
            self.comm.abort()
        self._kill()
        logging.shutdown()
        os._exit(EXIT_RANK_DIED)

    def _kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def close(self) -> None:
        """Stop the other ranks (at the engine's end)."""
        if self._closing:
            return
        self._closing = True
        self.channel.stop()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.comm.close()
        os.sched_setaffinity(0, self._affinity)
