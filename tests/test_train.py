"""minifloat.training.loop: the training loop, its log, bitwise resume, the guards under injected NaNs, rollback, the shadow
check's BF16 fallback, the embedding gradient shrink, and `minifloat train`."""

from __future__ import annotations

import csv
import dataclasses
import math
import pathlib

import pytest
import torch

from minifloat.safety import stability
from minifloat.cli import main
from minifloat.training.loop import LOG_FIELDS, TrainConfig, get_lr, train

SMALL = dict(model="tiny", steps=12, batch_size=8, seq_len=32, warmup=2, eval_every=6, eval_batches=2,
             max_bytes=100_000, checkpoint_every=0)
# every check is unhealthy: FP8 and BF16 losses of the tiny model differ by ~1e-4 relative, never by less than 1e-9
ALWAYS_UNHEALTHY = 1e-9
NEVER_UNHEALTHY = 1.0  # a 100% loss difference; FP8 of the tiny model stays within ~1e-3
PATIENCE = 3  # ShadowConfig().patience, the unhealthy checks in a row that switch to BF16


@pytest.fixture
def config(tmp_path) -> TrainConfig:
    return TrainConfig(**SMALL, seed=0, out=str(tmp_path / "run"))


def _rows(out: str) -> list[dict]:
    with open(f"{out}/log.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("preset", ["bf16", "fp8-delayed"])
def test_loss_decreases(config, preset):
    result = train(dataclasses.replace(config, preset=preset), progress=False)
    assert len(result.losses) == config.steps and result.skipped == ()
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert last < first - 0.5, (first, last)  # bytes start at ln 256 ≈ 5.5 nats
    assert [s for s, _ in result.val_losses] == [6, 12]
    assert result.val_losses[1][1] < result.val_losses[0][1]
    assert result.tokens_per_s > 0


def test_log_has_one_row_per_step(config):
    train(config, progress=False)
    rows = _rows(config.out)
    assert tuple(rows[0]) == LOG_FIELDS
    assert [int(r["step"]) for r in rows] == list(range(config.steps))
    assert {r["mode"] for r in rows} == {""}  # bf16 has no FP8 recipe, so no mode


def test_tensorboard_gets_the_logged_scalars(config):
    pytest.importorskip("tensorboard", reason="tensorboard is optional (in the dev extra)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = train(config, progress=False)
    events = EventAccumulator(str(pathlib.Path(config.out) / "tensorboard"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(config.steps))
    assert [e.value for e in loss] == pytest.approx(list(result.losses), rel=1e-6)  # stored as float32
    val = events.Scalars("val/loss")
    assert [e.step for e in val] == [step for step, _ in result.val_losses]
    assert [e.value for e in val] == pytest.approx([v for _, v in result.val_losses], rel=1e-6)
    for tag in ("train/lr", "train/grad_norm", "train/tokens_per_s"):
        assert len(events.Scalars(tag)) == config.steps


def test_level_shift_is_reported(config, monkeypatch):
    """A loss that jumps to a new level for good: 3 spike skips (GuardConfig.spike_max_skips), then applied."""
    from minifloat.training.model import Llama

    jump_at, factor = 30, 20.0  # after the spike window's 20-value warm-up
    calls = {"n": 0}
    forward = Llama.forward

    def jumping(self, idx, targets=None):
        logits, loss = forward(self, idx, targets)
        if self.training:
            calls["n"] += 1
            if calls["n"] > jump_at:
                loss = loss * factor
        return logits, loss

    monkeypatch.setattr(Llama, "forward", jumping)
    config = dataclasses.replace(config, steps=40, eval_every=40)
    result = train(config, progress=False)
    assert [s for s, _ in result.skipped] == [jump_at, jump_at + 1, jump_at + 2]
    assert result.level_shifts == (jump_at + 3,)
    assert all(math.isfinite(v) for v in result.losses)


def test_resume_is_bitwise(tmp_path):
    n = 6
    whole = train(TrainConfig(**{**SMALL, "steps": 2 * n}, preset="fp8-delayed", out=str(tmp_path / "a")),
                  progress=False)
    # the first half follows the 2n-step schedule (lr_decay_steps), as a run cut short would
    half = TrainConfig(**{**SMALL, "steps": n, "checkpoint_every": n}, lr_decay_steps=2 * n, preset="fp8-delayed",
                       out=str(tmp_path / "b"))
    first = train(half, progress=False)
    second = train(dataclasses.replace(half, steps=2 * n, lr_decay_steps=None, resume=True), progress=False)
    assert second.first_step == n
    assert first.losses + second.losses == whole.losses  # float equality, step by step
    assert second.val_losses[-1] == whole.val_losses[-1]
    assert [int(r["step"]) for r in _rows(half.out)] == list(range(2 * n))


def test_resume_is_bitwise_with_shadow_check(tmp_path):
    # checks at 0, 3 (first half) and 6 (second half): the fallback at 6 needs the unhealthy streak from the checkpoint
    n, shadow = 6, dict(preset="fp8-delayed", shadow_every=3, shadow_threshold=ALWAYS_UNHEALTHY)
    whole = train(TrainConfig(**{**SMALL, "steps": 2 * n}, **shadow, out=str(tmp_path / "a")), progress=False)
    half = TrainConfig(**{**SMALL, "steps": n, "checkpoint_every": n}, lr_decay_steps=2 * n, **shadow,
                       out=str(tmp_path / "b"))
    first = train(half, progress=False)
    second = train(dataclasses.replace(half, steps=2 * n, lr_decay_steps=None, resume=True), progress=False)
    assert [s for s, _ in whole.fallbacks] == [6] and first.fallbacks == ()
    assert second.fallbacks == whole.fallbacks
    assert first.losses + second.losses == whole.losses  # float equality, step by step
    assert [r["mode"] for r in _rows(half.out)] == ["fp8"] * n + ["bf16"] * n


def test_resume_without_checkpoint_raises(config):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(dataclasses.replace(config, resume=True), progress=False)


def test_resuming_a_run_that_saved_no_checkpoint_says_to_start_it_again(config):
    """A run trained with checkpoint_every 0 cannot be resumed, and starting it without resume is refused (the folder
    holds a run): the message names the way out, --overwrite."""
    train(dataclasses.replace(config, steps=2, checkpoint_every=0), progress=False)
    with pytest.raises(FileNotFoundError, match="holds a run .* but no checkpoint.*overwrite"):
        train(dataclasses.replace(config, steps=3, resume=True), progress=False)


def test_nan_steps_are_skipped(config):
    result = train(dataclasses.replace(config, nan_steps=(3, 7)), progress=False)
    assert result.skipped == ((3, "nonfinite_loss"), (7, "nonfinite_loss"))
    assert math.isnan(result.losses[3]) and math.isfinite(result.final_loss)
    assert result.final_loss < result.losses[0]
    rows = _rows(config.out)
    assert [(r["skipped"], r["reason"]) for r in rows[3:4]] == [("1", "nonfinite_loss")]


def test_shadow_check_falls_back_to_bf16(config):
    result = train(dataclasses.replace(config, preset="fp8-delayed", shadow_every=2,
                                       shadow_threshold=ALWAYS_UNHEALTHY), progress=False)
    switch = 2 * (PATIENCE - 1)  # checks at 0, 2, 4: the third unhealthy one switches
    assert [s for s, _ in result.fallbacks] == [switch]
    assert "relative loss difference" in result.fallbacks[0][1]
    assert result.shadow_events == ((switch, "bf16", result.fallbacks[0][1]),)
    assert [r["mode"] for r in _rows(config.out)] == ["fp8"] * switch + ["bf16"] * (config.steps - switch)
    assert math.isfinite(result.final_loss) and result.final_loss < result.losses[0]


def test_healthy_shadow_check_changes_nothing(config):
    fp8 = dataclasses.replace(config, preset="fp8-delayed", steps=6, eval_every=3)
    plain = train(fp8, progress=False)
    shadow = dataclasses.replace(fp8, shadow_every=1, shadow_threshold=NEVER_UNHEALTHY, out=config.out + "-shadow")
    checked = train(shadow, progress=False)
    assert checked.fallbacks == () and checked.shadow_events == ()
    assert checked.losses == plain.losses and checked.val_losses == plain.val_losses  # the check leaves no trace
    assert {r["mode"] for r in _rows(shadow.out)} == {"fp8"}


def test_rollback_after_a_streak_of_bad_steps(config):
    # snapshots at steps 0 and 4; batches 5 and 6 poisoned: the skip at step 6 is the second in a row
    result = train(dataclasses.replace(config, nan_steps=(5, 6), rollback_after=2, snapshot_every=4),
                   progress=False)
    assert result.skipped == ((5, "nonfinite_loss"), (6, "nonfinite_loss"))
    assert result.rollbacks == ((6, 4, 3),)  # back to step 4, batches 4..6 never trained on
    rows = _rows(config.out)
    assert [int(r["step"]) for r in rows] == list(range(7)) + list(range(4, config.steps))
    assert len(result.losses) == len(rows) and math.isfinite(result.final_loss)
    assert result.final_loss < result.losses[0]
    assert result.val_losses[-1][0] == config.steps


def test_embedding_grad_alpha_shrinks_the_embedding_gradient(config, monkeypatch):
    alpha, grads = 0.1, {}
    library = stability.shrink_embedding_grad

    def spy(x, a):
        out = library(x, a)
        if not grads:  # the first step's embedding output (B, T, C)
            out.register_hook(lambda g: grads.setdefault("out", g))
            x.register_hook(lambda g: grads.setdefault("in", g))
        return out

    monkeypatch.setattr(stability, "shrink_embedding_grad", spy)
    shrunk = train(dataclasses.replace(config, steps=2, embedding_grad_alpha=alpha), progress=False)
    assert set(grads) == {"in", "out"}, "train did not shrink through minifloat.safety.stability"
    torch.testing.assert_close(grads["in"], grads["out"] * alpha, rtol=0, atol=0)
    plain = train(dataclasses.replace(config, steps=2, out=config.out + "-plain"), progress=False)
    assert shrunk.losses[0] == plain.losses[0] and shrunk.losses[1] != plain.losses[1]  # same start, other update


def test_lr_schedule(config):
    lrs = [get_lr(s, config) for s in range(config.steps + 2)]
    assert lrs[0] < lrs[1] < lrs[config.warmup] == pytest.approx(config.lr)
    assert lrs[config.steps] == config.min_lr and min(lrs) == config.min_lr


@pytest.mark.parametrize("name, overrides, field", [
    ("unknown model", {"model": "huge"}, "model"),
    ("unknown preset", {"preset": "fp7"}, "preset"),
    ("zero steps", {"steps": 0}, "steps"),
    ("seq_len past max_seq_len", {"seq_len": 4096}, "seq_len"),
    ("min_lr above lr", {"min_lr": 1.0}, "min_lr"),
    ("negative grad_clip", {"grad_clip": -1.0}, "grad_clip"),
    ("nan_steps not a tuple", {"nan_steps": [3]}, "nan_steps"),
    ("fp8 override on bf16", {"fp8_margin": 1}, "fp8_margin"),
    ("bad fp8 format", {"preset": "fp8-delayed", "fp8_format": "e5m2"}, "fp8_format"),
    ("bad amax history", {"preset": "fp8-delayed", "fp8_amax_history_len": 0}, "fp8_amax_history_len"),
    ("shadow check without FP8", {"preset": "bf16", "shadow_every": 10}, "shadow_every"),
    ("negative shadow_every", {"preset": "fp8-delayed", "shadow_every": -1}, "shadow_every"),
    ("zero shadow_threshold", {"shadow_threshold": 0.0}, "shadow_threshold"),
    ("nan shadow_threshold", {"shadow_threshold": math.nan}, "shadow_threshold"),
    ("negative rollback_after", {"rollback_after": -1}, "rollback_after"),
    ("zero snapshot_every", {"snapshot_every": 0}, "snapshot_every"),
    ("zero embedding_grad_alpha", {"embedding_grad_alpha": 0.0}, "embedding_grad_alpha"),
    ("embedding_grad_alpha above 1", {"embedding_grad_alpha": 1.5}, "embedding_grad_alpha"),
])
def test_config_rejects(name, overrides, field):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**overrides)


def test_fp8_overrides_replace_the_recipe():
    policy = TrainConfig(preset="fp8-delayed", fp8_format="e4m3", fp8_margin=2, fp8_amax_history_len=4).policy()
    assert (policy.recipe.format, policy.recipe.margin, policy.recipe.amax_history_len) == ("e4m3", 2, 4)


def test_cli_train_writes_log(tmp_path):
    out = tmp_path / "cli"
    assert main(["train", "--steps", "4", "--batch-size", "4", "--seq-len", "32", "--eval-every", "2",
                 "--checkpoint-every", "2", "--preset", "fp8-delayed", "--fp8-margin", "1", "--out", str(out)]) == 0
    assert len(_rows(str(out))) == 4
    assert (out / "ckpt" / "manifest.json").is_file()
    assert main(["train", "--steps", "6", "--batch-size", "4", "--seq-len", "32", "--eval-every", "2",
                 "--checkpoint-every", "2", "--preset", "fp8-delayed", "--fp8-margin", "1", "--out", str(out),
                 "--resume"]) == 0
    assert len(_rows(str(out))) == 6


@pytest.mark.parametrize("argv", [
    ["--fp8-margin", "1"],  # bf16 has no delayed recipe
    ["--preset", "fp7"],
    ["--steps", "0"],
])
def test_cli_train_rejects_bad_flags(argv, tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("minifloat: error:") and err.count("\n") == 1 and "Traceback" not in err


def test_sdpa_attention_trains(config):
    """attention="sdpa" (scaled_dot_product_attention, what "auto" picks on a GPU), run on the CPU: the loss falls as
    with the fp32 path."""
    result = train(dataclasses.replace(config, attention="sdpa", preset="bf16"), progress=False)
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert last < first - 0.5, (first, last)


def test_the_progress_bars_tok_s_is_the_runs_not_the_last_steps():
    # the bar showed the last step's own rate, which on a busy machine reversed compare's ranking against its table
    import types

    from minifloat.training.loop import _Loop

    config = TrainConfig(**SMALL)
    loop = object.__new__(_Loop)
    loop.run = types.SimpleNamespace(config=config, world=types.SimpleNamespace(data_size=1))
    tokens = config.batch_size * config.seq_len
    loop.times = [5.0]
    assert loop.tokens_per_s() == tokens / 5.0  # one step: its own
    loop.times = [5.0, 1.0, 3.0, 0.1]  # the first step (warm-up) left out, the rest together
    assert loop.tokens_per_s() == pytest.approx(3 * tokens / 4.1)


def test_an_evaluation_casts_each_weight_once_with_the_same_loss(config, monkeypatch):
    # an evaluation's batches cast every FP8 weight afresh unless told the weights do not change between them
    # (minifloat.fp8.modules.reuse_weight_casts): the trainer's evaluation casts each once, for the same loss
    import contextlib

    from minifloat.fp8 import caster as fp8_caster
    from minifloat.fp8.modules import Fp8Linear
    from minifloat.fp8.recipes import Role
    from minifloat.training import run as training_run

    config = dataclasses.replace(config, preset="fp8-delayed", eval_batches=3)
    built = training_run.build(config)
    tokens = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(0))
    casts = []
    real = fp8_caster.LayerCaster.cast
    monkeypatch.setattr(fp8_caster.LayerCaster, "cast",
                        lambda self, role, *a, **k: (role is Role.WEIGHT and casts.append(1))
                        or real(self, role, *a, **k))
    once = training_run.evaluate(built.model, tokens, built.policy, config)
    layers = sum(isinstance(m, Fp8Linear) for m in built.model.modules())
    assert layers > 0 and len(casts) == layers
    casts.clear()
    monkeypatch.setattr(training_run, "reuse_weight_casts", contextlib.nullcontext)
    assert training_run.evaluate(built.model, tokens, built.policy, config) == once
    assert len(casts) == 3 * layers
