"""The FP8 linear layer `Fp8Linear` and the switch around it, `autocast(...)`."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from minifloat.core.autocast import compute_dtype
from minifloat.core.switch import ThreadSwitch
from minifloat.fp8 import step as fp8_steps
from minifloat.fp8.autograd import Fp8LinearFunction, recording_linear
from minifloat.fp8.caster import LayerCaster, WeightCache
from minifloat.fp8.fourbit.linear import Fp4LinearFunction
from minifloat.fp8.gemm import BACKENDS
from minifloat.fp8.native import OUT_DTYPES as COMPUTE_DTYPES  # what the GEMMs write: an FP8 layer computes in them
from minifloat.fp8.recipes import DelayedScaling, NVFP4Scaling, Recipe, check_recipe
from minifloat.fp8.scaling import ScalingState

log = logging.getLogger("minifloat")


@dataclasses.dataclass(frozen=True)
class _AutocastState:
    recipe: Recipe | None = None
    enabled: bool = True
    calibrating: bool = False
    backend: str | None = None


_DEFAULT = _AutocastState()


class _PerThread(threading.local):
    """The autocast state of each thread, `_DEFAULT` until one enters an autocast (set in every thread's first use).

    Per thread, like torch.autocast. A threading.local (not a ContextVar, which dynamo cannot trace): a compiled model
    guards on the state's fields, so entering other settings recompiles rather than reusing a graph traced for others.
    The attribute always exists: a `getattr(local, "state", default)` made dynamo guard on its absence, and the first
    autocast block to exit (an eager evaluation between compiled steps) left it present, recompiling the next step.
    """

    def __init__(self):
        self.state = _DEFAULT


_LOCAL = _PerThread()


_REUSE = ThreadSwitch()  # on inside reuse_weight_casts()


@contextlib.contextmanager
def reuse_weight_casts() -> Iterator[None]:
    """Let forwards without autograd (an evaluation's batches) reuse each Fp8Linear's weight casts, made once per FP8
    step, as a training step's micro-batches do.

    Outside it, every evaluation forward casts its weights afresh: a weight changed through `.data` (an EMA swap, a
    pruning mask) bumps no version counter, so a cache could not tell. Inside it, promise that no weight changes that
    way; changes by in-place ops, `load_state_dict` and optimizer steps are still noticed. Eager only (a compiled
    graph casts in the graph). Per thread; nests.
    """
    with _REUSE.on():
        yield


def reusing_weight_casts() -> bool:
    """Whether this thread is inside `reuse_weight_casts()`."""
    return bool(_REUSE)


@contextlib.contextmanager
def autocast(*, recipe: Recipe | None = None, enabled: bool = True, calibrating: bool = False,
             backend: str | None = None) -> Iterator[None]:
    """Switch FP8 on or off, or change its recipe, for the Fp8Linear layers run inside the block.

    Args:
        recipe: overrides each layer's own recipe for its casts (None keeps them); the end of the FP8 step still
            follows the layer's own recipe (delayed scales update only for layers built with DelayedScaling).
        enabled: False runs every Fp8Linear in high precision (as nn.Linear, under any torch.autocast in force).
        calibrating: run in high precision but record amax statistics of inputs, weights and output gradients,
            so that FP8 scales are current when FP8 is switched (back) on.
        backend: GEMM backend, "auto", "native" or "emulated" (None keeps the layers' own).
    """
    if recipe is not None:
        check_recipe(recipe)
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(enabled, bool) or not isinstance(calibrating, bool):
        raise ValueError(f"enabled and calibrating must be bools, got {enabled!r}, {calibrating!r}")
    prev = current_autocast()
    _LOCAL.state = _AutocastState(recipe, enabled, calibrating, backend)
    try:
        yield
    finally:
        _LOCAL.state = prev


def current_autocast() -> _AutocastState:
    """The FP8 autocast state in force here (recipe override, enabled, calibrating, backend)."""
    return _LOCAL.state


def _unnamed(recipe: Recipe, weight: torch.Tensor) -> str:
    """The stand-in name a directly built layer mixes into its rounding stream's seed (see Fp8Linear.__init__): one
    draw of torch's default generator where the recipe draws randomness and the layer is real, else ""."""
    if not isinstance(recipe, NVFP4Scaling) or weight.is_meta:
        return ""
    return f"<unnamed {torch.randint(0, 2**62, ()).item()}>"


def _add_random_state(state: ScalingState, recipe: Recipe, name: str) -> None:
    """The RHT signs and rounding stream of a recipe that draws randomness (NVFP4), in the layer's state."""
    if isinstance(recipe, NVFP4Scaling):
        state.add_random_state(seed=recipe.seed, name=name)


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's shard of a DTensor parameter (tensor parallel), else `t`; the shard's gradient flows back to the
    DTensor with its placements."""
    return t.to_local() if isinstance(t, DTensor) else t


_FROZEN_WARNED = False  # once per process: an adapter-tuned model has a frozen FP8 layer in every block
# training forwards of a frozen layer without an end of its FP8 step before that is said (more than any gradient
# accumulation takes: any torch.optim optimizer's step ends a frozen layer's step, minifloat.fp8.step)
FROZEN_WARN_AFTER = 1024


def _warn_frozen(name: str, forwards: int) -> None:
    global _FROZEN_WARNED
    _FROZEN_WARNED = True
    log.warning("minifloat: %s is frozen (no parameter requires grad) and %d training forwards went through it "
                "without an end of its FP8 step (no torch.optim optimizer stepped since), so its delayed scales and "
                "amax history stay where they are (said once, for every such layer); call mf.fp8_step(model) after "
                "each update (a no-op for the layers an optimizer already stepped)", name or "an Fp8Linear",
                forwards)


class Fp8Linear(nn.Linear):
    """nn.Linear whose three GEMMs (fprop, dgrad, wgrad) run in FP8 under a scaling recipe.

    Parameters keep their dtype (FP32 master weights stay FP32); the bias is added in high precision; the input is
    saved for backward in FP8. Scaling state (amax history, scales) lives in the `fp8_state` buffers and so in
    `state_dict`. Scales advance once per optimizer step (minifloat.fp8.step): forwards and backwards only record.

    Args:
        in_features, out_features, bias, device, dtype: as nn.Linear.
        recipe: DelayedScaling, CurrentScaling, BlockScaling, MXScaling or NVFP4Scaling (default DelayedScaling());
            4-bit recipes run minifloat.fp8.fourbit.linear's autograd function.
        backend: GEMM backend ("auto", "native", "emulated"); None means auto / $MINIFLOAT_GEMM_BACKEND.
        step_on: "optimizer" (the FP8 step ends after any torch.optim step over this layer's parameters) or
            "manual" (only `minifloat.fp8.step.fp8_step(model)` ends it).
        cache_weight: cast the weight once per FP8 step and reuse it across micro-batches (and for dgrad), at the
            cost of keeping its FP8/bfloat16 copy between steps.

    Tensor parallel (minifloat.distributed.tp): the weight and bias may be DTensors; forward then runs the three GEMMs
    on this rank's shards (the TP style moves inputs and outputs between ranks), and `amax_reduce` (set by the style,
    None otherwise) turns a shard's amax into the whole tensor's, so shards are cast as the unsharded tensor is.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 recipe: Recipe | None = None, backend: str | None = None, step_on: str = "optimizer",
                 cache_weight: bool = True):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"{type(self).__name__}: dtype must be a floating-point torch.dtype (the weight's), "
                             f"got {dtype!r}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = check_recipe(recipe if recipe is not None else DelayedScaling())
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if step_on not in fp8_steps.STEP_ON:
            raise ValueError(f"step_on must be one of {fp8_steps.STEP_ON}, got {step_on!r}")
        if not isinstance(cache_weight, bool):
            raise ValueError(f"cache_weight must be a bool, got {cache_weight!r}")
        self.backend = backend
        self.step_on = step_on
        self.cache_weight = cache_weight
        self.fp8_state = ScalingState(self.recipe.history_len, device=self.weight.device)
        # a layer built directly has no name to mix into its rounding stream's seed: a draw from torch's generator
        # instead, as its weights are drawn, so two such layers draw different numbers and torch.manual_seed
        # reproduces them (convert, which builds on the meta device, names the layers it builds)
        _add_random_state(self.fp8_state, self.recipe, _unnamed(self.recipe, self.weight))
        self.fp8_name = ""
        self._weights = WeightCache()
        self.amax_reduce = None
        self._unstepped = 0  # training forwards of a frozen layer since its FP8 step last ended
        fp8_steps.track(self)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, recipe: Recipe | None = None, backend: str | None = None,
                    name: str = "", **options) -> "Fp8Linear":
        """An Fp8Linear sharing `linear`'s parameters (the same Parameter objects, so optimizers keep them)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_linear takes a torch.nn.Linear, got {type(linear).__name__}; "
                            f"other layers (transformers' Conv1D, convolutions) stay in high precision")
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                      dtype=linear.weight.dtype, recipe=recipe, backend=backend, **options)
        new.weight = linear.weight
        new.bias = linear.bias
        new.fp8_state = ScalingState(new.fp8_state.history_len, device=linear.weight.device)
        _add_random_state(new.fp8_state, new.recipe, name)
        new.fp8_name = new.fp8_state.layer_name = name
        new.train(linear.training)
        fp8_steps.track(new)
        return new

    def __setstate__(self, state) -> None:  # deepcopy and unpickling build no new layer through __init__
        super().__setstate__(state)
        self.__dict__.setdefault("amax_reduce", None)  # layers pickled before tensor parallel existed
        self.__dict__.setdefault("_unstepped", 0)
        fp8_steps.track(self)

    def fp8_step(self) -> None:
        """End this layer's FP8 step: new delayed scales from the amax history, history rolled, weight casts
        dropped. Called for you after optimizer steps (see minifloat.fp8.step)."""
        self.fp8_state.advance(self.recipe)
        self.step_ended()

    def step_ended(self) -> None:
        """Called when this layer's FP8 step has ended (minifloat.fp8.step): its weight casts are dropped."""
        self._unstepped = 0
        self.drop_weight_casts()

    def drop_weight_casts(self) -> None:
        """Forget the weight casts made for this FP8 step (its end does; `fp8_step` for many layers at once calls
        this after advancing their states together)."""
        self._weights.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = current_autocast()
        weight, bias = _local(self.weight), _local(self.bias)
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != weight.shape[-1]:  # a TP shard's own
            got = f"a {type(x).__name__}" if not isinstance(x, torch.Tensor) else f"a tensor of shape {tuple(x.shape)}"
            raise ValueError(f"{type(self).__name__}({self.in_features} -> {self.out_features}) takes a tensor whose "
                             f"last dimension is {weight.shape[-1]}, got {got}")
        if not state.enabled or x.numel() == 0:
            return F.linear(x, weight, bias)
        if compute_dtype(x) not in COMPUTE_DTYPES:
            who = f"FP8 layer {self.fp8_name!r}" if self.fp8_name else type(self).__name__
            raise TypeError(f"{who} got a {x.dtype} input: FP8 and FP4 layers "
                            f"compute in float32, bfloat16 or float16; cast the model and its inputs with .float() "
                            f"(or run under torch.autocast), or keep this layer in high precision (convert's filter)")
        if self.fp8_state.scale.is_meta and not x.is_meta:  # torch's "Tensor on device meta is not on cpu" otherwise
            raise ValueError(f"{self.fp8_name or type(self).__name__}'s FP8 scaling state is on the meta device (a "
                             f"model built there and loaded with assign=True); call model.to_empty(device=...) "
                             f"before loading, or load a state dict that holds it")
        # evaluation records nothing; activation-checkpoint recompute records the same amaxes again (a no-op)
        recording = (self.training and torch.is_grad_enabled()) or state.calibrating
        # a compiled graph casts the weight in the graph: no WeightCache, whose entries (filled by eager forwards,
        # emptied at each FP8 step) and generation dynamo would otherwise guard on, recompiling the next steps
        compiling = torch.compiler.is_compiling()
        # nor does a forward without autograd (evaluation), unless inside `reuse_weight_casts()`: the cache is for the
        # micro-batches of a training step, and an edit through `.data` between evaluations (an EMA swap, a pruning
        # mask) bumps no version counter
        reuse = torch.is_grad_enabled() or reusing_weight_casts()
        weights = self._weights if self.cache_weight and not compiling and reuse else None
        if weights is not None:  # a TP layer's cache hits on every rank or none (WeightCache)
            weights.by_storage = self.amax_reduce is None
        # nor does a compiled graph read the layer's name (messages and telemetry only): dynamo would guard on the
        # string, and the blocks of a model compiled one by one (regional compilation) would each compile again
        name = "" if compiling else self.fp8_name
        caster = LayerCaster(state.recipe if state.recipe is not None else self.recipe, self.fp8_state, name,
                             state.backend if state.backend is not None else self.backend, recording, weights,
                             self.amax_reduce)
        if not compiling and self._frozen_in_training():
            # the next optimizer step of any optimizer ends this layer's step (and resets the count)
            self._unstepped += 1
            if self._unstepped >= FROZEN_WARN_AFTER and not _FROZEN_WARNED:
                _warn_frozen(self.fp8_name, self._unstepped)
        if state.calibrating:
            return recording_linear(x, weight, bias, caster)
        if caster.recipe.four_bit:
            _add_random_state(self.fp8_state, caster.recipe, name)  # present unless autocast brought it
        function = Fp4LinearFunction if caster.recipe.four_bit else Fp8LinearFunction
        # the Function sees (tokens, in) and gives (tokens, out); the reshapes happen out here, so the output is no
        # view made inside it, which a caller could not modify in place (`y += r`, HF Falcon)
        y = function.apply(x.reshape(-1, x.shape[-1]), weight, bias, caster, compute_dtype(x))
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def _frozen_in_training(self) -> bool:
        """Trained through (training mode, autograd on) with no parameter of its own to train: then no optimizer
        ends its FP8 step."""
        return (self.training and torch.is_grad_enabled() and self.step_on == "optimizer"
                and not any(p.requires_grad for p in self.parameters(recurse=False)))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"
