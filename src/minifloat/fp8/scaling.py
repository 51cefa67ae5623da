"""Scaling state: amax histories and scales as module buffers, and the rule that updates them.

Each FP8 layer owns one `ScalingState` with a column per tensor role (input, weight, grad_output):

    amax_history  (H, 3) float32   row 0 collects this step's amax; rows 1.. are earlier steps
    scale         (3,)   float32   quantization multiplier (stored value = x · scale), Transformer Engine's "scale"
    initialized   (3,)   bool      whether the role has been seeded with a scale yet
    nonfinite     (3,)   int64     how many casts met a NaN/inf amax (the scale was kept, the user warned);
                                   `NonfiniteWatch` reads its rise over a step (StepGuard skips such a step)

Layers under NVFP4Scaling also hold the randomness of their recipe (`add_random_state`), so that a checkpoint, a
rollback or a skipped step brings it back with the rest:

    rht_signs     (16,)  float32   the random Hadamard transform's fixed signs (numerics.hadamard.rht_signs)
    sr_seed       ()     int64     this layer's stochastic-rounding stream (core.rng.named_seed)
    sr_draws      ()     int64     how many draws the stream has made: draw n rounds with the seed
                                   numerics.rounding.counter_seed(sr_seed, n), derived on the device

All are plain tensors in `state_dict` (no pickled objects) and restore exactly. Row 0 of every layer's history is
what data-parallel ranks must agree on: `reduce_amax` concatenates those rows of all layers and reduces them with
one all-reduce (MAX).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from minifloat.core.capture import capturing, refuse_host_read
from minifloat.core.rng import named_seed
from minifloat.numerics import triton_cast
from minifloat.numerics.hadamard import rht_signs
from minifloat.numerics.quantize import scale_from_amax
from minifloat.numerics.rounding import counter_seed, reciprocal_rn
from minifloat.fp8.recipes import DEFAULT_AMAX_HISTORY_LEN, ROLES, AmaxCompute, DelayedScaling, Role

log = logging.getLogger("minifloat")
ROLE_INDEX = {role: i for i, role in enumerate(ROLES)}  # tensor role -> column of the buffers


class ScalingState(nn.Module):
    """Amax history and scales of one FP8 layer (see module docstring)."""

    def __init__(self, history_len: int = DEFAULT_AMAX_HISTORY_LEN, device: torch.device | str | None = None):
        super().__init__()
        if history_len < 1:
            raise ValueError(f"history_len must be >= 1, got {history_len}")
        n = len(ROLES)
        self.register_buffer("amax_history", torch.zeros(history_len, n, dtype=torch.float32, device=device))
        self.register_buffer("scale", torch.ones(n, dtype=torch.float32, device=device))
        self.register_buffer("initialized", torch.zeros(n, dtype=torch.bool, device=device))
        self.register_buffer("nonfinite", torch.zeros(n, dtype=torch.int64, device=device))
        self._warned = False
        self.layer_name = ""  # the owning layer's name in its model (convert sets it), for messages
        self._seeded: list[bool] | None = None  # host mirror of `initialized`, so GPU runs avoid a sync per cast
        self._reciprocals: tuple | None = None  # (key of `scale`, 1 / scale, 1 / (1 / scale)): delayed_cast_scales
        self._scratch: torch.Tensor | None = None  # amax_slot's scratch for the one-pass kernels (not a buffer)
        self._slots: tuple | None = None  # amax_slot's views, per set of buffers
        # bumped whenever the scales may change outside a cast (a step's end, a load or restore): casts cached
        # for the step (the weight's) are only valid for the generation they were made in
        self.generation = 0

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        self._seeded = None
        self.generation += 1
        if not any(key.startswith(prefix) for key in state_dict):
            # the state dict of the model before its conversion (pretrained weights): no scaling state to load, so
            # this layer's stays as it is (fresh: its first step seeds the scales), and a strict load does not fail
            log.info("minifloat: %s is not in the state dict loaded (saved before FP8 conversion?); the layer's "
                     "scaling state is kept", prefix.rstrip("."))
            return
        for key in ("rht_signs", "sr_seed", "sr_draws") if not hasattr(self, "rht_signs") else ():
            if prefix + key in state_dict:  # saved by a layer that met NVFP4 under mf.autocast: its stream continues
                self.register_buffer(key, torch.empty_like(state_dict[prefix + key], device=self.scale.device))
        saved = state_dict.get(prefix + "amax_history")
        if (isinstance(saved, torch.Tensor) and saved.dim() == 2 and saved.shape[0] >= 1
                and saved.shape[1] == len(ROLES) and saved.shape[0] != self.history_len):
            # saved under another amax_history_len: loaded as saved; the next step end resizes it to the recipe's
            # length, keeping the newest steps (as a recipe switched under mf.autocast does)
            self.amax_history = torch.zeros(saved.shape, dtype=torch.float32, device=self.amax_history.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        fresh = [key for key in ("rht_signs", "sr_seed", "sr_draws") if prefix + key in missing_keys]
        if fresh:  # saved under a recipe without NVFP4's random streams: this layer keeps its own
            for key in fresh:
                missing_keys.remove(prefix + key)
            log.info("minifloat: %s was saved without NVFP4's random state (another recipe); the layer keeps its "
                     "own", prefix.rstrip("."))

    def _apply(self, fn, recurse: bool = True):
        was_meta = self.scale.is_meta

        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            # model.half() / .to(torch.bfloat16) move the state but keep it float32: an output gradient's scale is
            # often above fp16's 65504 (inf, then NaN gradients), and bf16 would round every scale
            moved = fn(t)
            return moved if moved.dtype == t.dtype else moved.to(t.dtype) if t.is_meta else t.to(moved.device)

        out = super()._apply(keep_dtype, recurse)
        if was_meta and not self.scale.is_meta:  # to_empty off the meta device: no values came along, only memory
            self.reset()
        return out

    @torch.no_grad()
    def reset(self) -> None:
        """A fresh state, as a new layer's: empty history, scales 1, nothing seeded (its first step seeds the
        scales); random streams (NVFP4) are drawn again at the next cast. A model built on the meta device gets it
        from `to_empty` (uninitialised memory held garbage scales marked as seeded, and a load of weights saved
        before conversion leaves the state as it is)."""
        self.amax_history.zero_()
        self.scale.fill_(1.0)
        self.initialized.zero_()
        self.nonfinite.zero_()
        for key in ("rht_signs", "sr_seed", "sr_draws"):
            self._buffers.pop(key, None)
        self._seeded, self._reciprocals, self._scratch, self._slots = None, None, None, None
        self.generation += 1

    def _host_seeded(self) -> list[bool]:
        if self._seeded is None:
            if self.initialized.is_meta:  # shapes only: nothing to seed from, the stored scale stands in
                return [True] * self.initialized.numel()
            refuse_host_read(self.initialized.device, self._where())
            self._seeded = [bool(v) for v in self.initialized.tolist()]
        return self._seeded

    def _where(self) -> str:
        name = getattr(self, "layer_name", "")  # (a state pickled before it existed has none)
        return f"layer {name!r}" if name else "an FP8 layer"

    @property
    def history_len(self) -> int:
        return self.amax_history.shape[0]

    def add_random_state(self, *, seed: int, name: str = "") -> None:
        """Add the buffers of a recipe that draws randomness (see the module docstring), unless present: the RHT
        signs of `seed` and the rounding stream of `name` (the layer's) under `seed`. A layer built for such a recipe
        has them from the start; one that meets it under `mf.autocast(recipe=...)` gets them at its first cast."""
        if hasattr(self, "rht_signs"):
            return
        if torch.compiler.is_compiling():
            raise RuntimeError("a layer running NVFP4 under torch.compile must be built with its recipe (or run once "
                               "eagerly) so that its random state exists before tracing")
        device = self.scale.device
        self.register_buffer("rht_signs", rht_signs(seed).to(device))
        self.register_buffer("sr_seed", torch.tensor(named_seed(seed, name), dtype=torch.int64, device=device))
        self.register_buffer("sr_draws", torch.zeros((), dtype=torch.int64, device=device))

    def sr_next_seed(self) -> torch.Tensor | None:
        """The seed of this layer's next stochastic-rounding draw, counter_seed(sr_seed, sr_draws), and the stream's
        count up by one; tensor operations only (no host read), so a compiled graph traces it. None on the meta
        device, where nothing is drawn."""
        if self.sr_draws.is_meta:
            return None
        seed = counter_seed(self.sr_seed, self.sr_draws)
        self.sr_draws.add_(1)
        return seed

    def resize(self, history_len: int) -> None:
        """Change the history length, keeping the current row and the newest completed steps.

        Layout (Transformer Engine's): row 0 is the step in progress; `roll` moves it to the last row, so rows
        1..H-1 run from the oldest to the newest completed step.
        """
        if history_len < 1:
            raise ValueError(f"history_len must be >= 1, got {history_len}")
        if history_len == self.history_len:
            return
        new = torch.zeros(history_len, len(ROLES), dtype=torch.float32, device=self.amax_history.device)
        new[0] = self.amax_history[0]
        done = min(history_len, self.history_len) - 1  # completed steps that fit
        if done > 0:
            new[history_len - done:] = self.amax_history[self.history_len - done:]
        self.amax_history = new

    def scale_for(self, role: Role) -> torch.Tensor | None:
        """The role's quantization multiplier, or None before the role was first seeded (eager helper)."""
        col = ROLE_INDEX[role]
        if not self._host_seeded()[col]:
            return None
        return self.scale[col]

    @torch.no_grad()
    def delayed_scale(self, col: int, amax: Callable[[], torch.Tensor], fmt, *, margin: int = 0,
                      store: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The quantization multiplier a delayed cast of column `col` uses this step.

        Once seeded it is the stored scale. Before, it is `seed()` (the tensor's current scale, so step 0 neither
        under- nor overflows), stored as the role's scale when finite: every later cast of this step (micro-batches,
        activation-checkpoint recompute, a reused layer) then quantizes with exactly that multiplier.
        Under torch.compile the choice is a `torch.where` on the `initialized` buffer (no host sync, no guard on
        Python state); eagerly a host mirror of `initialized` skips the extra amax pass once seeded. Both pick the
        same value. Returns (the multiplier, the amax it computed or None), so the cast need not take it again.
        """
        compiling = torch.compiler.is_compiling()
        if not compiling and self._host_seeded()[col]:
            return self.scale[col], None
        now = amax().float().reshape(())
        finite = torch.isfinite(now)  # a NaN/inf step 0 leaves the role unseeded, to seed on the next cast
        fresh = scale_from_amax(now, fmt, margin=margin)
        qscale = torch.where(self.initialized[col], self.scale[col], fresh)
        if not store:
            return qscale, now
        self.scale[col] = torch.where(~self.initialized[col] & finite, fresh, self.scale[col])
        self.initialized[col] = self.initialized[col] | finite
        if not compiling:
            refuse_host_read(self.initialized.device, self._where())
            self._host_seeded()[col] = bool(self.initialized[col])  # one host sync, until the role is seeded
        return qscale, now

    @torch.no_grad()
    def delayed_cast_scales(self, col: int, amax: Callable[[], torch.Tensor], fmt, *, margin: int = 0,
                            store: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`delayed_scale` as a cast takes it: (dequantization scale 1 / s, the multiplier 1 / (1 / s) the cast
        applies, the amax computed or None), s the multiplier `delayed_scale` gives.

        A cast given the dequantization scale multiplies by its reciprocal, which need not be s itself in float32;
        these are its very bits. For a seeded role (the steady state) both come from the stored scales, computed
        once per change of `scale` (an FP8 step, a load): a cast then launches no division (on a GPU, four kernels
        fewer per cast)."""
        seeded = not torch.compiler.is_compiling() and self._host_seeded()[col]
        qscale, now = self.delayed_scale(col, amax, fmt, margin=margin, store=store)
        # reciprocal_rn is `1.0 / s` bit for bit (eager: one reciprocal kernel, where a division launches two); a
        # CUDA graph's capture records the division from the stored scale itself, which every replay reads afresh
        # (the host-side cache would freeze the captured step's reciprocals into the graph: minifloat.core.capture)
        if not seeded or capturing(self.scale.device):
            inverse = reciprocal_rn(qscale)
            return inverse, reciprocal_rn(inverse), now
        key = (self.scale._version, self.scale.data_ptr(), self.scale.device)
        if self._reciprocals is None or self._reciprocals[0] != key:
            # one row of 16 bytes per role: each role's 0-d scale starts 16-byte aligned, as cuBLASLt's FP8 kernels
            # need of every pointer they read (a view at an odd float offset is refused: CUBLAS_STATUS_NOT_SUPPORTED).
            # An elementwise op on the expanded (roles, 4) view writes a dense result: no copy is launched for it.
            # The roles' 0-d views are made here once, not per cast (indexing costs host time).
            inverse = reciprocal_rn(self.scale.unsqueeze(1).expand(-1, 4)).contiguous()
            multiplier = reciprocal_rn(inverse).contiguous()
            self._reciprocals = (key, [(inverse[c, 0], multiplier[c, 0]) for c in range(len(inverse))])
        return (*self._reciprocals[1][col], now)

    @torch.no_grad()
    def record(self, role: Role, amax: torch.Tensor) -> None:
        """Fold a cast's amax into this step's history row (max: recording the same tensor twice is a no-op).

        A non-finite amax never enters the history, so it can never reach a scale; it bumps `nonfinite` instead.
        Sync-free on a GPU (one kernel launch where the one-pass kernels run, instead of eight to twelve torch ops).
        A cast can instead record in its own pass: `quantize(..., record=state.amax_slot(role))`.
        """
        col = ROLE_INDEX[role]
        if torch.compiler.is_compiling():  # the graph's own ops (no scratch: no Python state for dynamo to guard on)
            top = amax.detach().float().amax()
            finite = torch.isfinite(top)
            row = self.amax_history[0, col]
            self.amax_history[0, col] = torch.where(finite, torch.maximum(row, top), row)
            self.nonfinite[col] += (~finite).long()
            return
        slot = self.amax_slot(role)
        check = amax.device.type == "cpu" and not self._warned  # the counter's rise says it: two host reads
        before = int(slot.nonfinite) if check else 0
        triton_cast.record_amax(slot, amax)
        if check and int(slot.nonfinite) != before:
            self._warn_nonfinite(role)

    def amax_slot(self, role: Role) -> triton_cast.AmaxSlot:
        """Where a cast of `role` records its amax (`quantize`'s `record`): the role's entry of row 0 of the history,
        its non-finite counter, and two int32 of scratch (zero between casts; not state: never saved) in which the
        one-pass kernels merge their tiles' amaxes before the last of them folds the total in."""
        # the three views are made once per set of buffers (a cast asks for its slot at every call: indexing costs
        # host time); a buffer replaced (resize, .to(), a `.data` swap) makes them again
        history, nonfinite = self.amax_history, self.nonfinite
        # (fake tensors have no memory to point at: their views are made afresh, as cheap as they are there)
        ptrs = None if isinstance(history, FakeTensor) else (history.data_ptr(), nonfinite.data_ptr())
        slots = getattr(self, "_slots", None)  # (history, nonfinite, their data pointers, the slots); old pickles: None
        if slots is None or slots[0] is not history or slots[1] is not nonfinite or ptrs is None or slots[2] != ptrs:
            if getattr(self, "_scratch", None) is None or self._scratch.device != history.device:
                self._scratch = torch.zeros(len(ROLES), 4, dtype=torch.int32, device=history.device)  # 16 bytes a role
            views = [triton_cast.AmaxSlot(history[0, col], nonfinite[col], self._scratch[col, :2])
                     for col in range(len(ROLES))]
            slots = (history, nonfinite, ptrs, views)
            self._slots = slots
        return slots[3][ROLE_INDEX[role]]

    def warn_if_nonfinite(self, role: Role, amax: torch.Tensor) -> None:
        """After a cast recorded its `amax` (one, or a row's or block's each) itself (`amax_slot`): on the CPU, where
        reading it costs no synchronisation, say once that a cast met NaN/inf (its amax was not recorded). On a GPU
        `NonfiniteWatch` reads the counters once per step instead."""
        if amax.device.type != "cpu" or self._warned:
            return
        if not math.isfinite((amax if amax.numel() == 1 else amax.amax()).item()):  # (NaN propagates through amax)
            self._warn_nonfinite(role)

    def _warn_nonfinite(self, role: Role) -> None:
        log.warning("minifloat: non-finite values in the %s of %s; its amax was not recorded and its scale is kept "
                    "(this layer says it once)", role.value, self._where())
        self._warned = True

    def advance(self, recipe) -> None:
        """The end of an optimizer step: delayed recipes turn the history into new scales (TE rule); the history
        rolls under every recipe, so it always holds the amaxes of the last H steps that ran the layer (telemetry,
        and current statistics when a run switches to delayed scaling; a role the step did not record stays as it
        is: `_roll`). `advance_states` does it for many layers at once."""
        advance_states([self], [recipe])

    @torch.no_grad()
    def update(self, recipe: DelayedScaling, formats: dict[Role, object]) -> None:
        """New scales from the history (TE rule), then roll the history and clear row 0.

        Roles with no amax recorded in the whole history keep their scale (fallback inside scale_from_amax).
        """
        self.generation += 1
        _advance_one(self, (AmaxCompute(recipe.amax_compute), recipe.margin, tuple(formats[r].max for r in ROLES)))

    @torch.no_grad()
    def roll(self) -> None:
        """Move this step's amaxes into the history (oldest entry dropped) and clear row 0."""
        self.generation += 1  # row 0 is cleared: a cached weight cast's amax is no longer recorded in it
        self._roll()

    def _roll(self) -> None:
        # Only the roles this step recorded roll (row 0 nonzero; a device-side choice, no host read): a step end
        # that met no forward or backward of the layer (a second optimizer over other parameters, an optimizer
        # step after a skipped one, a layer not run this step) leaves the history and scales as they are, so they
        # hold the last H steps that ran the layer instead of ageing by empty rows
        rolled = torch.roll(self.amax_history, -1, 0)
        rolled[0].zero_()
        self.amax_history.copy_(torch.where(self.amax_history[0].ne(0), rolled, self.amax_history))


_MAXIMA: dict[tuple, torch.Tensor] = {}


def _format_maxima(maxima: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """The roles' format maxima as a float32 tensor on `device`, made once (no host-to-device copy per step)."""
    key = (maxima, device)
    if key not in _MAXIMA:
        _MAXIMA[key] = torch.tensor(maxima, dtype=torch.float32, device=device)
    return _MAXIMA[key]


@torch.no_grad()
def advance_states(states: Sequence[ScalingState], recipes: Sequence) -> None:
    """`state.advance(recipe)` for each pair, the same bits, in a number of kernel launches that does not grow with
    the number of layers: states whose histories have one length and one device, under one delayed rule (or none),
    are stacked, updated and rolled together and written back with one multi-tensor copy per buffer. (One by one, a
    delayed layer's step end took 18 launches: 1,500 per optimizer step for a model of 84 FP8 linears.)"""
    groups: dict[tuple, list[ScalingState]] = {}
    for state, recipe in zip(states, recipes, strict=True):
        state.generation += 1
        rule = None
        if recipe.delayed:
            state.resize(recipe.history_len)
            rule = (AmaxCompute(recipe.amax_compute), recipe.margin, tuple(recipe.spec(r).fmt.max for r in ROLES))
        key = (state.amax_history.device, state.history_len, rule)
        groups.setdefault(key, []).append(state)
    for (device, _, rule), group in groups.items():
        if len(group) == 1:
            _advance_one(group[0], rule)
            continue
        history = torch.stack([s.amax_history for s in group])  # (layers, H, roles)
        recorded = history[:, 0].ne(0)  # (layers, roles): the roles this step recorded (see _advance_one)
        if rule is not None:
            compute, margin, maxima = rule
            amax = history.amax(dim=1) if compute == AmaxCompute.MAX else history[:, 0]
            old = torch.stack([s.scale for s in group])
            scales = scale_from_amax(amax, _format_maxima(maxima, device), margin=margin, fallback=old)
            torch._foreach_copy_([s.scale for s in group], list(torch.where(recorded, scales, old).unbind(0)))
        rolled = torch.roll(history, -1, 1)
        rolled[:, 0].zero_()
        rolled = torch.where(recorded[:, None], rolled, history)
        torch._foreach_copy_([s.amax_history for s in group], list(rolled.unbind(0)))


def _advance_one(state: ScalingState, rule: tuple | None) -> None:
    """One state's step end under `rule` ((amax compute, margin, the roles' format maxima), None: roll only)."""
    if rule is None:
        state._roll()  # the caller counted the generation
        return
    compute, margin, maxima = rule
    amax = state.amax_history.amax(dim=0) if compute == AmaxCompute.MAX else state.amax_history[0]
    # the three roles' scales in one pass (their formats' maxima as a tensor); scale_from_amax keeps the previous
    # scale where amax is 0 (nothing recorded in the whole history), and a role this step did not record keeps it
    # too (see _roll)
    new = scale_from_amax(amax, _format_maxima(maxima, amax.device), margin=margin, fallback=state.scale)
    state.scale.copy_(torch.where(state.amax_history[0].ne(0), new, state.scale))
    state._roll()


def scaling_states(model: nn.Module) -> list[ScalingState]:
    return [m for m in model.modules() if isinstance(m, ScalingState)]


@torch.no_grad()
def reduce_states(states: list[ScalingState], group=None) -> int:
    """MAX-all-reduce row 0 of the states' histories (this step's amaxes) in one collective; every rank must pass
    the same states in the same order. Returns the number of values reduced (0 without torch.distributed
    initialised, in which case nothing happens)."""
    if not states or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0
    flat = torch.cat([s.amax_history[0] for s in states])  # (3·layers,): one message for the whole model
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX, group=group)
    torch._foreach_copy_([s.amax_history[0] for s in states], list(flat.split(len(ROLES))))  # one launch
    return flat.numel()


def reduce_amax(model: nn.Module, group=None) -> int:
    """Agree on this step's amaxes across ranks with one all-reduce (MAX) over all the model's layers.

    The end of the FP8 step does this by itself (minifloat.fp8.step); call it only for a reduction mid-step, e.g.
    before reading the amaxes. Returns the number of values reduced (0 without torch.distributed initialised).
    """
    return reduce_states(scaling_states(model), group=group)
