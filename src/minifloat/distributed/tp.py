"""Tensor and sequence parallel for FP8 models, on DTensor (`torch.distributed.tensor.parallel`).

A column-parallel linear layer holds rows [r·N/t, (r+1)·N/t) of its weight (N outputs, t TP ranks): it computes its
slice of the output from the whole input. A row-parallel layer holds columns of K: it computes a partial sum of the
output from its slice of the input, and the ranks add their partial sums.

    column:  x (M, K) replicated   · W_r (N/t, K)  = y_r (M, N/t)      dx = Σ_r dy_r · W_r   (all-reduce)
    row:     x_r (M, K/t)          · W_r (N, K/t)  = y partial (M, N)  y  = Σ_r partial       (all-reduce)

`Fp8ColwiseParallel` / `Fp8RowwiseParallel` are torch's `ColwiseParallel` / `RowwiseParallel` for an `Fp8Linear`:
the weight (and a column-parallel bias) become DTensors sharded as torch's styles shard them, and the layer runs its
three FP8 GEMMs on this rank's shards (fp8/modules.py). The styles move inputs and outputs between ranks with DTensor
redistributions, so the collectives and their backward are torch's own. Other modules (an `nn.Linear` kept in high
precision, an `nn.Embedding`) get torch's styles unchanged.

**Quantizing as the unsharded layer does.** A per-tensor scale taken from a tensor needs the whole tensor's amax, and
a shard sees only its own: the weight shard in both layouts, the input of a row-parallel layer (sharded along K),
the output gradient of a column-parallel one (sharded along N). The styles give the layer an `amax_reduce` (a MAX
all-reduce over the TP group, of one float32 per cast), and every per-tensor scale the layer takes from a tensor
comes from the whole amax (fp8/autograd.py). With the same scale, a per-tensor cast is elementwise, so each shard's
FP8 values are exactly the unsharded cast's. Current scaling all-reduces at every cast (three per layer per forward
and backward, fewer with the weight cache). Delayed scaling all-reduces only while seeding a role (step 0); after
that the stored scales rule, and the FP8 step's MAX all-reduce over all ranks (minifloat.fp8.step) keeps them equal.

**Recipes.** Per-tensor recipes only: `DelayedScaling` and `CurrentScaling(granularity="tensor")`. Row, tile, block
and MX scales run along K, which a row-parallel layer splits, and their backward re-quantizes transposed shards;
`check_tp_layer` refuses them with a ValueError, and so does a cast under an `mf.autocast(recipe=...)` that switches
a parallel layer to one. A row-parallel `Fp8Linear` with a bias is refused too (every rank would add it to its
partial sum).

    tp_mesh = init_device_mesh("cpu", (2,))
    parallelize_module(model, tp_mesh, {"fc1": Fp8ColwiseParallel(), "fc2": Fp8RowwiseParallel()})
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from minifloat.distributed.fsdp import shard
from minifloat.fp8.modules import Fp8Linear
from minifloat.fp8.recipes import ROLES, Recipe


def tp_supported(recipe: Recipe) -> bool:
    """Whether a layer under `recipe` can run tensor parallel: every role is scaled per tensor."""
    return all(recipe.spec(role).per_tensor for role in ROLES)


def check_tp_layer(module: Fp8Linear, *, rowwise: bool) -> None:
    """Raise ValueError if `module` cannot run column- (or row-, `rowwise`) parallel; see the module docstring."""
    if not tp_supported(module.recipe):
        raise ValueError(f"tensor parallel Fp8Linear needs a per-tensor recipe (DelayedScaling or "
                         f"CurrentScaling(granularity='tensor')), got {module.recipe}")
    if rowwise and module.bias is not None:
        raise ValueError("a row-parallel Fp8Linear cannot have a bias: every rank would add it to its partial sum; "
                         "build the layer with bias=False")


def tp_amax_reduce(mesh: DeviceMesh) -> Callable[[torch.Tensor], torch.Tensor]:
    """The `Fp8Linear.amax_reduce` of a layer sharded over the 1-D `mesh`: a shard's amax -> the whole tensor's."""
    group = mesh.get_group()

    def whole_amax(amax: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        return amax

    return whole_amax


def _as_dtensor(x: torch.Tensor, mesh: DeviceMesh, layouts: tuple[Placement, ...]) -> DTensor:
    return x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, layouts, run_check=False)


def _distribute(module: Fp8Linear, mesh: DeviceMesh, placements: dict[str, Placement], input_fn, output_fn
                ) -> Fp8Linear:
    """Shard the layer's parameters and move its input and output with hooks (what torch's `distribute_module` does,
    which would also turn the ScalingState buffers into replicated DTensors: they stay plain tensors, equal on every
    rank by the FP8 step's reduction)."""
    for name, placement in placements.items():
        param = getattr(module, name)
        if param is not None:
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [placement]),
                                                         requires_grad=param.requires_grad))
    module.register_forward_pre_hook(lambda m, inputs: input_fn(m, inputs, mesh))
    module.register_forward_hook(lambda m, inputs, y: output_fn(m, y, mesh))
    return module


class Fp8ColwiseParallel(ColwiseParallel):
    """torch's ColwiseParallel (same arguments and layouts); an Fp8Linear runs its FP8 GEMMs on its rows of W."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, Fp8Linear):
            return super()._apply(module, device_mesh)
        check_tp_layer(module, rowwise=False)
        module.amax_reduce = tp_amax_reduce(device_mesh)
        return _distribute(module, device_mesh, {"weight": Shard(0), "bias": Shard(0)}, self._local_input,
                           self._placed_output)

    def _local_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> torch.Tensor:
        # the whole input (an all-gather from a sequence-parallel layout); its gradient dy_r · W_r is this rank's
        # partial sum of dx, reduced back into the input's layout by DTensor in backward
        x = _as_dtensor(inputs[0], mesh, self.input_layouts).redistribute(placements=(Replicate(),))
        return x.to_local(grad_placements=(Partial(),))

    def _placed_output(self, module: nn.Module, y: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        out = DTensor.from_local(y, mesh, (Shard(-1),), run_check=False).redistribute(placements=self.output_layouts)
        return out.to_local() if self.use_local_output else out


class Fp8RowwiseParallel(RowwiseParallel):
    """torch's RowwiseParallel (same arguments and layouts); an Fp8Linear runs its FP8 GEMMs on its columns of W."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, Fp8Linear):
            return super()._apply(module, device_mesh)
        check_tp_layer(module, rowwise=True)
        module.amax_reduce = tp_amax_reduce(device_mesh)
        return _distribute(module, device_mesh, {"weight": Shard(1)}, self._local_input, self._placed_output)

    def _local_input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> torch.Tensor:
        return _as_dtensor(inputs[0], mesh, self.input_layouts).redistribute(placements=(Shard(-1),)).to_local()

    def _placed_output(self, module: nn.Module, y: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        # each rank's y is a partial sum: to Replicate is an all-reduce, to Shard(1) (sequence parallel) a
        # reduce-scatter, both in y's dtype (fp32 for fp32 activations)
        out = DTensor.from_local(y, mesh, (Partial(),), run_check=False).redistribute(placements=self.output_layouts)
        return out.to_local() if self.use_local_output else out


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: dict) -> nn.Module:
    """`parallelize_module(model, tp_mesh, plan)` after checking every FP8 layer the plan shards.

    Args:
        model: a converted model (Fp8Linear layers), on its device.
        tp_mesh: a 1-D DeviceMesh, or the TP dim of a 2-D mesh.
        plan: module path (fnmatch patterns allowed, as parallelize_module takes them) -> ParallelStyle; use
            `Fp8ColwiseParallel` / `Fp8RowwiseParallel` for linear layers.
    Returns:
        The model, parallelized in place. Build the optimizer afterwards (its parameters are now DTensors).
    """
    return parallelize_module(model, tp_mesh, plan)


def apply_2d(model: nn.Module, mesh: DeviceMesh, plan: dict, *, units: Iterable[nn.Module] = (),
             dp_dim: str = "dp", tp_dim: str = "tp", param_dtype: torch.dtype | None = None) -> nn.Module:
    """FSDP2 over `mesh[dp_dim]` on top of tensor parallel over `mesh[tp_dim]` (a 2-D mesh, TP innermost).

    TP runs first (parameters become DTensors on the TP mesh), then `minifloat.distributed.fsdp.shard` shards them
    along the data-parallel dim, `units` first. TP-sharded weights are all-gathered along dp in their own dtype (FSDP2's
    FP8 all-gather applies to weights that are not DTensors); gradients reduce-scatter in fp32.

    Returns:
        The model, parallelized in place.
    """
    apply_tensor_parallel(model, mesh[tp_dim], plan)
    if hasattr(mesh, "_flatten"):  # a reduction over both dims (the gradient norm) is then one all-reduce, not two
        try:  # in sequence, which DTensor warns about at every run; private API: the model works without it
            mesh[(dp_dim, tp_dim)]._flatten()
        except (RuntimeError, ValueError, NotImplementedError):
            pass
    return shard(model, mesh=mesh[dp_dim], units=units, param_dtype=param_dtype)
