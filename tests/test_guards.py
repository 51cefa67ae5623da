"""Tests for minifloat.safety.guards (non-finite guard, spike guard, rollback) and minifloat.safety.stability (embedding gradient
shrink, z-loss, per-group clipping, weight-decay groups).

Training runs use a small MLP converted to FP8 with DelayedScaling on every layer (keep_first_last=False), so FP8
scaling buffers exist and are touched by the forward/backward of a bad step. Batches are a pure function of their
data position (their own seeded generator), so which batch a step trains on is visible in the results.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math

import pytest
import torch
from torch import nn

import guard_traces
import minifloat as mf
from minifloat.safety.guards import GuardConfig, RollbackEvent, SkipReason, SpikeDetector, StepGuard
from minifloat.safety.stability import (
    GradNorms,
    ShrinkEmbeddingGrad,
    StabilityConfig,
    clip_grad_norms,
    param_groups,
    shrink_embedding_grad,
    z_loss,
)

SEED = 1234
D_IN, HIDDEN, D_OUT = 32, 64, 16  # multiples of 16, so convert() makes every layer FP8
BATCH = 32
LR = 3e-3
DROPOUT = 0.1  # makes the run depend on the global RNG, which rollback must restore

NONFINITE_STEPS = (5, 17)
NONFINITE_RUN_STEPS = 30
SPIKE_STEP = 60
SPIKE_FACTOR = 20.0
SPIKE_RUN_STEPS = 80
QUIET_RUN_STEPS = 300
# rollback scenario: snapshots every 5 steps, rollback after 3 bad steps in a row. Batches 12-14 are bad: step 14
# rolls back to the snapshot of step 10 and resumes at batch 15; batches 16-18 (steps 11-13 now) are bad too: a
# second rollback to the same snapshot (none is taken inside a streak or within 5 steps of the last), resuming at 19
SNAPSHOT_EVERY, ROLLBACK_AFTER = 5, 3
BAD_BATCHES = (12, 13, 14, 16, 17, 18)
SNAPSHOT_STEP = 10
RESUMES = (15, 19)
ROLLBACK_RUN_STEPS = 25
# shrink_embedding_grad's forward value x·α + x·(1−α) rounds twice in fp32: within a few ulps of x
SHRINK_FORWARD_RTOL = 4 * torch.finfo(torch.float32).eps


def make_model(seed: int = SEED, *, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Dropout(dropout), nn.Linear(HIDDEN, HIDDEN),
                          nn.ReLU(), nn.Linear(HIDDEN, D_OUT))
    return mf.convert(model, recipe=mf.DelayedScaling(), keep_first_last=False)


def get_batch(position: int, *, bad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED * 100_003 + position)
    x = torch.randn(BATCH, D_IN, generator=gen)
    y = torch.sin(x[:, :D_OUT]) + 0.1 * torch.randn(BATCH, D_OUT, generator=gen)  # a learnable target + noise
    if bad:
        x[0, 0] = float("nan")
    return x, y


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the training state, cloned: parameters, buffers (FP8 scaling state) and optimizer state."""
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in optimizer.state_dict()["state"].items():
        state.update({f"optim.{i}.{k}": torch.as_tensor(v).clone() for k, v in s.items()})
    return state


def assert_bitwise_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"changed: {differ}"


def run(model, guard, optimizer, steps, *, bad_batches=(), scheduler=None, on_step=None):
    """A nanoGPT-style loop under the guard; returns the StepReports."""
    reports, step, position = [], 0, 0
    while step < steps:
        if on_step is not None:
            on_step("begin", step, position)
        guard.begin_step(step, data_position=position)
        x, y = get_batch(position, bad=position in bad_batches)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if on_step is not None:
            on_step("backward", step, position)
        report = guard.check(loss)
        if not report.skipped:
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        reports.append(report)
        if on_step is not None:
            on_step("end", step, position)
        step, position = report.next_step, report.next_data_position
    return reports


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR)


# ---------------------------------------------------------------------------------------------- non-finite guard


def test_nonfinite_steps_skipped_with_state_bitwise_unchanged(caplog):
    model = make_model()
    optimizer = adamw(model)
    guard = StepGuard(model, optimizer, config=GuardConfig(spike_signals=()))
    before, touched = {}, {}

    def on_step(phase, step, position):
        if phase == "begin":
            before[step] = training_state(model, optimizer)
        elif phase == "backward" and step in NONFINITE_STEPS:
            # the subtlety the buffer snapshot exists for: the bad forward/backward already changed FP8 buffers
            now = {k: v.detach().clone() for k, v in model.named_buffers()}
            touched[step] = any(not torch.equal(now[k], before[step][f"model.{k}"]) for k in now)
        elif phase == "end" and step in NONFINITE_STEPS:
            assert_bitwise_equal(training_state(model, optimizer), before[step])

    with caplog.at_level(logging.WARNING, logger="minifloat"):
        reports = run(model, guard, optimizer, NONFINITE_RUN_STEPS, bad_batches=NONFINITE_STEPS, on_step=on_step)

    assert touched == {s: True for s in NONFINITE_STEPS}
    skipped = [r for r in reports if r.skipped]
    assert [r.step for r in skipped] == list(NONFINITE_STEPS)
    # the NaN reaches the first FP8 layer's input before it reaches the loss: the reason names the earlier place
    assert all(r.reason == SkipReason.NONFINITE_FP8_OPERAND for r in skipped)
    assert all(("0", "input") in r.nonfinite_operands for r in skipped)
    param_names = tuple(n for n, _ in model.named_parameters())
    assert all(r.bad_params == param_names for r in skipped)  # NaN input reaches every gradient
    assert guard.num_skipped == len(NONFINITE_STEPS)
    messages = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(messages) == len(NONFINITE_STEPS)
    assert all("nonfinite_fp8_operand" in m and "0 (input)" in m and "0.weight" in m and "5.bias" in m
               for m in messages)
    assert math.isfinite(reports[-1].loss) and not reports[-1].skipped
    assert reports[-1].loss < reports[0].loss  # the run kept training


def test_nonfinite_gradient_with_finite_loss_names_the_parameter():
    model = make_model()
    optimizer = adamw(model)
    guard = StepGuard(model, optimizer)
    guard.begin_step(0)
    x, y = get_batch(0)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    model[3].weight.grad[0, 0] = float("inf")
    report = guard.check(loss)
    assert report.skipped and report.reason == SkipReason.NONFINITE_GRAD
    assert report.bad_params == ("3.weight",)
    assert math.isfinite(report.loss) and math.isinf(report.grad_norm)


def test_unconditional_optimizer_step_after_a_skip_changes_nothing():
    model = make_model()
    optimizer = adamw(model)
    guard = StepGuard(model, optimizer)
    guard.begin_step(0)
    state = training_state(model, optimizer)
    x, y = get_batch(0, bad=True)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    assert guard.check(loss).skipped
    optimizer.step()  # a loop that forgot the `if`: the gradients were dropped, so nothing moves
    assert_bitwise_equal(training_state(model, optimizer), state)


def test_check_without_begin_step_raises():
    model = make_model()
    guard = StepGuard(model, adamw(model))
    with pytest.raises(RuntimeError, match="begin_step"):
        guard.check(torch.tensor(1.0))


# ---------------------------------------------------------------------------------------------- spike guard


RATIO, WINDOW, WARMUP = 5.0, 8, 5
# (name, accepted values, value judged, is a spike): the limit is RATIO × the window's median
DETECTOR_CASES = [
    ("warm-up", [1.0] * (WARMUP - 1), 1e9, False),
    ("just-above", [1.0, 3.0, 2.0, 1.0, 3.0], 10.0 + 1e-9, True),  # median 2, limit 10
    ("at-the-limit", [1.0, 3.0, 2.0, 1.0, 3.0], 10.0, False),
    ("even-count-median", [1.0, 3.0, 1.0, 3.0, 1.0, 3.0], 10.0 + 1e-9, True),  # median (1 + 3) / 2
    ("outlier-in-window", [1.0, 1.0, 1.0, 100.0, 1.0], 5.5, True),  # a median ignores the one large value
    ("old-values-leave", [100.0] * 3 + [1.0] * WINDOW, 5.5, True),  # the window holds the last WINDOW only
    ("median-zero", [0.0] * WARMUP, 1.0, False),  # a ratio to 0 means nothing
    ("median-negative", [-2.0] * WARMUP, 1.0, False),  # a loss that can be negative is not judged
    ("below", [1.0] * WARMUP, 0.01, False),
]


@pytest.mark.parametrize("window, value, spike", [c[1:] for c in DETECTOR_CASES], ids=[c[0] for c in DETECTOR_CASES])
def test_spike_detector_is_a_ratio_to_the_window_median(window, value, spike):
    det = SpikeDetector(RATIO, WINDOW, WARMUP)
    for v in window:
        det.accept(v)
    assert det.is_spike(value) is spike


BOTH = ("loss", "grad_norm")
# (name, spike_signals, how step SPIKE_STEP is spiked, factor, expected reason or None). "loss" multiplies the loss,
# and with it the gradients; "grad" multiplies the gradients after backward; "offset" adds to the loss only. (x100
# spikes: test_default_guard_skips_spikes_injected_into_recorded_healthy_runs)
SPIKE_CASES = [
    ("20x-loss-both", BOTH, "loss", SPIKE_FACTOR, SkipReason.LOSS_SPIKE),
    ("10x-loss-both", BOTH, "loss", 10.0, SkipReason.LOSS_SPIKE),
    ("10x-grad-both", BOTH, "grad", 10.0, SkipReason.GRAD_NORM_SPIKE),
    ("20x-loss-grad-norm-only", ("grad_norm",), "loss", SPIKE_FACTOR, SkipReason.GRAD_NORM_SPIKE),
    ("offset-loss-only", ("loss",), "offset", SPIKE_FACTOR, SkipReason.LOSS_SPIKE),
    ("offset-grad-norm-only", ("grad_norm",), "offset", SPIKE_FACTOR, None),  # a constant leaves the gradients alone
    ("3x-grad-both", BOTH, "grad", 3.0, None),  # within what healthy runs reach (GuardConfig.spike_ratio)
]


@pytest.mark.parametrize("signals, kind, factor, reason", [c[1:] for c in SPIKE_CASES],
                         ids=[c[0] for c in SPIKE_CASES])
def test_spike_guard_on_injected_spike(signals, kind, factor, reason):
    model = make_model()
    optimizer = adamw(model)
    guard = StepGuard(model, optimizer, config=GuardConfig(spike_signals=signals))
    reports = []
    for step in range(SPIKE_RUN_STEPS):
        guard.begin_step(step)
        x, y = get_batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        if step == SPIKE_STEP and kind != "grad":
            loss = loss * factor if kind == "loss" else loss + factor
        loss.backward()
        if step == SPIKE_STEP and kind == "grad":
            for p in model.parameters():
                p.grad *= factor
        reports.append(guard.check(loss))
        if not reports[-1].skipped:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    skipped = [(r.step, r.reason) for r in reports if r.skipped]
    assert skipped == ([(SPIKE_STEP, reason)] if reason else [])
    signal, detector = next(iter(guard.detectors.items()))
    applied = [getattr(r, signal.value) for r in reports if not r.skipped]
    assert list(detector.values) == applied[-GuardConfig().spike_window:]  # a skipped value never enters the window


def test_spike_guard_never_fires_on_a_normal_run():
    model = make_model()
    optimizer = adamw(model)
    guard = StepGuard(model, optimizer)
    reports = run(model, guard, optimizer, QUIET_RUN_STEPS)
    assert [r.step for r in reports if r.skipped] == []
    assert reports[-1].loss < reports[0].loss


def replay(loss: list[float], grad_norm: list[float], *, spikes: dict[int, tuple[str, float]] | None = None,
           config: GuardConfig | None = None) -> list:
    """A recorded run's loss and gradient norm, step by step, through StepGuard.check: a one-weight model whose gradient
    is set to the step's norm. spikes: step -> ("loss", factor) multiplies the loss and, as backward would, the
    gradient; ("grad", factor) the gradient only. Returns the StepReports."""
    model = nn.Linear(1, 1, bias=False)
    guard = StepGuard(model, torch.optim.SGD(model.parameters(), lr=0.0), config=config)
    reports = []
    for step, (value, norm) in enumerate(zip(loss, grad_norm)):
        kind, factor = (spikes or {}).get(step, ("", 1.0))
        guard.begin_step(step)
        model.weight.grad = torch.full((1, 1), norm * factor)
        reports.append(guard.check(torch.tensor(value * factor if kind == "loss" else value)))
    return reports


HEALTHY = guard_traces.load()
# from this step on every recorded run's level has settled enough for a 10x spike to clear 5x its window's median;
# in the first steps the gradient norm falls fast (2.5 to 0.7 by step 70 in the tiny runs), so a median of the last
# 32 values lags above it (a 10x spike at step 64 is 3.2x it), and only 100x spikes are injected there
INJECT_FROM = 100
INJECT_EVERY = 25  # a skipped value never enters the window, so the injected steps leave the others' verdicts alone
INJECTIONS = [("loss", 10.0), ("grad", 10.0), ("loss", 100.0), ("grad", 100.0)]
EARLY_INJECTIONS = {25: ("grad", 100.0), 50: ("loss", 100.0), 64: ("grad", 100.0), 75: ("loss", 100.0)}
INJECTED_REASON = {"loss": SkipReason.LOSS_SPIKE, "grad": SkipReason.GRAD_NORM_SPIKE}


@pytest.mark.parametrize("name", list(HEALTHY))
def test_default_guard_skips_nothing_on_recorded_healthy_runs(name):
    """bf16 and FP8 runs of `minifloat compare` and a 2000-step tiny bf16 run (tests/guard_traces.py); the spike rule
    before, mean + 6σ of 128 values, skipped step 272 in three of the compare runs and 6 steps of the 2000."""
    trace = HEALTHY[name]
    reports = replay(trace["loss"], trace["grad_norm"])
    assert [(r.step, r.reason.value) for r in reports if r.skipped] == []
    assert not any(r.level_shift for r in reports)


@pytest.mark.parametrize("name", list(HEALTHY))
def test_default_guard_skips_spikes_injected_into_recorded_healthy_runs(name):
    trace = HEALTHY[name]
    steps = range(INJECT_FROM, len(trace["loss"]), INJECT_EVERY)
    spikes = EARLY_INJECTIONS | {step: INJECTIONS[i % len(INJECTIONS)] for i, step in enumerate(steps)}
    reports = replay(trace["loss"], trace["grad_norm"], spikes=spikes)
    assert [(r.step, r.reason) for r in reports if r.skipped] == [(s, INJECTED_REASON[k]) for s, (k, _) in
                                                                 spikes.items()]


def test_spike_skip_message_says_what_was_seen_done_and_to_do(caplog):
    window = GuardConfig().spike_window
    with caplog.at_level(logging.WARNING, logger="minifloat"):
        reports = replay([2.0] * (window + 1), [1.0] * window + [15.1])
    assert reports[-1].reason == SkipReason.GRAD_NORM_SPIKE
    assert caplog.records[-1].getMessage() == (
        f"minifloat: step {window} skipped (grad_norm_spike): its gradient norm 15.1 is 15.1× the median 1 of the "
        f"last {window} applied steps, above the spike limit of 5× (GuardConfig.spike_ratio). The update was not "
        f"applied: weights, optimizer state and FP8 scaling state are as they were before the step. A rare skip is "
        f"harmless. If skips keep coming, lower the learning rate or look at the data of these steps.")


# (name, loss, gradient norm, the message's account of what was seen)
NONFINITE_MESSAGES = [
    ("nan-loss", math.nan, math.nan, "the loss is NaN; NaN or infinite gradients in weight"),
    ("inf-loss", math.inf, 1.0, "the loss is inf"),
    ("inf-grad", 2.0, math.inf, "the gradient norm is inf while the loss is 2; NaN or infinite gradients in weight"),
]


@pytest.mark.parametrize("loss, norm, seen", [c[1:] for c in NONFINITE_MESSAGES],
                         ids=[c[0] for c in NONFINITE_MESSAGES])
def test_nonfinite_skip_message(caplog, loss, norm, seen):
    with caplog.at_level(logging.WARNING, logger="minifloat"):
        replay([loss], [norm])
    step0 = "minifloat: step 0 skipped"
    message = caplog.records[-1].getMessage()
    assert message.startswith(step0) and f"): {seen}. The update was not applied" in message
    assert message.endswith("If this repeats, lower the learning rate or look for NaN or infinity in the data of "
                            "these steps; for FP8 see docs/fp8.md, \"Non-finite values\".")


@pytest.mark.slow
def test_default_guard_skips_nothing_in_a_2000_step_tiny_bf16_run(tmp_path):
    """`minifloat train --model tiny --preset bf16 --steps 2000` for real (minutes on 2 CPU cores): the spike rule
    before, mean + 6σ of 128 values, skipped 6 of its steps (559, 976, 1031, 1358, 1530, 1572)."""
    from minifloat.training.loop import TrainConfig, train

    result = train(TrainConfig(model="tiny", preset="bf16", steps=2000, checkpoint_every=0, out=str(tmp_path)),
                   progress=False)
    assert result.skipped == () and result.level_shifts == ()


LEVEL_SHIFT_STEP = 40  # from here on the loss is SPIKE_FACTOR times larger for good: a new level, not a spike
LEVEL_SHIFT_RUN_STEPS = 120
MAX_SKIPS = 3


def level_shift_run(config, steps=LEVEL_SHIFT_RUN_STEPS, guard=None, model=None, optimizer=None, start=0):
    model = model if model is not None else make_model()
    optimizer = optimizer if optimizer is not None else adamw(model)
    guard = guard if guard is not None else StepGuard(model, optimizer, config=config)
    reports, step = [], start
    while step < steps:
        guard.begin_step(step, data_position=step)
        x, y = get_batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        if step >= LEVEL_SHIFT_STEP:
            loss = loss * SPIKE_FACTOR
        loss.backward()
        reports.append(guard.check(loss))
        if not reports[-1].skipped:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step = reports[-1].next_step
    return reports, guard, model, optimizer


def test_sustained_rise_is_a_level_shift_not_an_endless_skip(caplog):
    config = GuardConfig(spike_signals=("loss",), spike_max_skips=MAX_SKIPS)
    with caplog.at_level(logging.WARNING, logger="minifloat"):
        reports, guard, _, _ = level_shift_run(config)
    skipped = [r.step for r in reports if r.skipped]
    assert skipped == list(range(LEVEL_SHIFT_STEP, LEVEL_SHIFT_STEP + MAX_SKIPS))
    shift = reports[LEVEL_SHIFT_STEP + MAX_SKIPS]
    assert shift.level_shift and not shift.skipped and shift.reason is None
    assert [r.step for r in reports if r.level_shift] == [LEVEL_SHIFT_STEP + MAX_SKIPS]
    assert guard.num_level_shifts == 1
    # the window restarted from the streak's values: it now holds only post-shift losses
    window = list(guard.detectors[next(iter(guard.detectors))].values)
    assert window == [r.loss for r in reports[LEVEL_SHIFT_STEP:]][-config.spike_window:]
    restarted = [r.getMessage() for r in caplog.records if "level shift" in r.getMessage()]
    assert len(restarted) == 1 and f"step {LEVEL_SHIFT_STEP + MAX_SKIPS} applied although its loss" in restarted[0]


def test_spike_max_skips_zero_skips_a_sustained_rise_forever():
    config = GuardConfig(spike_signals=("loss",), spike_max_skips=0)
    reports, guard, _, _ = level_shift_run(config)
    assert [r.step for r in reports if r.skipped] == list(range(LEVEL_SHIFT_STEP, LEVEL_SHIFT_RUN_STEPS))
    assert guard.num_level_shifts == 0


def test_rollback_acts_before_a_level_shift_when_it_counts_fewer_steps():
    config = GuardConfig(spike_signals=("loss",), spike_max_skips=MAX_SKIPS, rollback_after=2, snapshot_every=10,
                         max_rollbacks=1)
    with pytest.raises(RuntimeError, match="max_rollbacks=1"):
        level_shift_run(config)  # the replay after the rollback meets the same new level and rolls back again
    # with rollback_after > spike_max_skips the level shift comes first and no rollback happens
    config = dataclasses.replace(config, rollback_after=MAX_SKIPS + 2)
    reports, guard, _, _ = level_shift_run(config)
    assert guard.num_rollbacks == 0 and guard.num_level_shifts == 1


def test_spike_streak_survives_state_dict_mid_streak():
    config = GuardConfig(spike_signals=("loss",), spike_max_skips=MAX_SKIPS)
    want, _, _, _ = level_shift_run(config)
    mid = LEVEL_SHIFT_STEP + 2  # two spike skips into the streak
    first, guard, model, optimizer = level_shift_run(config, steps=mid)
    state = copy.deepcopy(guard.state_dict())
    assert len(state["spike_streak"]["loss"]) == 2
    resumed = StepGuard(model, optimizer, config=config)
    resumed.load_state_dict(state)
    rest, _, _, _ = level_shift_run(config, guard=resumed, model=model, optimizer=optimizer, start=mid)
    got = first + rest
    assert [(r.skipped, r.level_shift, r.loss) for r in got] == [(r.skipped, r.level_shift, r.loss) for r in want]


# ---------------------------------------------------------------------------------------------- rollback


def rollback_run(on_step=None):
    """The rollback scenario: snapshots at steps 0, 5, 10; batches 12, 13, 14 are bad, so step 14 rolls back."""
    model = make_model(dropout=DROPOUT)
    optimizer = adamw(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.99)
    config = GuardConfig(spike_signals=(), rollback_after=ROLLBACK_AFTER, snapshot_every=SNAPSHOT_EVERY)
    guard = StepGuard(model, optimizer, config=config, stateful={"scheduler": scheduler})
    reports = run(model, guard, optimizer, ROLLBACK_RUN_STEPS, bad_batches=BAD_BATCHES, scheduler=scheduler,
                  on_step=on_step and (lambda *a: on_step(*a, model, optimizer, scheduler)))
    return model, reports


def test_rollback_restores_the_snapshot_and_skips_the_bad_batches():
    visited, first_begin, checked = [], {}, []

    def on_step(phase, step, position, model, optimizer, scheduler):
        if phase != "begin":
            return
        visited.append((step, position))
        state = (training_state(model, optimizer), torch.get_rng_state(), scheduler.state_dict())
        if step not in first_begin:
            first_begin[step] = state
        elif step == SNAPSHOT_STEP:  # after each rollback, step 10 starts bitwise where it first started
            assert_bitwise_equal(state[0], first_begin[step][0])
            assert torch.equal(state[1], first_begin[step][1])
            assert state[2] == first_begin[step][2]
            checked.append(position)

    _, reports = rollback_run(on_step)
    assert checked == list(RESUMES)
    events = [r.rollback for r in reports if r.rollback]
    assert events == [RollbackEvent(SNAPSHOT_STEP, resume, resume - SNAPSHOT_STEP) for resume in RESUMES]
    assert [r.data_position for r in reports if r.skipped] == list(BAD_BATCHES)
    # the data position jumps past each streak's batches; the step goes back to the snapshot's
    first, second = RESUMES
    expected = ([(s, s) for s in range(first)]
                + [(SNAPSHOT_STEP + i, first + i) for i in range(second - first)]
                + [(s, s + second - SNAPSHOT_STEP) for s in range(SNAPSHOT_STEP, ROLLBACK_RUN_STEPS)])
    assert visited == expected


def test_rollback_runs_are_deterministic():
    first, second = rollback_run()[0], rollback_run()[0]
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name
    clean = make_model(dropout=DROPOUT)  # and the failures did change the run: the check could fail
    assert not torch.equal(first[0].weight, clean[0].weight)


def test_rollback_needs_a_data_position():
    model = make_model()
    guard = StepGuard(model, adamw(model), config=GuardConfig(rollback_after=2))
    with pytest.raises(ValueError, match="data_position"):
        guard.begin_step(0)


def test_rollback_gives_up_after_max_rollbacks():
    model = make_model()
    optimizer = adamw(model)
    config = GuardConfig(spike_signals=(), rollback_after=2, snapshot_every=1, max_rollbacks=1)
    guard = StepGuard(model, optimizer, config=config)
    everything_bad = range(3, 10_000)
    with pytest.raises(RuntimeError, match="max_rollbacks=1"):
        run(model, guard, optimizer, 100, bad_batches=everything_bad)
    assert guard.num_rollbacks == 1


def test_guard_state_dict_round_trip():
    model = make_model()
    optimizer = adamw(model)
    guard = StepGuard(model, optimizer)
    run(model, guard, optimizer, 25)
    other = StepGuard(model, optimizer)
    other.load_state_dict(copy.deepcopy(guard.state_dict()))
    assert other.state_dict() == guard.state_dict()
    assert len(other.detectors[next(iter(other.detectors))].values) == 25


# ---------------------------------------------------------------------------------------------- configuration

# (name, constructor, keyword arguments, field the message must name, value the message must show)
INVALID = [
    ("guard-ratio-one", GuardConfig, {"spike_ratio": 1.0}, "spike_ratio", "1.0"),
    ("guard-ratio-zero", GuardConfig, {"spike_ratio": 0}, "spike_ratio", "0"),
    ("guard-ratio-nan", GuardConfig, {"spike_ratio": float("nan")}, "spike_ratio", "nan"),
    ("guard-ratio-inf", GuardConfig, {"spike_ratio": float("inf")}, "spike_ratio", "inf"),
    ("guard-window-one", GuardConfig, {"spike_window": 1}, "spike_window", "1"),
    ("guard-window-float", GuardConfig, {"spike_window": 128.0}, "spike_window", "128.0"),
    ("guard-warmup-one", GuardConfig, {"spike_warmup": 1}, "spike_warmup", "1"),
    ("guard-warmup-above-window", GuardConfig, {"spike_window": 8, "spike_warmup": 9}, "spike_warmup", "9"),
    ("guard-signal-unknown", GuardConfig, {"spike_signals": ("lr",)}, "spike_signals", "'lr'"),
    ("guard-signals-list", GuardConfig, {"spike_signals": ["loss"]}, "spike_signals", "['loss']"),
    ("guard-max-skips-negative", GuardConfig, {"spike_max_skips": -1}, "spike_max_skips", "-1"),
    ("guard-rollback-negative", GuardConfig, {"rollback_after": -1}, "rollback_after", "-1"),
    ("guard-snapshot-zero", GuardConfig, {"snapshot_every": 0}, "snapshot_every", "0"),
    ("guard-snapshot-negative", GuardConfig, {"snapshot_every": -5}, "snapshot_every", "-5"),
    ("guard-extra-skip-negative", GuardConfig, {"rollback_extra_skip": -1}, "rollback_extra_skip", "-1"),
    ("guard-max-rollbacks-zero", GuardConfig, {"max_rollbacks": 0}, "max_rollbacks", "0"),
    ("guard-nonfinite-str", GuardConfig, {"skip_nonfinite": "yes"}, "skip_nonfinite", "'yes'"),
    ("stab-alpha-zero", StabilityConfig, {"embedding_grad_alpha": 0.0}, "alpha", "0.0"),
    ("stab-alpha-above-one", StabilityConfig, {"embedding_grad_alpha": 1.5}, "alpha", "1.5"),
    ("stab-z-negative", StabilityConfig, {"z_loss_coeff": -1e-4}, "z_loss_coeff", "-0.0001"),
    ("stab-clip-zero", StabilityConfig, {"max_grad_norm": 0.0}, "max_grad_norm", "0.0"),
    ("stab-emb-clip-negative", StabilityConfig, {"embedding_max_grad_norm": -1.0}, "embedding_max_grad_norm", "-1.0"),
    ("stab-wd-negative", StabilityConfig, {"weight_decay": -0.1}, "weight_decay", "-0.1"),
    ("stab-wd-inf", StabilityConfig, {"weight_decay": float("inf")}, "weight_decay", "inf"),
    ("shrink-alpha-zero", lambda **kw: shrink_embedding_grad(torch.ones(2), **kw), {"alpha": 0.0}, "alpha", "0.0"),
    ("shrink-alpha-negative", lambda **kw: shrink_embedding_grad(torch.ones(2), **kw), {"alpha": -0.1}, "alpha",
     "-0.1"),
    ("shrink-alpha-above-one", lambda **kw: ShrinkEmbeddingGrad(nn.Embedding(4, 2), **kw), {"alpha": 1.01},
     "alpha", "1.01"),
    ("z-loss-coeff-negative", lambda **kw: z_loss(torch.ones(2, 3), **kw), {"coeff": -1.0}, "coeff", "-1.0"),
    ("clip-max-norm-zero", lambda **kw: clip_grad_norms(nn.Linear(2, 2), **kw), {"max_norm": 0.0}, "max_norm",
     "0.0"),
    ("param-groups-wd-negative", lambda **kw: param_groups(nn.Linear(2, 2), **kw), {"weight_decay": -1.0},
     "weight_decay", "-1.0"),
]


@pytest.mark.parametrize("make, kwargs, field, shown", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_configuration_names_field_and_value(make, kwargs, field, shown):
    with pytest.raises(ValueError) as err:
        make(**kwargs)
    assert field in str(err.value) and shown in str(err.value)


def test_configs_are_frozen_and_derive_with_replace():
    config = GuardConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.spike_ratio = 3.0
    assert dataclasses.replace(config, spike_ratio=3.0).spike_ratio == 3.0
    assert (config.spike_ratio, config.spike_window, config.spike_warmup, config.spike_max_skips) == (5.0, 32, 20, 3)
    stab = StabilityConfig()
    assert (stab.embedding_grad_alpha, stab.z_loss_coeff, stab.weight_decay) == (0.1, 1e-4, 0.1)


# ---------------------------------------------------------------------------------------------- stability tricks


@pytest.mark.parametrize("alpha", [0.1, 0.5, 1.0], ids=["glm-0.1", "half", "off"])
def test_shrink_embedding_grad_scales_the_gradient_only(alpha):
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(4, 8, generator=gen, requires_grad=True)
    g = torch.randn(4, 8, generator=gen)
    out = shrink_embedding_grad(x, alpha)
    out.backward(g)
    torch.testing.assert_close(out, x.detach(), rtol=SHRINK_FORWARD_RTOL, atol=0.0)
    assert torch.equal(x.grad, g * alpha)


def test_shrink_embedding_module_shrinks_the_embedding_weight_gradient():
    torch.manual_seed(SEED)
    emb = nn.Embedding(10, 8)
    idx = torch.tensor([[1, 2, 2, 7]])
    emb(idx).sum().backward()
    plain = emb.weight.grad.clone()
    emb.weight.grad = None
    ShrinkEmbeddingGrad(emb, alpha=0.25)(idx).sum().backward()
    assert torch.equal(emb.weight.grad, plain * 0.25)


def test_z_loss_golden_and_fp32():
    vocab, coeff = 8, 1e-4
    uniform = torch.zeros(3, 5, vocab, dtype=torch.bfloat16)  # logsumexp = ln V everywhere
    got = z_loss(uniform, coeff)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(coeff * math.log(vocab) ** 2, rel=1e-6)
    gen = torch.Generator().manual_seed(SEED)
    logits = torch.randn(2, 3, 50, generator=gen) * 10
    ref = coeff * torch.logsumexp(logits.double(), -1).square().mean()
    assert z_loss(logits, coeff).item() == pytest.approx(ref.item(), rel=1e-6)


class TinyLM(nn.Module):
    """Embedding, norm, a biased projection and a head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.ln = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.wte.weight  # tied

    def forward(self, idx):
        return self.head(self.proj(self.ln(self.wte(idx))))


def test_param_groups_exclude_norms_and_biases():
    model = TinyLM()
    groups = param_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    got = {g["name"]: ([names[id(p)] for p in g["params"]], g["weight_decay"]) for g in groups}
    assert got == {"decay": (["proj.weight"], 0.1), "no_decay": (["ln.weight", "ln.bias", "proj.bias"], 0.0),
                   "embedding": (["wte.weight"], 0.1)}
    no_emb_decay = {g["name"]: g["weight_decay"] for g in param_groups(model, 0.05, decay_embeddings=False)}
    assert no_emb_decay == {"decay": 0.05, "no_decay": 0.0, "embedding": 0.0}
    optimizer = torch.optim.AdamW(groups, lr=LR)  # AdamW accepts them as they are
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0, 0.1]


# (name, embedding gradient norm, other gradient norm)
EMB_NORM, REST_NORM = 10.0, 3.0


def grads_of_known_norm(model: TinyLM) -> None:
    """Gradients with L2 norm EMB_NORM on the embedding and REST_NORM over the other parameters."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    model.wte.weight.grad[0, 0] = EMB_NORM
    model.proj.weight.grad[0, 0] = REST_NORM


@pytest.mark.parametrize("source", ["model", "param-groups"])
def test_clip_grad_norms_separate_embedding_limit(source):
    model = TinyLM()
    grads_of_known_norm(model)
    target = model if source == "model" else param_groups(model)
    norms = clip_grad_norms(target, 1.0, embedding_max_norm=5.0)
    assert isinstance(norms, GradNorms)
    assert (norms.embedding.item(), norms.rest.item()) == pytest.approx((EMB_NORM, REST_NORM))
    assert norms.total.item() == pytest.approx(math.hypot(EMB_NORM, REST_NORM))
    assert model.wte.weight.grad.norm().item() == pytest.approx(5.0, rel=1e-5)
    assert model.proj.weight.grad.norm().item() == pytest.approx(1.0, rel=1e-5)


def test_clip_grad_norms_joint_and_config_method():
    model = TinyLM()
    grads_of_known_norm(model)
    norms = StabilityConfig(max_grad_norm=2.0).clip_grad_norms(model)
    assert norms.total.item() == pytest.approx(math.hypot(EMB_NORM, REST_NORM))
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert clipped.item() == pytest.approx(2.0, rel=1e-5)
    # the ratio between embedding and rest is kept when clipping jointly
    assert (model.wte.weight.grad.norm() / model.proj.weight.grad.norm()).item() == pytest.approx(EMB_NORM / REST_NORM)
