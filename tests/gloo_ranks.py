"""Multi-process tests on the CPU: gloo ranks started by torch.multiprocessing, each returning its results.

The ranks meet through a file of their own (a FileStore), not a TCP port: a port found free and then bound by rank 0
can be taken in between by another test running at the same time (the suite runs in pytest-xdist workers).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@contextlib.contextmanager
def rendezvous() -> Iterator[str]:
    """An init_method for one group of ranks: a file no other group uses, in a temporary folder removed after."""
    with tempfile.TemporaryDirectory(prefix="minifloat-gloo-") as folder:
        yield "file://" + os.path.join(folder, "rendezvous")


def spawn_ranks(worker, tmp_path, world: int) -> list[dict]:
    """Run `worker(rank, world)` on `world` gloo ranks (a module-level function); returns what each rank returned."""
    with rendezvous() as init_method:
        mp.spawn(_entry, args=(worker, world, init_method, str(tmp_path)), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _entry(rank: int, worker, world: int, init_method: str, out: str) -> None:
    os.environ["MINIFLOAT_COMPILE"] = "0"  # eager kernels: the same results, no compile time in each process
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        torch.save(worker(rank, world), os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
