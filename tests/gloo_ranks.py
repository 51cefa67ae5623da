"""Multi-process tests on the CPU: gloo ranks started by torch.multiprocessing, each returning its results."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on localhost now (the rendezvous of one spawn)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker, tmp_path, world: int) -> list[dict]:
    """Run `worker(rank, world)` on `world` gloo ranks (a module-level function); returns what each rank returned."""
    mp.spawn(_entry, args=(worker, world, free_port(), str(tmp_path)), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _entry(rank: int, worker, world: int, port: int, out: str) -> None:
    os.environ["MINIFLOAT_COMPILE"] = "0"  # eager kernels: the same results, no compile time in each process
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.save(worker(rank, world), os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
