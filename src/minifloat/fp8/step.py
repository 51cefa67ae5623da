"""The FP8 step: scaling state advances once per optimizer step.

Within a step every Fp8Linear only *records*: the amax of each tensor role is max-folded into row 0 of its history,
over all forwards and backwards of the step (micro-batches, a layer used twice, activation-checkpoint recompute,
which records the same amaxes again and so changes nothing). Scales stay fixed until the step ends; then
`ScalingState.advance` turns the history into new delayed scales and rolls it.

When the step ends:
  * automatically, after `optimizer.step()` of any torch.optim optimizer that holds an Fp8Linear's weight or bias
    (a global optimizer post-step hook, registered when the first Fp8Linear is built); a skipped step (LossScaler
    or StepGuard not calling `optimizer.step()`) does not end it;
  * an fp32 master weight (minifloat.amp.master) stands for its low-precision parameter (`alias`), so the
    optimizer that steps the masters ends the step of the layers owning the parameters;
  * a frozen layer (no parameter of its own requires grad: the base layers under LoRA adapters) that training
    forwards went through in eager mode ends its step after the next `optimizer.step()` of any torch.optim optimizer
    (the one stepping the adapters, in a loop or in transformers' Trainer); under torch.compile its forwards count
    nothing, so there, as for layers no optimizer steps at all, `fp8_step(model)` ends it;
  * explicitly, `fp8_step(model)`, for layers no optimizer steps (custom update rules, frozen layers compiled) or
    layers built with `step_on="manual"`.

Across ranks: when torch.distributed is initialised, the end of the step first MAX-all-reduces the step's amaxes
(row 0 of every stepped layer's history, all roles) in one collective over the amax group: the default group unless
`set_amax_group` chose another (or None: no reduction). Every rank then derives the same scales from the same
history, so FP8 scaling state is identical on all ranks after every step (data parallel, FSDP, tensor parallel:
the MAX over all ranks covers each sharded layer's group). The layers are reduced in the order the optimizer holds
their parameters (or `fp8_step`'s module order), which is the same on every rank of one model.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterable, Iterator

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from minifloat.core.switch import ThreadSwitch
from minifloat.core.validate import check_module
from minifloat.fp8 import telemetry
from minifloat.fp8.recipes import Role
from minifloat.fp8.scaling import ROLE_INDEX, advance_states, reduce_states

STEP_ON = ("optimizer", "manual")

# Every live automatically stepped layer. Ownership is read from each layer's parameters when an optimizer steps, so
# a parameter replaced after construction (assignment, load_state_dict(assign=True)) still counts.
_LAYERS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_ALIASES: dict[int, tuple[weakref.ref, weakref.ref]] = {}  # id(stand-in) -> (stand-in, the parameter it stands for)
_HOOK = None
_BUILT = 0  # layers tracked so far: each layer's `_built` is its place in that order
_SUPPRESSED = ThreadSwitch()
_DEFAULT_GROUP = object()  # "the default process group", resolved when a step ends
_AMAX_GROUP = _DEFAULT_GROUP


def track(layer: nn.Module) -> None:
    """Let optimizer steps over `layer`'s own parameters end its FP8 step (see module docstring). Fp8Linear calls it
    when built and when unpickled or deep-copied."""
    global _HOOK, _BUILT
    _BUILT += 1  # (a deep copy or an unpickled layer gets its own place, after its original's)
    layer._built = _BUILT
    _LAYERS.add(layer)
    if _HOOK is None:
        _HOOK = (register_optimizer_step_pre_hook(_before_optimizer_step),
                 register_optimizer_step_post_hook(_after_optimizer_step))


def alias(stand_in: torch.Tensor, param: torch.Tensor) -> None:
    """Let an optimizer step over `stand_in` (e.g. an fp32 master copy) count as one over `param`."""
    key = id(stand_in)
    _ALIASES[key] = (weakref.ref(stand_in, lambda _ref: _ALIASES.pop(key, None)), weakref.ref(param))


@contextlib.contextmanager
def suppressed() -> Iterator[None]:
    """Optimizer steps inside the block end no FP8 step (for wrappers whose own step ends it, this thread only)."""
    with _SUPPRESSED.on():
        yield


def step_skipped(optimizer: torch.optim.Optimizer) -> None:
    """Called from inside `optimizer.step()` that skips its update (non-finite gradients): the step's post-hook then
    ends no FP8 step, as when LossScaler or StepGuard skip `optimizer.step()` altogether."""
    _STEPPING[id(optimizer)] = _SKIPPED


def _before_optimizer_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """The layers' weight casts are for the micro-batches of a step, whose last backward has run: dropped before the
    optimizer's own temporaries are allocated (2 bytes per weight for per-tensor recipes, both layouts), not after.
    The layers found are kept for the step's post-hook, which ends their FP8 step."""
    layers = _owners(p for group in optimizer.param_groups for p in group["params"])
    _STEPPING[id(optimizer)] = layers
    for layer in layers:
        layer.drop_weight_casts()


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    layers = _STEPPING.pop(id(optimizer), None)
    if not _SUPPRESSED and layers is not _SKIPPED:
        if layers is None:
            layers = _owners(p for group in optimizer.param_groups for p in group["params"])
        _end_step(layers + _frozen_trained(layers))


def _frozen_trained(stepped: list[nn.Module]) -> list[nn.Module]:
    """The frozen layers trained through since their step last ended (Fp8Linear counts those forwards, eagerly) and
    not among `stepped`, in the order they were built: the same on every rank of one model, so their amaxes are
    reduced in one order everywhere."""
    seen = {id(layer) for layer in stepped}
    frozen = [layer for layer in list(_LAYERS) if getattr(layer, "_unstepped", 0) and id(layer) not in seen
              and layer.step_on == "optimizer"]
    return sorted(frozen, key=lambda layer: layer._built)


_SKIPPED: list[nn.Module] = []  # what a skipped step ends: nothing, frozen layers included
_STEPPING: dict[int, list[nn.Module]] = {}  # optimizer id -> the layers its running step updates (pre- to post-hook)


def _resolve(p: torch.Tensor) -> torch.Tensor:
    entry = _ALIASES.get(id(p))
    if entry is not None and entry[0]() is p and entry[1]() is not None:
        return entry[1]()
    return p


def set_amax_group(group=_DEFAULT_GROUP) -> None:
    """The process group the step's amaxes are MAX-reduced over when torch.distributed is initialised: the default
    group (no argument), a group (e.g. a DeviceMesh's flattened group), or None for no reduction (each rank keeps
    its own scales: only right when ranks never share a layer's weights or activations)."""
    global _AMAX_GROUP
    _AMAX_GROUP = group


def layer_states(layer: nn.Module) -> list:
    """The scaling states of an FP8 layer: an Fp8Linear's one, an FP8 experts module's 2E (an nn.ModuleList,
    minifloat.fp8.experts)."""
    state = layer.fp8_state
    return list(state) if isinstance(state, nn.ModuleList) else [state]


def _end_step(layers: list[nn.Module]) -> int:
    """Reduce the layers' amaxes across ranks (see module docstring), then advance each; returns how many."""
    states = [(s, layer.recipe) for layer in layers for s in layer_states(layer)]
    if layers and _AMAX_GROUP is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        reduce_states([s for s, _ in states], group=None if _AMAX_GROUP is _DEFAULT_GROUP else _AMAX_GROUP)
    # every layer's scaling state at once (a fixed number of launches, not 18 per layer), then each layer's casts
    advance_states([s for s, _ in states], [recipe for _, recipe in states])
    for layer in layers:
        (layer.step_ended if hasattr(layer, "step_ended") else layer.drop_weight_casts)()
    if layers:
        telemetry.step_ended()
    return len(layers)


def _owners(params: Iterable[torch.Tensor]) -> list[nn.Module]:
    """The automatically stepped layers owning one of `params` (or what an alias stands for), in `params`' order."""
    owners = {id(q): layer for layer in list(_LAYERS) if layer.step_on == "optimizer"
              for q in layer.parameters(recurse=False)}
    layers: dict[int, nn.Module] = {}
    for p in map(_resolve, params):
        layer = owners.get(id(p))
        if layer is not None and any(q is p for q in layer.parameters(recurse=False)):
            layers.setdefault(id(layer), layer)
    return list(layers.values())


def params_updated(params: Iterable[torch.Tensor]) -> int:
    """End the FP8 step of every automatically stepped layer owning one of `params`; returns how many. The layers
    are taken in the order of `params` (the same on every rank of a data-parallel run)."""
    return _end_step(_owners(params))


def fp8_step(model: nn.Module) -> int:
    """End the FP8 step of every Fp8Linear in `model` (whatever its `step_on`); returns how many.

    For loops where no torch.optim optimizer steps the layers' parameters (frozen layers under adapters, custom
    update rules), or for layers built with `step_on="manual"`; in a plain loop `optimizer.step()` already does
    this, and a second end of the same step changes nothing (a role that recorded nothing keeps its state).
    """
    check_module("fp8_step", model)
    return _end_step([m for m in model.modules() if hasattr(m, "fp8_step") and hasattr(m, "fp8_state")])


@torch.no_grad()
def rescale_gradient_amaxes(model: nn.Module, factor: float) -> int:
    """Multiply every delayed-scaling layer's recorded output-gradient amaxes by `factor` (and divide its scale by
    it), for gradients that change size by that factor from now on: a run resumed with another number of
    micro-batches per rank, each rank dividing its losses by its own count. Returns how many layers changed."""
    layers = [m for m in model.modules() if hasattr(m, "fp8_state") and getattr(m, "recipe", None) is not None
              and m.recipe.delayed]
    col = ROLE_INDEX[Role.GRAD_OUTPUT]
    for state in (s for layer in layers for s in layer_states(layer)):
        state.amax_history[:, col].mul_(factor)
        state.scale[col].div_(factor)  # scale = fp8 max / amax: the cast in-flight keeps its place in the range
        state.generation += 1
    return len(layers)
