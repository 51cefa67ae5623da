"""Tests for minifloat.fp8.scaling: the delayed-scaling update rule, non-finite handling, state_dict and reduce_amax.

The reference is Transformer Engine's delayed scaling (transformer_engine/pytorch/fp8.py, `_default_sf_compute` and
`_update_amax_history`), re-implemented below on Python floats:
    amax  = max(history) ("max") or history[0] ("most_recent")
    scale = fp8_max / amax / 2^margin, kept as it was where amax is 0, inf or NaN
    history = roll(history, -1) with row 0 cleared
Row 0 collects the current step; after a roll the previous row 0 sits in the last row, so from newest to oldest the
history reads rows 0, H-1, H-2, ..., 1.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from torch import nn

import minifloat as mf
from minifloat.numerics.formats import E4M3, E5M2
from minifloat.fp8.modules import Fp8Linear
from minifloat.fp8.recipes import ROLES, DelayedScaling, Role
from minifloat.fp8.scaling import ScalingState, reduce_amax, scaling_states

FORMATS = {Role.INPUT: E4M3, Role.WEIGHT: E4M3, Role.GRAD_OUTPUT: E5M2}
FMT_MAX = [FORMATS[role].max for role in ROLES]
# torch evaluates `float / tensor` as reciprocal(tensor) · float: two float32 roundings (as in TE, which writes the
# same expression) where one correctly rounded division would make one
SCALE_RTOL = 2.0**-22


# ---------------------------------------------------------------------------------------------------- reference


class TEReference:
    """Transformer Engine's delayed scaling on Python floats (float64), one column per role, with minifloat's one
    difference: a role whose step recorded nothing (amax 0) keeps its column and scale. TE updates a module's
    state when that module runs; minifloat's step end may also come when it did not (a second optimizer, a step
    after a skipped one), which must then change nothing."""

    def __init__(self, history_len: int, amax_compute: str, margin: int):
        self.history = [[0.0] * len(ROLES) for _ in range(history_len)]
        self.scale = [1.0] * len(ROLES)
        self.amax_compute, self.margin = amax_compute, margin

    def update(self) -> None:
        recorded = [self.history[0][col] != 0 for col in range(len(ROLES))]
        for col in range(len(ROLES)):
            column = [row[col] for row in self.history]
            amax = max(column) if self.amax_compute == "max" else column[0]
            if amax > 0 and math.isfinite(amax) and recorded[col]:
                # fp8_max / amax in float32 (the division of the state's dtype); / 2^margin is exact
                self.scale[col] = float(np.float32(FMT_MAX[col]) / np.float32(amax)) / 2.0**self.margin
        rolled = self.history[1:] + [self.history[0]]
        rolled[0] = [0.0] * len(ROLES)
        self.history = [[new[col] if recorded[col] else old[col] for col in range(len(ROLES))]
                        for new, old in zip(rolled, self.history)]

    def record(self, col: int, amax: float) -> None:
        if math.isfinite(amax):
            self.history[0][col] = max(self.history[0][col], float(np.float32(amax)))  # the history is float32


def run_steps(state: ScalingState, ref: TEReference, recipe: DelayedScaling, steps):
    """Each step: update (the start of a training step), then record every role's amax(es)."""
    for step in steps:
        state.update(recipe, FORMATS)
        ref.update()
        for col, role in enumerate(ROLES):
            for amax in step[col] if isinstance(step[col], tuple) else (step[col],):
                state.record(role, torch.tensor(amax))
                ref.record(col, amax)
        assert state.scale.tolist() == pytest.approx(ref.scale, rel=SCALE_RTOL, abs=0), step
        assert state.amax_history.tolist() == ref.history, step


# ---------------------------------------------------------------------------------------------------- update rule

# per-step amaxes of (input, weight, grad_output); a tuple records several casts within one step
STEPS = [
    (1.0, 0.5, 1e-3),
    (2.0, 0.5, 4e-3),
    (0.25, 0.75, 2e-3),
    (3.0, 0.5, 0.0),  # grad_output recorded nothing this step
    ((0.5, 5.0, 1.0), 0.5, 1e-2),  # three input casts in one step: their max counts
    (0.1, 0.5, 1e-4),
    (0.1, 0.5, 1e-4),
    (0.1, 0.5, 1e-4),
    (0.1, 0.5, 1e-4),
]

# (name, history_len, amax_compute, margin)
UPDATE_CASES = [
    ("max-h4", 4, "max", 0),
    ("max-h2-margin1", 2, "max", 1),
    ("most-recent-h1", 1, "most_recent", 0),
    ("most-recent-h3-margin2", 3, "most_recent", 2),
    ("max-h16", 16, "max", 0),
]


@pytest.mark.parametrize("history_len, amax_compute, margin", [c[1:] for c in UPDATE_CASES],
                         ids=[c[0] for c in UPDATE_CASES])
def test_update_matches_transformer_engine(history_len, amax_compute, margin):
    recipe = DelayedScaling(amax_history_len=history_len, amax_compute=amax_compute, margin=margin)
    state, ref = ScalingState(history_len), TEReference(history_len, amax_compute, margin)
    run_steps(state, ref, recipe, STEPS)


def test_update_scale_is_fp8_max_over_amax():
    state = ScalingState(4)
    state.record(Role.INPUT, torch.tensor(2.0))
    state.record(Role.WEIGHT, torch.tensor(0.5))
    state.record(Role.GRAD_OUTPUT, torch.tensor(8.0))
    state.update(DelayedScaling(amax_history_len=4), FORMATS)
    assert state.scale.tolist() == [448.0 / 2.0, 448.0 / 0.5, 57344.0 / 8.0]
    # the history rolled: the recorded row moved to the end and row 0 is clear for the next step
    assert state.amax_history[0].tolist() == [0.0, 0.0, 0.0]
    assert state.amax_history[-1].tolist() == [2.0, 0.5, 8.0]


def test_zero_amax_keeps_previous_scale():
    recipe = DelayedScaling(amax_history_len=1)
    state = ScalingState(1)
    state.record(Role.INPUT, torch.tensor(4.0))
    state.update(recipe, FORMATS)
    assert state.scale[0].item() == 448.0 / 4.0
    state.record(Role.INPUT, torch.tensor(0.0))
    state.update(recipe, FORMATS)
    assert state.scale[0].item() == 448.0 / 4.0
    assert state.scale[1:].tolist() == [1.0, 1.0]  # never recorded: initial scale kept


def test_max_history_forgets_a_spike_after_history_len_steps():
    recipe = DelayedScaling(amax_history_len=3)
    state = ScalingState(3)
    for amax in (100.0, 1.0, 1.0, 1.0):
        state.update(recipe, FORMATS)
        state.record(Role.INPUT, torch.tensor(amax))
    state.update(recipe, FORMATS)
    assert state.scale[0].item() == 448.0  # the spike left the 3-step window


# ---------------------------------------------------------------------------------------------------- non-finite

# (name, amax)
NONFINITE = [("nan", float("nan")), ("inf", float("inf")), ("-inf", float("-inf"))]


@pytest.mark.parametrize("amax", [c[1] for c in NONFINITE], ids=[c[0] for c in NONFINITE])
def test_nonfinite_amax_is_not_recorded(amax, caplog):
    recipe = DelayedScaling(amax_history_len=4)
    state = ScalingState(4)
    state.record(Role.INPUT, torch.tensor(2.0))
    state.update(recipe, FORMATS)
    state.record(Role.INPUT, torch.tensor(1.0))
    history, scale = state.amax_history.clone(), state.scale.clone()
    with caplog.at_level(logging.WARNING, logger="minifloat"):
        state.record(Role.INPUT, torch.tensor(amax))
        state.record(Role.GRAD_OUTPUT, torch.tensor(amax))
    assert torch.equal(state.amax_history, history)
    assert torch.equal(state.scale, scale)
    assert state.nonfinite.tolist() == [1, 0, 1]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1  # warned once, not per cast
    state.update(recipe, FORMATS)
    assert torch.isfinite(state.scale).all()
    assert state.scale[0].item() == 448.0 / 2.0


@pytest.mark.parametrize("amax", [c[1] for c in NONFINITE], ids=[c[0] for c in NONFINITE])
def test_nonfinite_amax_never_seeds_a_scale(amax):
    state = ScalingState(2)
    state.record(Role.INPUT, torch.tensor(amax))
    used, seen = state.delayed_scale(0, lambda: torch.tensor(amax), E4M3)
    assert not math.isfinite(seen.item())  # the amax it took, returned for the cast to record
    assert used.item() == 1.0  # scale_from_amax's fallback for this cast
    assert state.scale[0].item() == 1.0
    assert not state.initialized[0]  # left unseeded, to seed from the next finite amax
    assert state.delayed_scale(0, lambda: torch.tensor(4.0), E4M3)[0].item() == 112.0
    assert state.initialized[0]
    assert state.nonfinite[0].item() == 1
    assert state.amax_history[0, 0].item() == 0.0


def test_nonfinite_element_anywhere_in_amax_tensor_is_caught():
    state = ScalingState(2)
    state.record(Role.WEIGHT, torch.tensor([1.0, float("nan"), 3.0]))
    assert state.nonfinite.tolist() == [0, 1, 0]
    assert state.amax_history[0, 1].item() == 0.0


def test_delayed_scale_seeds_once():
    state = ScalingState(2)
    assert state.scale_for(Role.INPUT) is None
    assert state.delayed_scale(0, lambda: torch.tensor(4.0), E4M3)[0].item() == 112.0  # 448 / 4
    assert state.scale_for(Role.INPUT).item() == 112.0
    assert state.delayed_scale(0, lambda: torch.tensor(8.0), E4M3)[0].item() == 112.0  # already seeded: stored scale
    assert state.initialized.tolist() == [True, False, False]


def test_delayed_scale_without_store_leaves_state_alone():
    state = ScalingState(2)
    assert state.delayed_scale(1, lambda: torch.tensor(4.0), E4M3, store=False)[0].item() == 112.0
    assert state.initialized.tolist() == [False, False, False]
    assert state.scale.tolist() == [1.0, 1.0, 1.0]


def test_record_is_idempotent_max():
    # activation-checkpoint recompute and reused layers record the same amax again: nothing changes
    state = ScalingState(2)
    for amax in (3.0, 1.0, 3.0, 2.0):
        state.record(Role.INPUT, torch.tensor(amax))
    assert state.amax_history[0].tolist() == [3.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------------- resize


def _fill(state: ScalingState, recipe: DelayedScaling, amaxes) -> None:
    for amax in amaxes:
        state.update(recipe, FORMATS)
        for role in ROLES:
            state.record(role, torch.tensor(float(amax)))


# (name, old length, new length)
RESIZES = [("shrink-8-to-4", 8, 4), ("shrink-8-to-1", 8, 1), ("shrink-5-to-2", 5, 2), ("grow-4-to-8", 4, 8)]


@pytest.mark.parametrize("old, new", [c[1:] for c in RESIZES], ids=[c[0] for c in RESIZES])
def test_resize_keeps_newest_entries(old, new):
    # amax of step t is old - t: the oldest steps hold the largest values, so keeping old entries shows in the scale
    recipe = DelayedScaling(amax_history_len=old)
    state = ScalingState(old)
    amaxes = [float(old - t) for t in range(old)]
    _fill(state, recipe, amaxes)
    state.resize(new)
    assert state.history_len == new
    newest = amaxes[-new:]  # the current row 0 and the new - 1 steps before it
    assert sorted(state.amax_history[:, 0].tolist()) == sorted(newest + [0.0] * (new - len(newest)))
    assert state.amax_history[0, 0].item() == amaxes[-1]  # row 0 stays the current step
    state.update(DelayedScaling(amax_history_len=new), FORMATS)
    assert state.scale[0].item() == pytest.approx(448.0 / max(newest), rel=2**-23)


def test_resize_to_same_length_is_a_no_op():
    state = ScalingState(4)
    _fill(state, DelayedScaling(amax_history_len=4), [1.0, 2.0, 3.0])
    before = state.amax_history
    state.resize(4)
    assert state.amax_history is before


def test_rejects_empty_history():
    with pytest.raises(ValueError, match="history_len"):
        ScalingState(0)


# ---------------------------------------------------------------------------------------------------- state_dict


def test_state_dict_round_trip_is_exact():
    recipe = DelayedScaling(amax_history_len=4)
    state = ScalingState(4)
    state.delayed_scale(0, lambda: torch.tensor(3.0), E4M3)
    _fill(state, recipe, [1.0, 5.0, 0.25])
    state.record(Role.GRAD_OUTPUT, torch.tensor(float("nan")))

    sd = state.state_dict()
    assert set(sd) == {"amax_history", "scale", "initialized", "nonfinite"}
    assert all(type(v) is torch.Tensor for v in sd.values())  # plain tensors, nothing pickled

    fresh = ScalingState(4)
    assert fresh.scale_for(Role.INPUT) is None  # caches the host mirror of `initialized` before loading
    fresh.load_state_dict(sd)
    for key, value in state.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    assert fresh.scale_for(Role.INPUT) is not None  # the mirror was refreshed by the load
    assert torch.equal(fresh.scale_for(Role.INPUT), state.scale_for(Role.INPUT))


def _trained(recipe, steps: int = 3) -> nn.Module:
    torch.manual_seed(0)
    model = mf.convert(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)), recipe=recipe,
                       keep_first_last=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(16, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model


def test_a_state_saved_under_another_history_length_loads_and_is_resized_at_the_step_end():
    """A checkpoint of amax_history_len=4 loads into a layer of the default length (strictly): the history and
    scales as saved, the next step end resizes the history to the layer's recipe, keeping the newest steps."""
    saved = _trained(DelayedScaling(amax_history_len=4))
    model = _trained(DelayedScaling(), steps=0)
    model.load_state_dict(saved.state_dict())  # strict
    for a, b in zip(scaling_states(model), scaling_states(saved)):
        assert torch.equal(a.amax_history, b.amax_history) and torch.equal(a.scale, b.scale)
    expected = [s.amax_history.clone() for s in scaling_states(model)]
    model(torch.randn(16, 32)).square().mean().backward()
    torch.optim.SGD(model.parameters(), lr=1e-2).step()
    for state, before in zip(scaling_states(model), expected):
        assert state.history_len == DelayedScaling().history_len
        # the three completed steps kept, oldest first, then the step just taken (rolled into the last row)
        assert torch.equal(state.amax_history[-4:-1], before[1:])
        assert torch.isfinite(state.scale).all()


def test_a_state_saved_without_nvfp4_random_streams_loads_into_an_nvfp4_layer(caplog):
    saved = _trained(DelayedScaling())
    model = _trained(mf.NVFP4Scaling(), steps=1)
    streams = {k: v.clone() for k, v in model.state_dict().items() if k.endswith(("rht_signs", "sr_seed"))}
    assert streams, "an NVFP4 layer has random streams"
    with caplog.at_level(logging.INFO, logger="minifloat"):
        model.load_state_dict(saved.state_dict())  # strict: the streams are not missing keys
    assert "saved without NVFP4's random state" in caplog.text
    for key, value in streams.items():  # the layer keeps its own
        assert torch.equal(model.state_dict()[key], value), key
    model(torch.randn(16, 32)).square().mean().backward()  # and trains on


# ---------------------------------------------------------------------------------------------------- reduce_amax


def _model(num_layers: int) -> nn.Module:
    model = nn.Sequential(*[Fp8Linear(16, 16) for _ in range(num_layers)])
    for i, state in enumerate(scaling_states(model)):
        state.amax_history[0] = torch.tensor([i + 1.0, i + 2.0, i + 3.0])
        state.amax_history[1] = torch.tensor([100.0, 100.0, 100.0])  # older rows are not reduced
    return model


def test_reduce_amax_without_distributed_is_a_no_op():
    assert not torch.distributed.is_initialized()
    model = _model(2)
    before = [s.amax_history.clone() for s in scaling_states(model)]
    assert reduce_amax(model) == 0
    assert all(torch.equal(s.amax_history, b) for s, b in zip(scaling_states(model), before))


@pytest.fixture
def gloo_group(tmp_path):
    """A single-process gloo group (rank 0 of 1), destroyed afterwards."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("num_layers", [1, 3])
def test_reduce_amax_uses_one_all_reduce_for_all_layers(gloo_group, monkeypatch, num_layers):
    dist = torch.distributed
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append((tensor.shape, kwargs.get("op", args[0] if args else None)))
        return real_all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counting_all_reduce)
    model = _model(num_layers)
    before = [s.amax_history.clone() for s in scaling_states(model)]

    assert reduce_amax(model) == 3 * num_layers
    assert len(calls) == 1
    assert calls[0] == (torch.Size([3 * num_layers]), dist.ReduceOp.MAX)
    # one rank: MAX is the identity, and each layer gets its own values back
    assert all(torch.equal(s.amax_history, b) for s, b in zip(scaling_states(model), before))


def test_reduce_amax_of_model_without_fp8_layers_is_zero(gloo_group):
    assert reduce_amax(nn.Sequential(nn.Linear(4, 4))) == 0


def _f32_bits(t: torch.Tensor) -> int:
    return int(t.detach().float().reshape(()).view(torch.int32))


def test_delayed_cast_scales_are_the_reciprocals_a_cast_computes():
    """(1 / s, 1 / (1 / s)) bit for bit, before and after seeding. 112 = 448 / 4 is a scale whose reciprocal's
    reciprocal is not itself in float32 (111.99999), so a cast given the dequantization scale multiplies by that."""
    state = ScalingState(2)
    dscale, multiplier, amax = state.delayed_cast_scales(0, lambda: torch.tensor(4.0), E4M3)  # seeds the role
    s = torch.tensor(112.0)
    assert _f32_bits(1.0 / (1.0 / s)) != _f32_bits(s)  # the case this is about
    assert (_f32_bits(dscale), _f32_bits(multiplier)) == (_f32_bits(1.0 / s), _f32_bits(1.0 / (1.0 / s)))
    assert amax.item() == 4.0
    again = state.delayed_cast_scales(0, lambda: torch.tensor(8.0), E4M3)  # seeded: the stored scale's pair
    assert (_f32_bits(again[0]), _f32_bits(again[1])) == (_f32_bits(dscale), _f32_bits(multiplier))
    assert again[2] is None


def test_delayed_cast_scales_follow_every_change_of_the_scales():
    """The stored scales' reciprocals are made once per change: an FP8 step's update, a load, an in-place write."""
    state = ScalingState(2)
    for col in range(3):
        state.delayed_cast_scales(col, lambda: torch.tensor(4.0), E4M3)

    def pair(col):
        d, m, _ = state.delayed_cast_scales(col, lambda: torch.tensor(1.0), E4M3)
        return _f32_bits(d), _f32_bits(m)

    def expected(col):
        s = state.scale[col].clone()
        return _f32_bits(1.0 / s), _f32_bits(1.0 / (1.0 / s))

    assert pair(0) == expected(0)
    state.scale[1] = 7.0  # in place
    assert pair(1) == expected(1) and pair(0) == expected(0)
    state.record(Role.INPUT, torch.tensor(13.0))
    state.update(DelayedScaling(amax_history_len=2), {r: E4M3 for r in ROLES})
    assert state.scale[0].item() != 112.0  # the update changed it
    assert pair(0) == expected(0)
    other = ScalingState(2)
    other.load_state_dict({**state.state_dict(), "scale": torch.tensor([5.0, 6.0, 7.0])})
    for col in range(3):
        assert (lambda d, m, _: (_f32_bits(d), _f32_bits(m)))(
            *other.delayed_cast_scales(col, lambda: torch.tensor(1.0), E4M3)) == (
            _f32_bits(1.0 / other.scale[col].clone()), _f32_bits(1.0 / (1.0 / other.scale[col].clone())))


def test_amax_slots_are_made_once_and_follow_every_replaced_buffer():
    """A cast's slot (views into row 0 of the history and the non-finite counter) is made once per set of buffers,
    and a record through it lands in the buffers the state holds now: after a resize, a `.data` swap, `.to()` and a
    load alike."""
    from minifloat.numerics import triton_cast

    state = ScalingState(4)
    first = state.amax_slot(Role.INPUT)
    assert state.amax_slot(Role.INPUT) is first  # no new views per cast
    assert state.amax_slot(Role.WEIGHT) is not first

    def records_into_the_state(value):
        triton_cast.record_amax(state.amax_slot(Role.GRAD_OUTPUT), torch.tensor(value))
        assert state.amax_history[0, 2].item() == value
        triton_cast.record_amax(state.amax_slot(Role.GRAD_OUTPUT), torch.tensor(float("nan")))
        return state.nonfinite[2].item()

    assert records_into_the_state(3.0) == 1
    state.resize(8)  # a new history tensor
    assert records_into_the_state(5.0) == 2
    state.amax_history.data = torch.zeros(8, 3)  # the same tensor object, new storage
    state.nonfinite.data = torch.zeros(3, dtype=torch.int64)
    assert records_into_the_state(7.0) == 1
    state.to(torch.float64).to(torch.float32)  # module._apply: new buffers
    assert records_into_the_state(9.0) == 2
    state.load_state_dict(ScalingState(8).state_dict())  # copied into the buffers in place
    assert records_into_the_state(11.0) == 1


def test_amax_slots_of_fake_tensors_read_no_memory():
    """Fake tensors (shape tracing) have no memory: a slot is made without asking for a data pointer (torch warns, and
    will raise, where one is read)."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("error")
        state = ScalingState(4)
        assert isinstance(state.amax_slot(Role.INPUT).amax, FakeTensor)
        assert isinstance(state.amax_slot(Role.INPUT).nonfinite, FakeTensor)


@pytest.mark.parametrize("granularity", ["tensor", "row", "tile", "block", "mx"])
def test_a_recording_cast_of_an_empty_tensor_records_nothing(granularity):
    """An empty batch cast per row or block has no amaxes: the cast records nothing and raises nothing."""
    from minifloat.numerics.quantize import quantize

    state = ScalingState(2)
    before = {k: v.clone() for k, v in state.state_dict().items()}
    q = quantize(torch.zeros(0, 64), E4M3, granularity=granularity, record=state.amax_slot(Role.INPUT))
    assert q.data.shape == (0, 64)
    assert all(torch.equal(v, before[k]) for k, v in state.state_dict().items())


def test_a_seeded_delayed_cast_launches_no_division():
    """The layer's delayed casts take the stored reciprocals: after the first cast of a step, no reciprocal kernel
    runs (two per cast before), and the FP8 bytes are those of a cast given 1 / s."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from minifloat.fp8.caster import LayerCaster
    from minifloat.numerics.quantize import quantize

    class Divisions(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith("reciprocal"):
                Divisions.count += 1
            return func(*args, **(kwargs or {}))

    caster = LayerCaster(DelayedScaling(), ScalingState(4))
    x = torch.randn(64, 48) * 3
    caster.cast(Role.INPUT, x)  # seeds
    with Divisions():
        q = caster.cast(Role.INPUT, x, keep_data=True)
        caster.cast(Role.INPUT, x * 2)
    assert Divisions.count == 2  # the pair, made once for the stored scales
    reference = quantize(x, E4M3, scale=1.0 / caster.state.scale[0])
    assert torch.equal(q.data.view(torch.uint8), reference.data.view(torch.uint8))
    assert _f32_bits(q.scale) == _f32_bits(reference.scale)


def test_a_multiplier_needs_its_scale():
    from minifloat.numerics.quantize import quantize

    with pytest.raises(ValueError, match="pass scale="):
        quantize(torch.ones(4, 4), E4M3, multiplier=torch.tensor(2.0))


def _filled_state(history_len: int, seed: int) -> ScalingState:
    g = torch.Generator().manual_seed(seed)
    state = ScalingState(history_len)
    state.amax_history.copy_(torch.rand(history_len, 3, generator=g) * 10.0 ** torch.randint(-3, 4, (1,), generator=g))
    state.amax_history[:, 2] *= (torch.rand(history_len, generator=g) > 0.5).float()  # zeros: keep the old scale
    state.scale.copy_(torch.rand(3, generator=g) * 100 + 1)
    return state


def test_advancing_many_states_at_once_is_advancing_each():
    """advance_states stacks layers that share a history length and a rule: every buffer comes out bit for bit as
    each state's own advance leaves it, for delayed (max and most-recent, margins, formats) and current recipes, a
    resize, and a group of one."""
    from minifloat.fp8.recipes import CurrentScaling
    from minifloat.fp8.scaling import advance_states

    recipes = [DelayedScaling(amax_history_len=4), DelayedScaling(amax_history_len=4),
               DelayedScaling(amax_history_len=4, margin=2), DelayedScaling(amax_history_len=4, format="e4m3"),
               DelayedScaling(amax_history_len=4, amax_compute="most_recent"),
               DelayedScaling(amax_history_len=4, amax_compute="most_recent"),
               DelayedScaling(amax_history_len=8),  # resized from 4
               DelayedScaling(amax_history_len=1), DelayedScaling(amax_history_len=1),
               CurrentScaling(), CurrentScaling(), CurrentScaling()]
    lengths = [4, 4, 4, 4, 4, 4, 4, 1, 1, 4, 4, 16]
    together = [_filled_state(n, seed) for seed, n in enumerate(lengths)]
    alone = [_filled_state(n, seed) for seed, n in enumerate(lengths)]
    for _ in range(3):
        advance_states(together, recipes)
        for state, recipe in zip(alone, recipes):
            advance_states([state], [recipe])  # a group of one: the state's own update and roll
        for a, b in zip(together, alone):
            for key, value in b.state_dict().items():
                assert torch.equal(a.state_dict()[key].view(torch.int32) if value.is_floating_point()
                                   else a.state_dict()[key], value.view(torch.int32) if value.is_floating_point()
                                   else value), key
            assert a.generation == b.generation
        for i, pair in enumerate(zip(together, alone)):
            for state in pair:
                state.amax_history[0] = torch.tensor([1.5, 0.0, 300.0]) * (i + 1)  # the next step's amaxes


def test_the_step_end_of_a_model_takes_a_fixed_number_of_launches():
    """Ending the FP8 step of 6 or of 24 delayed layers launches the same ops: the states advance together."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from minifloat.fp8.step import fp8_step

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += not func.__name__.startswith(("view", "select", "slice", "unbind", "alias", "detach"))
            return func(*args, **(kwargs or {}))

    counts = []
    for n in (6, 24):
        model = nn.Sequential(*[Fp8Linear(32, 32, recipe=DelayedScaling()) for _ in range(n)])
        model(torch.randn(4, 32)).sum().backward()
        with Ops() as ops:
            assert fp8_step(model) == n
        counts.append(ops.count)
        assert all(m.fp8_state.generation == 1 for m in model)
    assert counts[0] == counts[1] < 30


def test_delayed_cast_scales_follow_a_step_end_of_many_layers():
    """The batched step end writes the new scales with a multi-tensor copy: each state's reciprocals follow it."""
    from minifloat.fp8.scaling import advance_states

    states = [ScalingState(2) for _ in range(3)]
    for i, state in enumerate(states):
        state.delayed_cast_scales(0, lambda: torch.tensor(4.0), E4M3)  # seeds; its pair cached
        state.record(Role.INPUT, torch.tensor(3.0 + 2 * i))  # 3, 5, 7: none gives 448 / 4
    advance_states(states, [DelayedScaling(amax_history_len=2)] * 3)
    for state in states:
        d, m, _ = state.delayed_cast_scales(0, lambda: torch.tensor(1.0), E4M3)
        s = state.scale[0].clone()
        assert s.item() != 112.0
        assert (_f32_bits(d), _f32_bits(m)) == (_f32_bits(1.0 / s), _f32_bits(1.0 / (1.0 / s)))


@pytest.mark.parametrize("to", [torch.float16, torch.bfloat16], ids=["half", "bf16"])
def test_a_model_cast_to_low_precision_keeps_its_scaling_state_in_float32(to):
    # model.half() made an output gradient's scale of 5.7e7 inf (fp16's max is 65504): NaN gradients
    layer = Fp8Linear(32, 32)
    with torch.no_grad():
        layer.fp8_state.scale.copy_(torch.tensor([191.7, 3584.8, 57209832.0]))
    expected = layer.fp8_state.scale.clone()
    layer.to(to)
    assert layer.weight.dtype == to
    assert layer.fp8_state.scale.dtype == torch.float32 and torch.equal(layer.fp8_state.scale, expected)
    assert layer.fp8_state.amax_history.dtype == torch.float32
