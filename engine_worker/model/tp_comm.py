"""Shared memory between the ranks of a tensor-parallel engine (processes on one host): the
all-reduce's region (kaiten_cpu::shm_all_reduce_, kernels/csrc/shm_all_reduce_cpu.cpp), the
gather of the logits' vocabulary slices to rank 0 (LogitsGather) and the broadcast of each step's
inputs from rank 0 (StepChannel).

A region is an anonymous memfd that rank 0 creates and its children inherit by descriptor: no
name in /dev/shm to leak when a rank dies, and the memory goes with the last process holding it.

A step's inputs (token ids, positions, the attention metadata's tensors and sizes, the LoRA
batch's index tensors, the hidden rows whose logits the step computes) go as raw arrays in the
channel's region, and a 16-byte note down a pipe to each other rank wakes it: one write and one
read a step, no pickling; a rank waiting for a step sleeps in read(), not in a spin. Rare calls
(enabling LoRA, an adapter's weights) go pickled through the same region, and rank 0 waits for
every rank's acknowledgement before it goes on.
"""
from __future__ import annotations

import mmap
import os
import pickle
import struct
from dataclasses import dataclass

import numpy as np
import torch

from engine_worker.model.lora_layers import LoraBatch
from kernels.cpu_ops_build import load_cpu_ops
from kernels.interface import AttentionMetadata

# The all-reduce's slots, two a rank: 4 MiB each holds a 1024-token step's hidden states of a
# 1024-wide fp32 model in one round; larger tensors go in several.
COMM_BYTES_PER_RANK = 8 << 20
# The logits gather's areas, two a rank: 16 MiB holds 170 rows of half SmolLM2's vocabulary in
# one round (a decode step of up to 170 sequences); more rows go in several.
LOGITS_BYTES_PER_RANK = 32 << 20
CHANNEL_BYTES = 256 << 20     # virtual: a memfd's pages exist once written (an adapter's weights are the most)


@dataclass(slots=True)
class Region:
    """A shared mapping of `size` bytes; `fd` is inherited by the ranks rank 0 starts."""
    fd: int
    size: int
    map: mmap.mmap

    @classmethod
    def create(cls, name: str, size: int) -> "Region":
        fd = os.memfd_create(name, 0)        # inheritable only where passed (pass_fds)
        os.ftruncate(fd, size)
        return cls.open(fd, size)

    @classmethod
    def open(cls, fd: int, size: int) -> "Region":
        return cls(fd, size, mmap.mmap(fd, size))

    def address(self) -> int:
        return np.frombuffer(self.map, dtype=np.uint8).ctypes.data


class ShmComm:
    """This process's end of an all-reduce region, as rank `rank` of `world`; `handle` (the
    region's descriptor, unique in the process while it is open) names it to the op. `logits`:
    the region of the logits' gather (LogitsGather)."""

    def __init__(self, region: Region, rank: int, world: int, logits: Region):
        load_cpu_ops()
        self.region, self.handle, self.rank, self.logits = region, region.fd, rank, logits
        torch.ops.kaiten_cpu.shm_comm_attach(self.handle, region.address(), region.size, rank, world)

    def logits_gather(self, edges: list[int]) -> LogitsGather:
        return LogitsGather(self.logits, self.handle, self.rank, edges)

    @staticmethod
    def region_bytes(world: int) -> int:
        return 64 * (world + 1) + world * COMM_BYTES_PER_RANK

    def abort(self) -> None:
        """Make every rank's wait in an all-reduce (now or later) raise."""
        torch.ops.kaiten_cpu.shm_comm_abort(self.handle)

    def close(self) -> None:
        """Nothing to release: the regions go with the last process that maps them."""

    def stats(self) -> tuple[int, int, int]:
        """(calls, ns in the op, ns of them waiting for the other ranks) since attach."""
        calls, total, wait = torch.ops.kaiten_cpu.shm_comm_stats(self.handle)
        return calls, total, wait


class LogitsGather:
    """Rank 0's fp32 logits [rows, vocab] from every rank's slice of the vocabulary, columns
    edges[r] to edges[r + 1] of rank r (tensor_parallel.py splits the output layer so). Ranks
    1.. copy their slice into their area of a shared region, then every rank joins an all-reduce
    of one float (shm_all_reduce_), which is the barrier: its release and acquire order the copies
    before rank 0 reads them. Two areas a rank, used in turn as the all-reduce's slots are: a rank
    writes an area again only after the next round's barrier, which rank 0 reaches once it has
    read this round's. Why not a gather op in C++: this moves the same bytes (each slice once
    into shared memory, once out on rank 0) with one 4-byte all-reduce a round, and needs no new
    kernel; an all-reduce of the whole logits, zeros outside each slice, would copy and sum the
    whole [rows, vocab] on every rank."""

    def __init__(self, region: Region, handle: int, rank: int, edges: list[int]):
        self.handle, self.rank, self.edges = handle, rank, edges
        self.floats = torch.frombuffer(region.map, dtype=torch.float32)
        world = len(edges) - 1
        self.area = region.size // (2 * world) // 4                # floats
        widest = max(b - a for a, b in zip(edges, edges[1:]))
        if widest > self.area:
            raise ValueError(f"a vocabulary slice of {widest} logits exceeds the gather's area of {self.area}")
        self.rows_per_round = self.area // widest
        self.barrier = torch.zeros(1)
        self.turn = 0

    @staticmethod
    def region_bytes(world: int) -> int:
        return world * LOGITS_BYTES_PER_RANK

    def __call__(self, part: torch.Tensor) -> torch.Tensor:
        """This rank's logits `part` [rows, its slice]: the whole [rows, vocab] on rank 0, `part`
        on the others. Every rank calls it with the same rows."""
        rows = part.shape[0]
        out = torch.empty(rows, self.edges[-1]) if self.rank == 0 else part
        for first in range(0, rows, self.rows_per_round):
            n = min(self.rows_per_round, rows - first)
            if self.rank:
                self._slice(self.rank, n).copy_(part[first:first + n])
            torch.ops.kaiten_cpu.shm_all_reduce_(self.barrier, self.handle)
            if self.rank == 0:
                out[first:first + n, :self.edges[1]] = part[first:first + n]
                for r in range(1, len(self.edges) - 1):
                    out[first:first + n, self.edges[r]:self.edges[r + 1]] = self._slice(r, n)
            self.turn ^= 1
        return out

    def _slice(self, rank: int, rows: int) -> torch.Tensor:
        at = (2 * rank + self.turn) * self.area
        width = self.edges[rank + 1] - self.edges[rank]
        return self.floats[at:at + rows * width].view(rows, width)


# a step's header: int64 [tokens, seqs, block-table width, max_seqlen_q, max_seqlen_k, the logits'
# rows, the prompt logits' rows (-1: none), then the LoRA batch's five lengths, or -1 where the
# step has no adapter tokens]
_HEADER = 12
_NOTE = struct.Struct("<qq")       # (kind, payload bytes)
STEP, STOP, CALL = 1, 2, 3


@dataclass(slots=True)
class StepInputs:
    ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    lora: LoraBatch | None
    rows: torch.Tensor                   # the hidden rows whose logits rank 0 samples
    prompt_rows: torch.Tensor | None     # those of the prompt logprobs, computed first


@dataclass(slots=True)
class Call:
    """A method of the rank's model runner to call, with its arguments."""
    name: str
    args: tuple


class StepChannel:
    """Rank 0 writes a step into the region and notes it down each rank's pipe; a rank reads the
    note, then the step (copied out: the next step overwrites the region). Rank 0 writes step
    k + 1 only after step k's all-reduces, which every rank joins after reading step k."""

    def __init__(self, region: Region, pipes: list[int], acks: list[int]):
        # rank 0: the pipes' write ends and the acknowledgements' read ends; a rank: its own ends
        self.region, self.pipes, self.acks = region, pipes, acks

    def send(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             lora: LoraBatch | None, rows: torch.Tensor, prompt_rows: torch.Tensor | None) -> None:
        lora_arrays = [] if lora is None else [t.numpy() for t in lora.args()]
        prompt = [] if prompt_rows is None else [prompt_rows.numpy()]
        header = np.array([ids.shape[0], meta.block_tables.shape[0], meta.block_tables.shape[1],
                           meta.max_seqlen_q, meta.max_seqlen_k, rows.shape[0], len(prompt[0]) if prompt else -1,
                           *([len(a) for a in lora_arrays] or [-1] * 5)], dtype=np.int64)
        arrays = (header, ids.numpy(), positions.numpy(), meta.slot_mapping.numpy(), meta.cu_seqlens_q.numpy(),
                  meta.seqlens_k.numpy(), meta.block_tables.numpy(), rows.numpy(), *prompt, *lora_arrays)
        size = sum(a.nbytes for a in arrays)
        self._check_size(size)
        view, at = memoryview(self.region.map), 0
        for a in arrays:
            view[at:at + a.nbytes] = a.reshape(-1).view(np.uint8)
            at += a.nbytes
        self._note(STEP, size)

    def call(self, name: str, *args) -> None:
        """Every rank runs its runner's `name`(*args); returns once every rank has."""
        self.send_start(name, *args)
        self.wait_acks(name)

    def send_start(self, name: str, *args) -> None:
        """Start `name`(*args) on every rank (rank 0 runs its own meanwhile: a call with
        collectives, such as a compilation's warm-up step, needs every rank in it); wait_acks()."""
        data = pickle.dumps(Call(name, args), protocol=pickle.HIGHEST_PROTOCOL)
        self._check_size(len(data))
        self.region.map[:len(data)] = data
        self._note(CALL, len(data))

    def wait_acks(self, name: str) -> None:
        for fd in self.acks:
            if _read_exactly(fd, 1) is None:
                raise RuntimeError(f"a tensor-parallel rank died during {name}")

    def _check_size(self, size: int) -> None:
        if size > self.region.size:
            raise RuntimeError(f"a message of {size} bytes exceeds the tensor-parallel channel's {self.region.size}")

    def _note(self, kind: int, size: int) -> None:
        note = _NOTE.pack(kind, size)
        for fd in self.pipes:
            os.write(fd, note)

    def acknowledge(self) -> None:
        os.write(self.acks[0], b"k")

    def stop(self) -> None:
        for fd in self.pipes:
            try:
                os.write(fd, _NOTE.pack(STOP, 0))
            except OSError:          # that rank is gone already
                pass

    def receive(self) -> StepInputs | Call | None:
        """The next step or call (acknowledge() it once done), or None when rank 0 stops (or is
        gone: the pipe's end)."""
        note = _read_exactly(self.pipes[0], _NOTE.size)
        if note is None or _NOTE.unpack(note)[0] == STOP:
            return None
        kind, size = _NOTE.unpack(note)
        if kind == CALL:
            return pickle.loads(self.region.map[:size])
        buf = np.frombuffer(self.region.map, dtype=np.uint8)
        t, b, w, max_q, max_k, n_rows, n_prompt, *lora_lens = np.frombuffer(buf, dtype=np.int64, count=_HEADER).tolist()
        at = _HEADER * 8

        def take(dtype, count: int) -> torch.Tensor:
            nonlocal at
            a = np.frombuffer(buf, dtype=dtype, count=count, offset=at).copy()
            at += a.nbytes
            return torch.from_numpy(a)

        ids, pos, slots = take(np.int64, t), take(np.int64, t), take(np.int64, t)
        cu, klens, tables = take(np.int32, b + 1), take(np.int32, b), take(np.int32, b * w).view(b, w)
        meta = AttentionMetadata(cu, klens, tables, slots, max_q, max_k, torch.diff(cu).tolist(), klens.tolist())
        rows = take(np.int64, n_rows)
        prompt_rows = take(np.int64, n_prompt) if n_prompt >= 0 else None
        lora = None
        if lora_lens[0] >= 0:      # stride 1 even when empty, as LoraBatch's own (a compiled graph's guard)
            lora = LoraBatch(*(take(np.int64, n).as_strided((n,), (1,)) for n in lora_lens))
        return StepInputs(ids, pos, meta, lora, rows, prompt_rows)


def _read_exactly(fd: int, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return data
