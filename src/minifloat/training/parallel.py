"""Data-parallel training across processes (docs/distributed.md): the world a rank runs in, the model's wrapping
(DistributedDataParallel or FSDP2's fully_shard), the data split, and the few collectives the loop needs.

    world = join_world(Parallel.DDP, nproc=2, device)    # inside a process torchrun started
    forward = wrap(model, world)                          # DDP(model); fully_shard(model) happened in build()
    batches = rank_batches(loader, accum=K, world=world)  # this rank's K micro-batches of the global step
    with accumulating(forward, world, last=False): ...    # no gradient sync for all but the last micro-batch

**The data split.** One optimizer step trains on K·N micro-batches of the loader's stream (K = grad_accum, N =
ranks): loader batches step·K·N … step·K·N + K·N − 1. Rank r takes batches r, r + N, r + 2N, … of them. Each rank
divides its micro-batch losses by K and the gradient all-reduce averages over N, so the gradient is the mean over
the K·N micro-batches: the step of a one-process run with grad_accum = K·N, up to the order of fp32 sums.

**What is reduced, in which dtype, when.** Gradients: once per optimizer step, after the last micro-batch's backward
(DDP's bucketed all-reduce; FSDP2's reduce-scatter), in fp32 (parameters are fp32; MixedPrecisionPolicy sets
reduce_dtype=fp32 for FSDP2; DDP over low-precision parameters registers
minifloat.distributed.comm.fp32_allreduce_hook). FP8 amaxes: MAX-all-reduced at the end of the FP8 step
(minifloat.fp8.step), so every rank derives the same scales. The reported loss: the mean over ranks, fp32, once per
step. A stop request (SIGTERM / SIGINT on any rank): a MAX over ranks once per step, so all ranks stop together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from minifloat.distributed import fsdp

from minifloat.distributed.comm import fp32_allreduce_hook

# environment variables torchrun sets in every process it starts
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class Parallel(str, enum.Enum):
    """How the model is spread over the ranks (TrainConfig.parallel)."""

    DDP = "ddp"  # every rank holds the whole model; gradients all-reduced (torch DistributedDataParallel)
    FSDP = "fsdp"  # parameters, gradients and optimizer state sharded (torch.distributed.fsdp.fully_shard)
    FSDP_TP = "fsdp+tp"  # a (dp, tp) mesh: tensor/sequence parallel inside each group of tp ranks, FSDP2 across them

    @property
    def sharded(self) -> bool:
        """FSDP2 holds the parameters (alone or over a 2-D mesh)."""
        return self in (Parallel.FSDP, Parallel.FSDP_TP)


@dataclasses.dataclass(frozen=True)
class World:
    """The processes of one run: this one's rank among `size`, and the wrapping (None: one plain process)."""

    rank: int = 0
    size: int = 1
    parallel: Parallel | None = None
    tp: int = 1  # ranks of one tensor-parallel group (fsdp+tp): they train on the same tokens

    @property
    def data_rank(self) -> int:
        """Which slice of the step's batches this rank trains on (its index along the data-parallel dim)."""
        return self.rank // self.tp

    @property
    def data_size(self) -> int:
        """Ranks training on different batches: all of them, or one per tensor-parallel group."""
        return self.size // self.tp

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes logs, run.json and the JSON part of checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.parallel is not None


def launched_by_torchrun() -> bool:
    """Whether this process was started by torchrun (or anything that sets its environment variables)."""
    return all(name in os.environ for name in TORCHRUN_ENV)


def rank_device(device: torch.device) -> torch.device:
    """The device of this rank: cuda:LOCAL_RANK for a CUDA run started by torchrun, else `device`."""
    if device.type == "cuda" and launched_by_torchrun():
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return device


def join_world(parallel: Parallel | str | None, *, nproc: int, device: torch.device, tp: int = 1) -> World:
    """The World of this process; for a parallel run, joins (or checks) the default process group.

    Args:
        parallel: None for one plain process (no process group is touched), else DDP / FSDP.
        nproc: the number of ranks the config asks for; must equal the process group's size.
        device: this rank's device: the backend is NCCL on CUDA, gloo otherwise.
        tp: tensor-parallel group size (fsdp+tp only).
    Raises:
        ValueError: a parallel run outside torchrun, or a process group of another size than `nproc`.
    """
    if parallel is None:
        return World()
    parallel = Parallel(parallel)
    if not dist.is_initialized():
        if not launched_by_torchrun():
            raise ValueError(f"parallel={parallel.value!r} runs one process per rank: start it with `minifloat train "
                             f"--nproc {nproc} --parallel {parallel.value}` or `torchrun --nproc-per-node {nproc} "
                             f"-m minifloat.train ...`")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    if dist.get_world_size() != nproc:
        raise ValueError(f"nproc is {nproc}, but {dist.get_world_size()} processes were started; pass --nproc "
                         f"{dist.get_world_size()}")
    return World(dist.get_rank(), dist.get_world_size(), parallel, tp if parallel is Parallel.FSDP_TP else 1)


def leave_world(world: World) -> None:
    """Destroy the default process group if this run's `join_world` made one."""
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def shard(model: nn.Module, *, fp8_all_gather: bool = True) -> None:
    """FSDP2: `fully_shard` each transformer block, then the root (embedding, final norm, head), in place
    (minifloat.distributed.fsdp.shard).

    Gradients reduce-scatter in fp32 (MixedPrecisionPolicy.reduce_dtype); parameters stay fp32 shards and the
    policy's autocast picks the compute dtype. Fp8Linear weights under a per-tensor recipe (delayed, current) are
    all-gathered in FP8 with their scale, bitwise the cast the unsharded layer makes; the others in fp32.

    Args:
        model: the reference Llama (its `blocks` are the units of sharding).
        fp8_all_gather: gather per-tensor Fp8Linear weights in FP8 (False: every weight in fp32).
    """
    fsdp.shard(model, units=list(model.blocks), fp8_all_gather=fp8_all_gather)


def wrap(model: nn.Module, world: World) -> nn.Module:
    """The module a rank's training forward calls: DistributedDataParallel(model) for DDP, the (already sharded)
    model itself for FSDP and for one process.

    DDP syncs buffers once, when built, and not at every forward (forward_sync_buffers=False, once
    broadcast_buffers=False): the FP8 scaling buffers agree across ranks through the amax reduction at each step's
    end, and a broadcast at every forward would overwrite the amaxes a rank's earlier micro-batches recorded."""
    if world.parallel is not Parallel.DDP:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, forward_sync_buffers=False)
    if any(p.dtype != torch.float32 for p in model.parameters()):
        ddp.register_comm_hook(None, fp32_allreduce_hook)  # low-precision parameters: reduce in fp32 all the same
    return ddp


@contextlib.contextmanager
def accumulating(module: nn.Module, world: World, *, last: bool) -> Iterator[None]:
    """Around one micro-batch's forward and backward: unless `last`, the gradients stay local (DDP's no_sync,
    FSDP2's set_requires_gradient_sync(False)); the last micro-batch of a step reduces them all at once."""
    if last or not world.distributed:
        yield
    elif world.parallel is Parallel.DDP:
        with module.no_sync():
            yield
    else:
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)


def rank_batches(loader, *, accum: int, world: World) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's `accum` micro-batches of the step at the loader's position (batches r, r + N, … of the step's
    accum·N; see the module docstring), moving the loader past all accum·N of them."""
    first = loader.position
    batches = [loader.batch(first + world.data_rank + j * world.data_size) for j in range(accum)]
    loader.skip(accum * world.data_size)
    return batches


def mean_over_ranks(value: torch.Tensor, world: World) -> torch.Tensor:
    """The mean of a scalar over the ranks, in fp32 (the value itself in one process)."""
    if not world.distributed:
        return value
    total = value.detach().float().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total / world.size


def any_rank(flag: bool, world: World) -> bool:
    """Whether `flag` is set on any rank (one MAX all-reduce; the flag itself in one process)."""
    if not world.distributed:
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def barrier(world: World) -> None:
    """Wait for every rank (nothing in one process)."""
    if world.distributed:
        dist.barrier()


class Discard:
    """Stands in for a CsvLog on ranks other than 0: rows written to it go nowhere."""

    def write(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> Discard:
        return self

    def __exit__(self, *exc) -> None:
        pass
