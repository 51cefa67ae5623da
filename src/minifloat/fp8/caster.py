"""Per-layer FP8 casting: the `LayerCaster` quantizes one layer's tensors under its recipe, and `WeightCache` keeps its
weight casts for the current FP8 step.

Every operand of every GEMM of an FP8 (or 4-bit) linear layer is quantized here, through
`minifloat.numerics.quantize.quantize` (FP8) or `minifloat.fp8.fourbit.cast.cast_nvfp4` (NVFP4), applying delayed
scaling, recording amaxes and feeding telemetry. The autograd Functions (minifloat.fp8.autograd for FP8,
minifloat.fp8.fourbit.linear for 4-bit recipes) decide what to cast and which GEMM multiplies it.

A weight may arrive already cast: FSDP2's FP8 all-gather (minifloat.distributed.fsdp) gathers each rank's shard cast
by `LayerCaster.cast_weight_shard`, and the gathered weight carries that cast as `weight.fp8_cast` (a `Quantized`)
with the spec it was cast under as `weight.fp8_spec`. When that spec is the layer's weight spec, fprop and dgrad use
the gathered cast as they would use the layer's own cast of the whole weight (it is bitwise that cast).

A layer may see only a shard of its tensors: under tensor parallelism (minifloat.distributed.tp) a row- or
column-parallel layer's weight, input or output gradient is a slice of the unsharded one. Its `LayerCaster` then
carries `amax_reduce`, which turns a shard's amax into the whole tensor's (a MAX all-reduce over the TP group), and
every per-tensor scale taken from a tensor (current scaling, a delayed role's seed, calibration) comes from that
whole amax: each shard is cast with the unsharded cast's scale, so its FP8 values are the unsharded cast's.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from minifloat.core.capture import host_caches_usable
from minifloat.fp8 import shared_input, telemetry
from minifloat.fp8.fourbit.cast import cast_nvfp4
from minifloat.fp8.gemm import native_granularity, operand
from minifloat.fp8.native import native_nvfp4
from minifloat.fp8.recipes import NVFP4Spec, Recipe, Role
from minifloat.fp8.scaling import ROLE_INDEX, ScalingState
from minifloat.numerics.fp4 import NVFP4Quantized
from minifloat.numerics.granularity import Granularity, granularity_info
from minifloat.numerics.other_axis import quantize_both, quantize_t, requantize_t
from minifloat.numerics.quantize import Quantized, abs_max, quantize

_OPERAND = torch.bfloat16  # FP8 values are exact bfloat16 values: the emulated GEMM's operand dtype
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class WeightCache:
    """A layer's weight casts for the current FP8 step (Transformer Engine's `is_first_microbatch`).

    The weight does not change between the micro-batches of an optimizer step, so its casts are made once. An entry
    is keyed by the weight's version counter and storage (an optimizer step, `load_state_dict` or a `.data`
    swap invalidate it) and the casting options; `clear()` runs at every FP8 step, when delayed scales change.
    Compiled graphs do not use it (the cast is part of the graph; keying on Python state would add guards), nor does
    a CUDA graph's capture (its replays would read the captured step's cast after the weight changed).

    `by_storage` False keys by version, dtype, device and shape alone, for a tensor-parallel layer
    (`LayerCaster.amax_reduce`): a miss there runs a collective (the whole weight's amax), so every rank must miss
    together, and under FSDP2 each micro-batch gathers the weight into a buffer whose address is the allocator's,
    rank by rank (a hit on one rank and a miss on another deadlocked the group). Its weights change within an FP8
    step only by in-place updates, which bump the version.
    """

    def __init__(self):
        self._entries: dict[str, tuple[tuple, Quantized]] = {}
        self.by_storage = True

    def _identity(self, weight: torch.Tensor) -> tuple:
        where = weight.data_ptr() if self.by_storage else tuple(weight.shape)
        return weight._version, where, weight.dtype, weight.device

    def get(self, kind: str, weight: torch.Tensor, options: tuple, make: Callable[[], Quantized]
            ) -> tuple[Quantized, bool]:
        """(the cast, whether it came from the cache). Inside a compiled graph or a CUDA graph's capture the cast is
        made afresh (minifloat.core.capture): a replay must cast the weight it then holds."""
        if not host_caches_usable(weight.device):
            return make(), False
        key = (*self._identity(weight), options)
        entry = self._entries.get(kind)
        if entry is not None and entry[0] == key:
            return entry[1], True
        q = make()
        self._entries[kind] = (key, q)
        return q, False

    def peek(self, kind: str, weight: torch.Tensor, generation: int) -> Quantized | None:
        """The `kind` cast of this very weight in this scaling generation (whatever its other options), else None."""
        if not host_caches_usable(weight.device):  # before reading the dict: no guard on its entries in a compiled
            return None  # graph, and nothing frozen into a CUDA graph's replays
        entry = self._entries.get(kind)
        if entry is None:
            return None
        same_weight = entry[0][:4] == self._identity(weight)
        return entry[1] if same_weight and entry[0][4][-1] == generation else None

    def clear(self) -> None:
        self._entries.clear()


@dataclasses.dataclass
class LayerCaster:
    """Quantizes one layer's tensors under a recipe and records their amaxes in its ScalingState.

    `recording` is False for evaluation forwards (their amaxes stay out of the training history); casts then
    still use the stored delayed scales but never seed them. `amax_reduce`, for a layer that sees shards of its
    tensors, maps a shard's amax to the whole tensor's (see the module docstring); only per-tensor casts take it.
    """

    recipe: Recipe
    state: ScalingState
    name: str = ""
    backend: str | None = None
    recording: bool = True
    weights: WeightCache | None = None
    amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def _whole_amax(self, t: torch.Tensor) -> torch.Tensor:
        """amax(|t|) of the whole tensor `t` is a shard of (t's own without `amax_reduce`)."""
        amax = abs_max(t.detach(), None)
        return amax if self.amax_reduce is None else self.amax_reduce(amax)

    def cast(self, role: Role, t: torch.Tensor, *, record: bool = True, scale: torch.Tensor | None = None,
             keep_data: bool = False, transposed: bool = False, rht_signs: torch.Tensor | None = None,
             with_t: bool = False) -> Quantized | NVFP4Quantized:
        """Quantize `t` (scaled along its last dim) for role `role`.

        The result carries what its GEMM needs: FP8 data for the native backend, a bfloat16 operand for the
        emulated one (NVFP4: the `NVFP4Quantized` itself where `native_nvfp4` says its GEMM runs natively);
        `keep_data` also keeps the FP8 data (for tensors saved for backward). `scale` (a
        dequantization scale) repeats an earlier per-tensor cast exactly. `transposed` quantizes tᵀ (scaled along
        t's first dim) without copying t; it is for re-quantizations in backward and records nothing. `rht_signs`
        (NVFP4 only) rotates the blocks of the quantized axis first: the wgrad's operands. `with_t` asks for the FP8
        data's row-major transpose as well (`Quantized.data_t`, the same pass on a GPU) where the cast is for the native
        backend and its scales transpose with it: the backward GEMM then reads it without a copy.
        """
        spec = self.recipe.spec(role)
        if isinstance(spec, NVFP4Spec):
            if self.amax_reduce is not None:
                raise ValueError(f"a sharded (tensor-parallel) layer casts per tensor only, not NVFP4 ({role.value} "
                                 f"of {self.name or 'a layer'})")
            seed = self.state.sr_next_seed() if spec.rounding == "stochastic" else None
            # the emulated GEMM needs only the operand (telemetry also reads the E2M1 elements); the native one
            # (minifloat.fp8.fourbit.gemm) the elements and the scales
            native = native_nvfp4(t.device, self.backend)
            keep = native or (record and self.recording and telemetry.enabled())
            # the forward's input (rounded to nearest, no rotation: a function of the input) is shared by siblings
            shared = role is Role.INPUT and seed is None and rht_signs is None and not transposed
            options = (spec, self.backend, native, keep) if shared else None
            q = shared_input.lookup(t, options) if shared else None
            if q is None:
                q = cast_nvfp4(spec, t, seed=seed, transposed=transposed, rht_signs=rht_signs,
                               operand_dtype=None if native else _OPERAND, keep_data=keep)
                if shared:
                    shared_input.remember(t, options, q)
            if record:
                self._observe(role, t, q)
            return q if native else q.gemm_operand(_OPERAND)
        # FP8 data for the native backend, a bfloat16 operand for the emulated one (gemm decides, once); 4-bit
        # elements under MX scaling (MXFP4) have no native kernel here
        native = spec.fmt.torch_dtype in _FP8 and native_granularity(
            t.device, Granularity.TENSOR if scale is not None else spec.granularity, self.backend)
        out = dict(operand_dtype=None if native else _OPERAND, keep_data=keep_data or native)
        if with_t and native and not transposed and granularity_info(spec.granularity).transposes_exactly:
            out["with_t"] = True
        if transposed:
            return quantize_t(t, spec.fmt, granularity=spec.granularity, margin=spec.margin,
                              power_of_two=spec.power_of_two, mx_rule=spec.mx_rule, **out)
        if scale is not None:
            return quantize(t, spec.fmt, granularity=Granularity.TENSOR, scale=scale, **out)
        # an eager cast records its amax into the state itself (on a GPU in the launch that takes it); a compiled
        # graph records with its own ops (`ScalingState.record`), which inductor fuses with the cast
        slot = self._slot(role, record)
        # a sibling layer that read this very input (q, k, v; gate, up) may have cast it already: its cast is this
        # one (minifloat.fp8.shared_input; delayed scaling: with the sibling's scale, which its history of the same
        # input's amaxes makes this layer's own)
        shared = role is Role.INPUT and not transposed and self.amax_reduce is None
        options = (spec, self.backend, tuple(out.items())) if shared else None
        q = shared_input.lookup(t, options) if shared else None
        if q is not None:
            if spec.delayed and record and self.recording:  # seeds this layer's scale at its first step, as its
                self.state.delayed_cast_scales(ROLE_INDEX[role], lambda: q.amax, spec.fmt, margin=spec.margin)  # cast
            if record:
                self._observe(role, t, q)  # this layer's own record of the input's amax, and telemetry
            return q
        if spec.delayed:
            dscale, multiplier, amax = self.state.delayed_cast_scales(
                ROLE_INDEX[role], lambda: self._whole_amax(t), spec.fmt, margin=spec.margin,
                store=record and self.recording)
            q = quantize(t, spec.fmt, granularity=Granularity.TENSOR, scale=dscale, multiplier=multiplier, amax=amax,
                         record=slot, **out)
        else:
            if self.amax_reduce is not None and not granularity_info(spec.granularity).per_tensor:
                raise ValueError(f"a sharded (tensor-parallel) layer casts per tensor only, not "
                                 f"'{spec.granularity}' ({role.value} of {self.name or 'a layer'})")
            q = quantize(t, spec.fmt, granularity=spec.granularity, margin=spec.margin,
                         power_of_two=spec.power_of_two, mx_rule=spec.mx_rule,
                         amax=None if self.amax_reduce is None else self._whole_amax(t), record=slot, **out)
        if shared:  # (a delayed cast is retired when its scale moves: the step's end, a load)
            shared_input.remember(t, options, q, state=self.state if spec.delayed else None)
        if record:
            self._observe(role, t, q, recorded=slot is not None)
        return q

    def _slot(self, role: Role, record: bool = True):
        """Where an eager cast of `role` records its amax (`quantize`'s `record`), or None (not recording; compiled)."""
        recording = record and self.recording and not torch.compiler.is_compiling()
        return self.state.amax_slot(role) if recording else None

    def _both_axes_fused(self, role: Role, t: torch.Tensor) -> bool:
        """Whether `role`'s casts are per row or in 1×128 tiles, current scaling, for the native backend: a GPU then
        makes the cast along the other axis in the same passes (`quantize_both`) or from the FP8 bytes
        (`requantize_t`)."""
        spec = self.recipe.spec(role)
        granularity = getattr(spec, "granularity", None)
        return (granularity in (Granularity.TILE, Granularity.ROW) and not spec.delayed
                and self.amax_reduce is None and native_granularity(t.device, granularity, self.backend))

    def cast_both(self, role: Role, t: torch.Tensor) -> tuple[Quantized, Quantized]:
        """(cast(role, t, with_t=True), t cast along its other axis): a 2-D tensor's casts for both GEMMs it feeds
        (the output gradient's, for dgrad and wgrad). The second is the first transposed where the scales transpose
        exactly, else a new cast (recording nothing), made in the first one's passes for rows and tiles on a GPU."""
        if self._both_axes_fused(role, t):
            spec = self.recipe.spec(role)
            slot = self._slot(role)
            q, q_t = quantize_both(t, spec.fmt, granularity=spec.granularity, margin=spec.margin,
                                   power_of_two=spec.power_of_two, record=slot)
            self._observe(role, t, q, recorded=slot is not None)
            return q, q_t
        q = self.cast(role, t, with_t=True)
        if granularity_info(q.granularity).transposes_exactly:
            return q, q.t()
        return q, self.cast(role, t, record=False, transposed=True)

    def cast_t_of(self, role: Role, q: Quantized) -> Quantized:
        """`q` (a cast of this layer's for `role`, FP8 data kept) along its other axis: exactly transposed where its
        scales allow, else re-quantized from its own values (recording nothing): from the FP8 bytes for rows and 1×128
        tiles on a GPU, else from a bfloat16 (folded power-of-two scales) or float32 dequantization."""
        if granularity_info(q.granularity).transposes_exactly:
            return q.t()
        spec = self.recipe.spec(role)
        if q.data is not None and self._both_axes_fused(role, q.data):
            return requantize_t(q, margin=spec.margin, power_of_two=spec.power_of_two)
        if q.data is not None and not q.scale_folded and not native_granularity(q.data.device, spec.granularity,
                                                                                  self.backend):
            # the emulated GEMM's operand: what the cast below makes, its passes reading the FP8 bytes (torch path)
            return requantize_t(q, margin=spec.margin, power_of_two=spec.power_of_two, mx_rule=spec.mx_rule,
                                operand_dtype=_OPERAND, keep_data=False)
        source = operand(q) if q.scale_folded else q.dequantize()
        return self.cast(role, source, record=False, transposed=True)

    def _observe(self, role: Role, t: torch.Tensor, q: Quantized | NVFP4Quantized, recorded: bool = False) -> None:
        """Record q's amax (unless the cast did: `recorded`) and feed telemetry."""
        if recorded:
            self.state.warn_if_nonfinite(role, q.amax)
        elif self.recording:
            self.state.record(role, q.amax)
        if telemetry.enabled():
            telemetry.observe(self.name, role.value, t, q)

    def precast_weight(self, weight: torch.Tensor) -> Quantized | None:
        """The cast a weight arrived with (see the module docstring) when it is the one this layer would make, else
        None (no cast attached, or another recipe in force: the weight's values are then cast as usual)."""
        q = getattr(weight, "fp8_cast", None)
        return q if q is not None and weight.fp8_spec == self.recipe.spec(Role.WEIGHT) else None

    def cast_weight_shard(self, shard: torch.Tensor, amax: torch.Tensor) -> Quantized:
        """One shard (rows) of the weight cast exactly as `cast_weight` casts the whole weight, per-tensor recipes only.

        `amax` is the whole weight's amax (the MAX of the shards' amaxes) or, once a delayed role is seeded, anything
        (the stored scale decides; the amax is only recorded). The state is only read: the forward that uses the
        gathered cast records its amax and seeds a delayed role (`cast_weight`). Returns FP8 data (kept) and the
        dequantization scale the whole weight's cast has.
        """
        spec = self.recipe.spec(Role.WEIGHT)
        if not granularity_info(spec.granularity).per_tensor:
            raise ValueError(f"only per-tensor weight casts can be made shard by shard, not '{spec.granularity}'")
        if spec.delayed:
            dscale, multiplier, _ = self.state.delayed_cast_scales(ROLE_INDEX[Role.WEIGHT], lambda: amax, spec.fmt,
                                                                   margin=spec.margin, store=False)
            return quantize(shard, spec.fmt, granularity=Granularity.TENSOR, scale=dscale, multiplier=multiplier,
                            amax=amax)
        # current scaling: the scale from the whole weight's amax, by the same rule (not a scale passed in: 1/(1/s) is
        # not s in float32), so every FP8 value is the unsharded cast's
        return quantize(shard, spec.fmt, granularity=Granularity.TENSOR, margin=spec.margin,
                        power_of_two=spec.power_of_two, amax=amax)

    def cast_weight(self, weight: torch.Tensor) -> Quantized:
        """The forward's weight cast, made once per FP8 step when the layer caches (its amax recorded each time)."""
        precast = self.precast_weight(weight)
        if precast is not None:
            spec = self.recipe.spec(Role.WEIGHT)
            if self.recording:
                if spec.delayed:  # a first step seeds from the whole weight's amax, which the gather was cast with
                    self.state.delayed_scale(ROLE_INDEX[Role.WEIGHT], lambda: precast.amax, spec.fmt,
                                             margin=spec.margin)
                self.state.record(Role.WEIGHT, precast.amax)
            return precast
        if self.weights is None:
            return self.cast(Role.WEIGHT, weight, with_t=True)
        if telemetry.unseen_weight(self.state):  # a capture's first forward casts again (the same bits), so that its
            self.weights.clear()  # table has the weight; its amax is in row 0 already
        options = (self.recipe, self.backend, self.recording, self.state.generation)  # generation last: see peek
        # a hit needs no recording: the entry was made in this generation, recording, so its amax is in row 0 (which
        # only a new generation clears; recording it again would change nothing, at a kernel launch per micro-batch)
        q, _ = self.weights.get("fprop", weight, options, lambda: self.cast(Role.WEIGHT, weight, with_t=True))
        return q

    def observe_high_precision(self, role: Role, t: torch.Tensor) -> None:
        """Calibration: record `t`'s amax (and seed the scale) without quantizing anything."""
        spec = self.recipe.spec(role)
        amax = self._whole_amax(t)
        self.state.record(role, amax)
        self.state.delayed_scale(ROLE_INDEX[role], lambda: amax, spec.fmt, margin=spec.margin)
