"""Gradient reductions in fp32: a DistributedDataParallel communication hook.

Summing gradients from many ranks in bf16/fp16 loses the small contributions (each addition rounds to 8 or 11
significant bits) and fp16 sums overflow; mixed-precision practice reduces in fp32. With fp32 parameters DDP already
does; with bf16/fp16 parameters (pure low-precision storage) register this hook:

    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, minifloat.distributed.comm.fp32_allreduce_hook)
"""

# no `from __future__ import annotations`: DDP compares the hook's return annotation to the real type
import torch
import torch.distributed as dist


def fp32_allreduce_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: average a gradient bucket across ranks in fp32, then store it back in the bucket's dtype.

    Args:
        process_group: the group to reduce over (None: the default group).
        bucket: DDP's GradBucket.
    Returns:
        A future holding the averaged bucket in its own dtype.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    wide = buffer.float().div_(dist.get_world_size(group))  # (n,) fp32: the sum of ranks' gradients is formed in fp32
    future = dist.all_reduce(wide, group=group, async_op=True).get_future()

    def narrow(fut: torch.futures.Future) -> torch.Tensor:
        return buffer.copy_(fut.value()[0])

    return future.then(narrow)
