"""Sibling layers that read the same input share its cast: one pass over the tensor instead of one per layer.

In a transformer block the q, k and v projections read the same normalized activation, and so do an MLP's gate and
up projections. Each of them used to cast that tensor itself, to the same bits, and to save its own FP8 copy for its
weight gradient. Here the first layer's cast is kept, and a sibling reading the same tensor takes it:
  * the passes over the input (amax, cast, transposed copy) run once instead of three times for q, k, v and twice
    for gate, up (a GPU launches the cast's kernels once, and one small record per sibling; Transformer Engine fuses
    the QKV projections for the same reason);
  * the FP8 copy saved for backward is one tensor that every sibling's autograd node references, instead of one
    copy per layer;
  * each sibling still records the input's amax in its own scaling state (a delayed role is seeded from it at the
    first step) and feeds telemetry, so its history, scales, non-finite count and statistics are as before.
Why the cast is the same: under current scaling (per tensor or row), 1×128 tiles and MX blocks the scale is a function
of the input alone. Under delayed scaling it is the first sibling's stored scale, which is a function of its history
of the same input's amaxes, the history every sibling records step by step: so the outputs, gradients and scaling
state are bitwise those of unshared casts (tests/test_shared_input.py). Where a sibling's delayed scale differs (an
edit by hand, or a layer that also reads other tensors), it takes the first sibling's cast all the same: a scale
made from this very input's amax history.

"The same tensor" means the same memory, layout, dtype and version (an in-place change bumps the version; a write
through `.data` does not, as for every autograd-saved tensor; a tensor made under torch.inference_mode has no version
counter, and is never shared) while the tensor the input views is alive: the entry holds only a weak reference to it,
and is dropped when it dies, so no activation lives longer than it would. A delayed cast is also retired at its
scaling state's next generation (the FP8 step's end, a load), so a tensor read again in a later step is cast with
that step's scale. One entry per thread, the latest cast: siblings are called one after another, and the first FP8
backward drops every entry (the forward's last cast would otherwise keep the bytes autograd does not save, its
row-major FP8 copy or bfloat16 operand, for as long as its input lives). NVFP4's forward input is shared too (rounded
to nearest and not rotated, it is a function of the input); its stochastically rounded gradients and rotated wgrad
operands are each layer's own. Not shared: tensor-parallel shards (their scale comes from a collective), casts
inside a compiled graph (the graph holds no Python state; there the compiler may merge identical casts itself) and
casts while a CUDA graph is captured: an entry made before the capture (the graph's static input, cast by a warm-up
step) would be frozen into every replay (minifloat.core.capture).
"""

from __future__ import annotations

import threading
import weakref

import torch

from minifloat.core.capture import host_caches_usable
from minifloat.core.switch import ThreadSwitch
from minifloat.numerics.quantize import Quantized

_LOCAL = threading.local()  # .holder: this thread's `_Holder`
_HOLDERS: "weakref.WeakSet[_Holder]" = weakref.WeakSet()  # every thread's, for `release`
_OFF = ThreadSwitch()  # on inside `unshared()`: every cast is made afresh (this thread)


class _Holder:
    """One thread's one-entry store, reachable from other threads: an input can die in one of autograd's threads,
    and a backward runs there."""

    __slots__ = ("entry", "__weakref__")

    def __init__(self):
        # (weak ref to the viewed tensor, identity, options, the cast, the scaling state it depends on, its generation)
        self.entry: tuple | None = None


def unshared():
    """Inside the block (this thread only) every layer casts its input itself: the reference the sharing is tested
    against, and a way to rule it out when chasing a numerical question."""
    return _OFF.on()


def _anchor(t: torch.Tensor) -> torch.Tensor:
    """The tensor `t` views (itself if it is no view): alive as long as `t`'s memory can hold `t`'s values."""
    return t if t._base is None else t._base


def _identity(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device,
            t._version)


def _holder() -> _Holder:
    holder = getattr(_LOCAL, "holder", None)
    if holder is None:
        holder = _LOCAL.holder = _Holder()
        _HOLDERS.add(holder)
    return holder


def lookup(t: torch.Tensor, options: tuple) -> Quantized | None:
    """The cast a sibling made of this very tensor with these options (the casting spec, backend and outputs asked
    for), while what it depended on is unchanged; else None."""
    if not host_caches_usable(t.device) or _OFF or t.is_inference():  # (compiling: nothing more is traced)
        return None
    entry = _holder().entry
    if entry is None:
        return None
    ref, identity, stored_options, q, state, generation = entry
    if ref() is not _anchor(t) or identity != _identity(t) or stored_options != options:
        return None
    if state is not None and state.generation != generation:  # its delayed scale may have moved (a step's end, a load)
        return None
    return q


def remember(t: torch.Tensor, options: tuple, q: Quantized, state=None) -> None:
    """Keep `q`, the cast of `t` under `options`, for the next layer that reads `t` (replacing the previous entry);
    `state`: the ScalingState whose delayed scale the cast was made with, whose next generation (the FP8 step's end, a
    load, a reset: `ScalingState.generation`) retires it."""
    if not host_caches_usable(t.device) or _OFF or t.is_inference():  # (an inference tensor has no version counter)
        return
    holder = _holder()

    def dropped(ref):  # the input died: let its cast go too (unless another entry replaced it since)
        if holder.entry is not None and holder.entry[0] is ref:
            holder.entry = None

    holder.entry = (weakref.ref(_anchor(t), dropped), _identity(t), options, q, state,
                    None if state is None else state.generation)


def release() -> None:
    """Drop every thread's entry: a backward has begun, so the forward's siblings have all been called, and the last
    cast of the forward would otherwise hold its bytes (the row-major FP8 copy, the emulated GEMM's bfloat16 operand,
    which autograd does not save) for as long as its input lives. The FP8 layers' backwards call it (not a compiled
    one: no entry is made there)."""
    if torch.compiler.is_compiling():
        return
    for holder in list(_HOLDERS):
        holder.entry = None


def forget() -> None:
    """Drop this thread's entry (tests)."""
    _holder().entry = None
