"""One source of truth for a run's settings (issue 22): every TrainConfig field is a `setting` whose metadata makes
its `minifloat train` flag, help and resume rule; the flags of earlier releases parse to the same config; and
`TrainConfig.resuming` gives a library user the CLI's resume rules."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from minifloat.cli import build_parser
from minifloat.cli.train import train_config
from minifloat.training.config import (GROUPS, NOT_INHERITED, RESUME_ABSENT, RESUME_FIXED, RESUMES, SETTINGS,
                                       TrainConfig, config_from)
from minifloat.training.loop import train

TINY = dict(model="tiny", batch_size=4, seq_len=32, warmup=2, eval_every=3, eval_batches=1, max_bytes=100_000)


def _train_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def _parse(argv: list[str]) -> TrainConfig:
    return train_config(build_parser().parse_args(["train", *argv]))


def test_every_setting_has_one_definition_and_one_flag():
    """A walk over the config and the parser: each field is a setting with help, a known group and resume rule, and
    exactly one flag, and each flag of `minifloat train` is a field's."""
    flags = {}
    for action in _train_parser()._actions:
        for option in action.option_strings:
            if option not in ("-h", "--help"):
                flags[option] = action.dest
    assert sorted(flags.values()) == sorted(SETTINGS), "a flag without a setting, or a setting without a flag"
    assert len(set(flags.values())) == len(flags)  # one flag each
    for name, field in SETTINGS.items():
        meta = field.metadata
        assert meta["help"] and meta["group"] in GROUPS and meta["resume"] in RESUMES, name
        assert flags["--" + name.replace("_", "-")] == name
    # the resume tables are derived from the settings, not written out again
    assert {n for n, _ in RESUME_FIXED} == {n for n, f in SETTINGS.items() if f.metadata["resume"] == "fixed"}
    assert set(RESUME_ABSENT) <= {n for n, _ in RESUME_FIXED}
    assert set(NOT_INHERITED) == {"out", "resume", "overwrite", "device", "compile", "compile_mode", "lr_decay_steps"}


def test_help_shows_each_default_from_the_config():
    text = _train_parser().format_help()
    for name in ("steps", "batch_size", "eval_every", "snapshot_every"):
        assert f"(default {SETTINGS[name].default})" in " ".join(text.split()), name


# flags as earlier releases took them, and the config each stands for
OLD_FLAGS = [
    ([], TrainConfig()),
    (["--model", "10m", "--preset", "fp8-delayed", "--steps", "50", "--batch-size", "8", "--seq-len", "128"],
     TrainConfig(model="10m", preset="fp8-delayed", steps=50, batch_size=8, seq_len=128)),
    (["--lr", "0.002"], TrainConfig(lr=0.002, min_lr=0.0002)),  # --lr alone moves the floor
    (["--preset", "fp8-delayed", "--fp8-format", "e4m3", "--fp8-margin", "1", "--fp8-amax-history-len", "4"],
     TrainConfig(preset="fp8-delayed", fp8_format="e4m3", fp8_margin=1, fp8_amax_history_len=4)),
    (["--preset", "nvfp4", "--nvfp4-rht", "off", "--nvfp4-weight-2d", "on"],
     TrainConfig(preset="nvfp4", nvfp4_rht=False, nvfp4_weight_2d=True)),
    (["--nan-steps", "3,7", "--rollback-after", "2", "--snapshot-every", "5", "--shadow-every", "0"],
     TrainConfig(nan_steps=(3, 7), rollback_after=2, snapshot_every=5)),
    (["--optimizer-state", "e4m3,bf16", "--master", "bf16-sr", "--grad-accum", "2", "--compile", "--overwrite",
      "--device", "cpu", "--out", "runs/x", "--data", "corpus", "--max-bytes", "5000", "--eval-every", "7",
      "--eval-batches", "2", "--checkpoint-every", "0", "--warmup", "3", "--lr-decay-steps", "40", "--seed", "4"],
     TrainConfig(optimizer_state="e4m3,bf16", master="bf16-sr", grad_accum=2, compile=True, overwrite=True,
                 device="cpu", out="runs/x", data="corpus", max_bytes=5000, eval_every=7, eval_batches=2,
                 checkpoint_every=0, warmup=3, lr_decay_steps=40, seed=4)),
    (["--preset", "fp8-delayed", "--keep-blocks", "0,0.15", "--bf16-tail", "0.1", "--embedding-grad-alpha", "0.1"],
     TrainConfig(preset="fp8-delayed", keep_blocks="0,0.15", bf16_tail=0.1, embedding_grad_alpha=0.1)),
]


@pytest.mark.parametrize("argv, expected", OLD_FLAGS, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_old_flags_parse_to_the_same_config(argv, expected):
    assert _parse(argv) == expected


def test_config_from_names_an_unknown_setting():
    with pytest.raises(ValueError, match="unknown TrainConfig settings \\['batchsize'\\]"):
        config_from({"batchsize": 4})


def test_resume_rules_hold_for_a_library_user(tmp_path):
    """`TrainConfig.resuming` builds what `minifloat train --resume` builds: the checkpoint's settings (a batch
    shape, an eval cadence) for everything not given, the "fresh" ones (device, ...) from the defaults; train()
    continues with it, and a changed fixed setting is refused with the flag to fix it."""
    out = str(tmp_path / "run")
    first = TrainConfig(**TINY, steps=4, checkpoint_every=4, device="cpu", out=out)
    train(first, progress=False)

    resumed = TrainConfig.resuming(out, steps=6)
    assert resumed == dataclasses.replace(first, steps=6, resume=True, device="auto")
    assert resumed == _parse(["--out", out, "--resume", "--steps", "6"])  # the CLI's rules are the library's
    result = train(resumed, progress=False)
    assert result.first_step == 4 and result.last_step == 6

    with pytest.raises(ValueError, match="--seed 0, this run asks for 1"):
        train(TrainConfig.resuming(out, steps=8, seed=1), progress=False)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        TrainConfig.resuming(str(tmp_path / "nothing"), steps=8)


def test_typed_forms_of_the_comma_settings():
    """keep_blocks and optimizer_state take tuples too, and mean what their flag spellings mean."""
    typed = TrainConfig(preset="fp8-delayed", keep_blocks=(0, 0.15), optimizer_state=("e4m3", "bf16"))
    assert typed == TrainConfig(preset="fp8-delayed", keep_blocks="0,0.15", optimizer_state="e4m3,bf16")
    assert typed.blocks_kept == (0, 0.15) and typed.state_formats == ("e4m3", "bf16")
    with pytest.raises(ValueError, match="optimizer_state must be two formats"):
        TrainConfig(optimizer_state=("e4m3",))


def test_compile_mode_reaches_torch_compile(tmp_path, monkeypatch):
    """--compile-mode reduce-overhead (CUDA graphs, for small steps) is the mode the trainer compiles its model in."""
    from minifloat.training import loop

    seen = []
    monkeypatch.setattr(loop.torch, "compile", lambda module, **options: seen.append(options) or module)
    config = _parse(["--compile", "--compile-mode", "reduce-overhead", "--steps", "1", "--out", str(tmp_path / "r"),
                     "--model", "tiny", "--batch-size", "2", "--seq-len", "16", "--max-bytes", "50000"])
    assert config.compile_mode == "reduce-overhead"
    train(config, progress=False)
    assert seen == [{"mode": "reduce-overhead"}]
