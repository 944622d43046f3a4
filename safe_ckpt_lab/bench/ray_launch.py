"""Run the benchmark as Ray actors, one per GPU (or per CPU slot), the way slime launches its
train actors: a placement of N actors, rank 0 created first and asked for the rendezvous
address, every actor running the same harness as one rank. `safe-ckpt bench --ray-actors N`.
Must not: be imported by the library.
"""

from __future__ import annotations

import os
import socket

from .args import parse
from .run import run_here


def host_rendezvous() -> tuple[str, int]:
    """Pick a free local port for rank 0's rendezvous and export it (MASTER_ADDR/PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return "127.0.0.1", port


class BenchActor:
    def __init__(self, world_size: int, rank: int, master_addr: str | None, master_port: int | None):
        self.rank = rank
        os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK="0", SAFE_CKPT_BENCH_LAUNCHER="ray")
        if master_addr:
            os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))

    def rendezvous(self):
        return host_rendezvous()

    def run(self, argv: list[str]) -> str:
        run_here(parse(argv))
        return "ok"


def launch(n: int, argv: list[str]) -> None:
    import ray
    import torch

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=True)
    gpus = 1 if torch.cuda.is_available() else 0
    remote = ray.remote(num_gpus=gpus, num_cpus=1)(BenchActor)
    actors, addr, port = [], None, None
    for rank in range(n):
        actor = remote.remote(n, rank, addr, port)
        if rank == 0:
            addr, port = ray.get(actor.rendezvous.remote())
        actors.append(actor)
    ray.get([a.run.remote(argv) for a in actors])
