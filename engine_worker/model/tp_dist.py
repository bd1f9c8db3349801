"""torch.distributed between the ranks of a tensor-parallel engine: NCCL on GPUs (rank r on the
engine's GPU + r), gloo on the CPU (the shared-memory all-reduce of tp_comm.py is the CPU's
default: gloo goes through sockets). The layers' all-reduces (tensor_parallel.DistParallelAttention,
DistParallelGatedMLP) and the gather of the logits' vocabulary slices to rank 0 (DistLogitsGather)
use the process's default group, which rank 0 and its ranks join through rank 0's TCPStore on a
free localhost port (passed on the ranks' command line). The step's inputs still go through
tp_comm.StepChannel, in host memory; a rank on a GPU moves them to its device.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

BACKENDS = ("auto", "shm", "gloo", "nccl")
HOST = "127.0.0.1"
# A collective (or the rendezvous) that waits longer raises, so a rank stuck on another cannot
# hang for ever; long enough for the ranks' loading and compiling to drift apart.
TIMEOUT = timedelta(minutes=10)


def resolve_backend(name: str, device: torch.device) -> str:
    """--tensor-parallel-backend on `device`: auto is shm on the CPU, nccl on CUDA. ValueError, in
    one line, for a backend that does not run there."""
    if name not in BACKENDS:
        raise ValueError(f"unknown tensor_parallel_backend {name!r}; choose one of {', '.join(BACKENDS)}")
    cuda = device.type == "cuda"
    if name == "auto":
        return "nccl" if cuda else "shm"
    if cuda and name != "nccl":
        raise ValueError(f"--tensor-parallel-backend {name} runs on the CPU; on --device {device} the ranks use nccl")
    if not cuda and name == "nccl":
        raise ValueError(f"--tensor-parallel-backend nccl needs --device cuda (on {device}: shm or gloo)")
    return name


def check_joinable(backend: str, device: torch.device, world: int) -> None:
    """ValueError, in one line, where rank 0 on `device` cannot start `world` ranks over `backend`."""
    flag = f"--tensor-parallel-size {world} over {backend}"
    if not dist.is_available() or not getattr(dist, f"is_{backend}_available")():
        raise ValueError(f"{flag}: this torch is built without torch.distributed's {backend}")
    if dist.is_initialized():
        raise ValueError(f"{flag}: this process holds a torch.distributed process group already "
                         f"(one such engine a process)")
    if device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + world:
        raise ValueError(f"{flag} needs {world} GPUs from {device} on; torch sees {torch.cuda.device_count()}")


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: one GPU a rank from the engine's (cuda:N + rank); the CPU as it is."""
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


def rendezvous(world: int, port: int = 0) -> dist.TCPStore:
    """Rank 0's store on a free port (port 0; its .port goes to the other ranks), or a rank's
    connection to it."""
    return dist.TCPStore(HOST, port, world, is_master=port == 0, timeout=TIMEOUT, wait_for_workers=False)


class DistComm:
    """This process as rank `rank` of the default process group of `backend` (gloo or nccl),
    joined through `store`; blocks until every rank has joined."""

    def __init__(self, backend: str, store: dist.TCPStore, rank: int, world: int, device: torch.device):
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=TIMEOUT)
        self.store, self.rank, self.device = store, rank, device

    def logits_gather(self, edges: list[int]) -> DistLogitsGather:
        return DistLogitsGather(self.rank, edges)

    def fewest(self, n: int) -> int:
        """The least of every rank's `n` (each rank calls it)."""
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def abort(self) -> None:
        """Nothing to do: rank 0 exits next (tp_ranks.RankGroup), and the other ranks die with it
        (PR_SET_PDEATHSIG); a collective waiting on a dead rank fails or times out."""

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class DistLogitsGather:
    """tp_comm.LogitsGather through torch.distributed: each rank's slice (columns edges[r] to
    edges[r + 1]) padded to the widest, gathered to rank 0, which keeps each slice's columns: the
    same fp32 logits [rows, vocab], bit for bit."""

    def __init__(self, rank: int, edges: list[int]):
        self.rank, self.edges = rank, edges
        self.widths = [b - a for a, b in zip(edges, edges[1:])]

    def __call__(self, part: torch.Tensor) -> torch.Tensor:
        """This rank's logits `part` [rows, its slice]: the whole [rows, vocab] on rank 0, `part`
        on the others. Every rank calls it with the same rows; none gathers no rows."""
        if part.shape[0] == 0:
            return part.new_empty(0, self.edges[-1]) if self.rank == 0 else part
        padded = F.pad(part, (0, max(self.widths) - part.shape[1])).contiguous()
        slices = [torch.empty_like(padded) for _ in self.widths] if self.rank == 0 else None
        dist.gather(padded, slices, dst=0)
        if self.rank:
            return part
        return torch.cat([s[:, :w] for s, w in zip(slices, self.widths)], dim=1)
