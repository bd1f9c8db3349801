"""A tensor-parallel rank of an engine, rank 1 or above (`python -m engine_worker.tp_rank`): rank 0
starts it (engine_worker/model/tp_ranks.py). It builds the same model runner on its share of the
weights, then runs every step rank 0 sends until rank 0 stops it, and dies with rank 0."""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys

import torch

from engine_worker.model.tensor_parallel import TPRank
from engine_worker.model.tp_comm import Call, Region, ShmComm, StepChannel
from engine_worker.model.tp_dist import DistComm, rank_device, rendezvous
from engine_worker.model.tp_ranks import EXIT_RANK_DIED, pin
from shared.config import EngineConfig

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:        # it died before the line above
        os._exit(EXIT_RANK_DIED)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine_worker.tp_rank",
                                description="A tensor-parallel rank; rank 0 (the engine) starts it.")
    for name in ("rank", "world", "channel-fd", "channel-bytes", "pipe-fd", "ack-fd", "parent"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--backend", choices=("shm", "gloo", "nccl"), required=True)
    for name in ("comm-fd", "comm-bytes", "logits-fd", "logits-bytes", "dist-port"):    # shm's, or the others'
        p.add_argument(f"--{name}", type=int, default=-1)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--cpus", default="")
    p.add_argument("--config", required=True, help="the engine's EngineConfig, as JSON")
    args = p.parse_args(argv)
    _die_with_parent(args.parent)
    pin([int(c) for c in args.cpus.split(",")] if args.cpus else None)
    from shared.log_format import setup_logging
    setup_logging(os.environ.get("KAITEN_LOG_LEVEL", "INFO"), os.environ.get("KAITEN_LOG_FORMAT", "text"))
    from engine_worker.model.model_runner import ModelRunner
    config = EngineConfig(**json.loads(args.config))
    comm = _join(args, torch.device(config.device))
    channel = StepChannel(Region.open(args.channel_fd, args.channel_bytes), [args.pipe_fd], [args.ack_fd])
    runner = ModelRunner(config, args.model_dir, tp_rank=TPRank(args.rank, args.world, comm))
    while (message := channel.receive()) is not None:
        if isinstance(message, Call):
            getattr(runner, message.name)(*message.args)
            channel.acknowledge()
        else:
            runner.follow(message)
    comm.close()
    return 0


def _join(args: argparse.Namespace, device: torch.device) -> ShmComm | DistComm:
    """This rank's end of the communicator rank 0 made (tp_ranks.RankGroup)."""
    if args.backend == "shm":
        return ShmComm(Region.open(args.comm_fd, args.comm_bytes), args.rank, args.world,
                       Region.open(args.logits_fd, args.logits_bytes))
    return DistComm(args.backend, rendezvous(args.world, args.dist_port), args.rank, args.world,
                    rank_device(device, args.rank))


if __name__ == "__main__":
    sys.exit(main())
