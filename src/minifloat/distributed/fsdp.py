"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for FP8 models: weights all-gathered in FP8, gradients reduced in fp32.

FSDP2 keeps each parameter as a row shard per rank and all-gathers the whole tensor before a module runs. For an
Fp8Linear whose recipe scales the weight per tensor (DelayedScaling, CurrentScaling(granularity="tensor")) the
gathered tensor is only ever used through its FP8 cast, so the ranks cast their shards first and gather FP8 bytes:
half of a bfloat16 all-gather, a quarter of an fp32 one. FSDP2's extension point is the sharded tensor's type: a
parameter whose local shard defines `fsdp_pre_all_gather` / `fsdp_post_all_gather` is gathered through them.

    pre-all-gather (each rank)   amax of the whole weight = MAX over ranks of the shards' amaxes (precomputed for
                                 all layers in one all-reduce, or one all-reduce here); the shard cast with the
                                 scale the whole weight's cast has (LayerCaster.cast_weight_shard)
    all-gather                   the FP8 bytes; the scale is not sent: every rank computed the same one
    post-all-gather              an `Fp8GatheredWeight`: the FP8 data of the whole weight and its scale, which
                                 Fp8Linear's fprop and dgrad use as their weight operand (fp8/caster.py)

Why the result is exact: a per-tensor cast is elementwise once its scale is fixed, and the scale depends only on the
whole weight's amax (current scaling) or on the stored scale (delayed scaling, identical on all ranks because the
FP8 step MAX-reduces the amaxes of every step). So the gathered bytes are bitwise the cast an unsharded layer makes.
Block (128×128) and MX weights, and layers with FP8 all-gather switched off, gather their high-precision values
(`param_dtype`) and cast after the gather, as unsharded layers do; see docs/distributed.md.

    model = mf.convert(model, recipe=mf.CurrentScaling())
    shard(model, units=list(model.blocks))            # FP8 all-gather, fp32 reduce-scatter
    optimizer = torch.optim.AdamW(model.parameters())
    for batch in data:
        loss(model, batch).backward()
        optimizer.step()
        precompute_fp8_scales(model)                   # one all-reduce for the next step's all-gathers
"""

from __future__ import annotations

import collections
import math
import weakref
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from minifloat.fp8.caster import LayerCaster
from minifloat.fp8.modules import Fp8Linear
from minifloat.fp8.recipes import CastSpec, Role
from minifloat.numerics.granularity import Granularity
from minifloat.numerics.quantize import Quantized, abs_max

aten = torch.ops.aten

# Ops FSDP2 applies to a sharded parameter's local tensor while sharding, copying and loading it: their results stay
# Fp8ShardedWeight (a view, copy or slice of the weight is still the weight). Any other op sees the plain tensor.
_SHARD_PRESERVING = {aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor, aten.copy_.default,
                     aten.view.default, aten.as_strided.default, aten._to_copy.default, aten.split.Tensor,
                     aten.clone.default, aten.detach.default, aten.alias.default, aten._pin_memory.default}
# Ops FSDP2 and nn.Parameter apply to the gathered tensor: the FP8 data follows them. Any other op (a plain F.linear
# under mf.autocast(enabled=False), a state_dict read) sees the dequantized weight.
_GATHERED_VIEWS = {aten.detach.default, aten.alias.default, aten.as_strided.default, aten.view.default}


def fp8_all_gather_ok(module: nn.Module) -> bool:
    """Whether `module` is an Fp8Linear whose weight cast can run shard by shard (per-tensor weight scales)."""
    return isinstance(module, Fp8Linear) and module.recipe.spec(Role.WEIGHT).per_tensor


class Fp8ShardedWeight(torch.Tensor):
    """The local shard of an Fp8Linear's weight under FSDP2, all-gathered as FP8.

    It behaves as the plain tensor it wraps (the optimizer updates it in place; state_dict sees its values). FSDP2
    calls `fsdp_pre_all_gather` before a forward or backward needs the whole weight and `fsdp_post_all_gather` after.
    """

    @staticmethod
    def __new__(cls, tensor: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, tensor.size(), strides=tensor.stride(),
                                                   storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
                                                   device=tensor.device, layout=tensor.layout,
                                                   requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    def __repr__(self) -> str:
        return f"Fp8ShardedWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*tree_map_only(cls, lambda t: t._tensor, args),
                   **tree_map_only(cls, lambda t: t._tensor, kwargs or {}))
        if func not in _SHARD_PRESERVING:
            return out
        return tree_map_only(torch.Tensor, lambda t: cls(t) if not isinstance(t, cls) else t, out)

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Fp8ShardedWeight(inner["_tensor"])

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """Cast this shard to FP8 with the whole weight's scale; returns ((FP8 rows,), cast metadata)."""
        spec = module.recipe.spec(Role.WEIGHT)
        precomputed = _PRECOMPUTED.get(module)
        if precomputed is not None and precomputed[0] == _freshness(module, self._tensor):
            amax = precomputed[1]
        elif spec.delayed and module.fp8_state.scale_for(Role.WEIGHT) is not None:
            amax = abs_max(self._tensor.detach(), None)  # only recorded: the FP8 step's MAX all-reduce makes it whole
        else:
            amax = _all_reduce_max(abs_max(self._tensor.detach(), None), mesh)
        caster = LayerCaster(module.recipe, module.fp8_state, module.fp8_name, recording=False)
        q = caster.cast_weight_shard(self._tensor, amax)
        rows = math.ceil(outer_size[0] / mesh.size())  # FSDP2 pads uneven shards to this many rows
        data = q.data
        if data.shape[0] < rows:
            data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        return (data,), (q.scale, q.amax, spec, tuple(outer_size))

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The gathered FP8 rows as an `Fp8GatheredWeight` (or `out` updated in place after the first gather)."""
        (data,) = all_gather_outputs
        scale, amax, spec, size = metadata
        if out is not None:  # FSDP2 reuses the all-gather buffer: out's data already holds the new bytes
            out._scale, out._amax = scale, amax
            return None
        return Fp8GatheredWeight(data[: size[0]], scale, amax, spec, param_dtype), (data,)


class Fp8GatheredWeight(torch.Tensor):
    """A whole weight as FSDP2 gathered it: FP8 data and one scale, presented as a `dtype` tensor.

    `fp8_cast` is the cast Fp8Linear would make of the unsharded weight; its fprop and dgrad use it directly
    (fp8/caster.py). Other uses see `fp8_cast.dequantize()`. A traceable wrapper subclass: its tensors (FP8 data, scale,
    amax) are its inner tensors, so a compiled forward (torch.compile of a block, the trainer's default) takes it as an
    input like any parameter.
    """

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, spec: CastSpec,
                dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, data.size(), strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=dtype,
                                                   device=data.device, requires_grad=False)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, spec: CastSpec,
                 dtype: torch.dtype):
        self._data, self._scale, self._amax = data, scale, amax
        self.fp8_spec = spec

    @property
    def fp8_cast(self) -> Quantized:
        return Quantized(self._data, self._scale, self.fp8_spec.fmt, Granularity.TENSOR, self._amax)

    def __repr__(self) -> str:
        return f"Fp8GatheredWeight({self.fp8_spec.fmt.name}, shape={tuple(self.shape)}, scale={self._scale})"

    def dequantize(self) -> torch.Tensor:
        return self.fp8_cast.dequantize(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GATHERED_VIEWS and isinstance(args[0], cls):
            w = args[0]
            return cls(func(w._data, *args[1:], **kwargs), w._scale, w._amax, w.fp8_spec, w.dtype)
        return func(*tree_map_only(cls, cls.dequantize, args), **tree_map_only(cls, cls.dequantize, kwargs))

    def __tensor_flatten__(self):
        return ["_data", "_scale", "_amax"], (self.fp8_spec, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Fp8GatheredWeight(inner["_data"], inner["_scale"], inner["_amax"], *meta)


def enable_fp8_all_gather(model: nn.Module) -> int:
    """Make FSDP2 gather the weights of `model`'s per-tensor Fp8Linear layers in FP8. Call before `fully_shard`.

    The weight Parameter is replaced (same values, same name): build the optimizer after sharding, as FSDP2 needs.
    Returns the number of layers switched.
    """
    layers = [m for m in model.modules() if fp8_all_gather_ok(m) and not isinstance(m.weight, DTensor)]
    for m in layers:
        if not isinstance(m.weight.data, Fp8ShardedWeight):
            m.weight = nn.Parameter(Fp8ShardedWeight(m.weight.data), requires_grad=m.weight.requires_grad)
    return len(layers)


# layer -> (freshness key, the whole weight's amax) from `precompute_fp8_scales`, used while the key holds
_PRECOMPUTED: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, int], torch.Tensor]]" = weakref.WeakKeyDictionary()


def _freshness(layer: Fp8Linear, shard: torch.Tensor) -> tuple[int, int]:
    """What a precomputed amax is valid for: the layer's scaling generation, which every FP8 step (so every optimizer
    step over the layer) and every load moves, and the shard's version counter, which in-place edits move (an
    optimizer's update of an FSDP2 shard does not move it, hence the generation)."""
    return layer.fp8_state.generation, shard._version


def _all_reduce_max(amax: torch.Tensor, mesh) -> torch.Tensor:
    for dim in range(mesh.ndim):  # on a 2-D mesh (FSDP × TP) a weight's shards lie along both dims
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    return amax


def _fp8_gathered_layers(model: nn.Module) -> list[tuple[Fp8Linear, torch.Tensor]]:
    """(layer, its local weight shard) of every layer whose weight FSDP2 gathers in FP8."""
    out = []
    for m in model.modules():
        if isinstance(m, Fp8Linear) and isinstance(m.weight, DTensor):
            with torch.no_grad():
                local = m.weight.to_local()
            if isinstance(local, Fp8ShardedWeight):
                out.append((m, local._tensor))
    return out


@torch.no_grad()
def precompute_fp8_scales(model: nn.Module) -> int:
    """Compute every FP8-gathered weight's whole amax (the input to its all-gather scale) in one all-reduce.

    Call after `optimizer.step()` (after the FP8 step it ends); the all-gathers until the next optimizer step then
    need no collective of their own (a per-weight all-reduce otherwise, for current scaling and a delayed layer's
    first step). A result is used only until the layer's next FP8 step, load or in-place edit of the shard; after
    that the gather all-reduces again. Returns the number of weights.
    """
    layers = _fp8_gathered_layers(model)
    by_mesh: dict[int, list] = {}
    for m, shard_ in layers:
        by_mesh.setdefault(id(m.weight.device_mesh), []).append((m, shard_))
    for group in by_mesh.values():
        amax = torch.stack([abs_max(shard_, None) for _, shard_ in group])  # (layers,): one message
        _all_reduce_max(amax, group[0][0].weight.device_mesh)
        for (m, shard_), a in zip(group, amax):
            _PRECOMPUTED[m] = (_freshness(m, shard_), a)
    return len(layers)


def fp32_reduce_policy(param_dtype: torch.dtype | None = None) -> MixedPrecisionPolicy:
    """FSDP2's MixedPrecisionPolicy with gradients reduce-scattered in fp32 (params gathered in `param_dtype`)."""
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def shard(model: nn.Module, *, mesh=None, units: Iterable[nn.Module] = (), fp8_all_gather: bool = True,
          param_dtype: torch.dtype | None = None, reshard_after_forward: bool = True) -> nn.Module:
    """Shard `model` with FSDP2: each of `units` (e.g. transformer blocks) its own all-gather group, then the root.

    Args:
        model: a converted model (Fp8Linear layers), on its device, not yet sharded.
        mesh: a 1-D DeviceMesh (None: all ranks of the default group) or the data-parallel dim of a 2-D mesh.
        units: submodules sharded as their own FSDP units, gathered just before they run and freed after.
        fp8_all_gather: gather per-tensor Fp8Linear weights in FP8 (`enable_fp8_all_gather`).
        param_dtype: dtype the other parameters are gathered and computed in (None: their own, e.g. fp32).
        reshard_after_forward: free gathered weights after forward and gather them again for backward.
    Returns:
        The model (sharded in place). Gradients are reduce-scattered in fp32.
    """
    if fp8_all_gather:
        enable_fp8_all_gather(model)
    options = dict(mesh=mesh, mp_policy=fp32_reduce_policy(param_dtype), reshard_after_forward=reshard_after_forward)
    for unit in units:
        fully_shard(unit, **options)
    fully_shard(model, **options)
    return model


class CountingComm:
    """Allocation as FSDP2's default comms do it (a plain torch.empty)."""

    def __init__(self, counts: collections.Counter):
        self.counts = counts

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class CountingAllGather(CountingComm):
    """FSDP2's all-gather that adds the bytes each rank receives (the gathered buffer) to `counts["all_gather"]`."""

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        self.counts["all_gather"] += output_tensor.numel() * output_tensor.element_size()
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter(CountingComm):
    """FSDP2's reduce-scatter that adds the bytes each rank sends (the unsharded gradients) to
    `counts["reduce_scatter"]`."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self.counts["reduce_scatter"] += input_tensor.numel() * input_tensor.element_size()
        return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def count_fsdp_bytes(model: nn.Module) -> collections.Counter:
    """Make every FSDP2 unit of `model` count its all-gather and reduce-scatter bytes into the returned Counter.

    The counts are per rank and cumulative; a gathered buffer of N bytes moves (world-1)/world · N bytes into each
    rank over a ring. Uses FSDP2's public `set_custom_all_gather` / `set_custom_reduce_scatter`.
    """
    counts: collections.Counter = collections.Counter()
    for m in model.modules():
        if hasattr(m, "set_custom_all_gather"):
            m.set_custom_all_gather(CountingAllGather(counts))
            m.set_custom_reduce_scatter(CountingReduceScatter(counts))
    return counts
