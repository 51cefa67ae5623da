"""One source of truth for a run's settings (issue 22): every TrainConfig field is a `setting` whose metadata makes
its `minifloat train` flag, help and resume rule; the flags of earlier releases parse to the same config; and
`TrainConfig.resuming` gives a library user the CLI's resume rules."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from minifloat.cli import build_parser
from minifloat.cli.common import CliError
from minifloat.cli.train import train_config
from minifloat.training.config import (GROUP_CLASSES, GROUPS, NOT_INHERITED, RESUME_ABSENT, RESUME_FIXED, RESUMES,
                                       SETTINGS, TrainConfig, config_from)
from minifloat.training.loop import CHECKPOINT_DIR, train
from minifloat.training.precision import Precision
from minifloat.training.settings import ModelData, OptimizerSettings, Parallelism, RunSettings, SafetyNets
from minifloat.training.sharded import read_extra

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
    walked = {(attr, f.name): f for attr, cls in GROUP_CLASSES.items() for f in dataclasses.fields(cls)}
    assert [name for _, name in walked] == list(SETTINGS), "a setting defined twice, or outside the groups"
    assert [cls.GROUP for cls in GROUP_CLASSES.values()] == list(GROUPS)
    assert not set(GROUP_CLASSES) & set(SETTINGS)  # `config.precision` and `config.lr` never clash
    for (attr, name), field in walked.items():  # a setting's group is its class's
        assert field.metadata["group"] == GROUP_CLASSES[attr].GROUP, name
    for name, field in SETTINGS.items():
        meta = field.metadata
        assert meta["help"] and meta["group"] in GROUPS and meta["resume"] in RESUMES, name
        assert flags["--" + name.replace("_", "-")] == name
    # the resume tables are derived from the settings, not written out again
    assert {n for n, _ in RESUME_FIXED} == {n for n, f in SETTINGS.items() if f.metadata["resume"] == "fixed"}
    assert set(RESUME_ABSENT) <= {n for n, _ in RESUME_FIXED}
    assert set(NOT_INHERITED) == {"out", "resume", "overwrite", "device", "compile", "compile_mode", "compile_scope",
                                  "tf32", "lr_decay_steps"}


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
    assert config.compile_mode == "reduce-overhead" and config.compile_scope == "blocks"
    train(config, progress=False)
    assert seen == [{"mode": "reduce-overhead"}] * 2  # each of the tiny Llama's two blocks (--compile-scope blocks)
    seen.clear()
    train(dataclasses.replace(config, compile_scope="model", out=str(tmp_path / "whole")), progress=False)
    assert seen == [{"mode": "reduce-overhead"}]


@pytest.mark.parametrize("flag, expected", [([], "tf32"), (["--tf32", "on"], "tf32"), (["--tf32", "off"], "ieee")])
def test_tf32_sets_cuda_fp32_matmuls_for_the_steps(tmp_path, monkeypatch, flag, expected):
    """--tf32 (on by default) is the precision CUDA's float32 matmuls run in while the steps run, and only then: the
    knob is read inside a training forward and is as it was after train() returns."""
    from minifloat.training.model import Llama

    knob = torch.backends.cuda.matmul
    before = knob.fp32_precision
    seen = []
    real = Llama.forward
    monkeypatch.setattr(Llama, "forward", lambda self, *a, **k: seen.append(knob.fp32_precision) or real(self, *a, **k))
    config = _parse([*flag, "--steps", "1", "--out", str(tmp_path / "r"), "--model", "tiny", "--batch-size", "2",
                     "--seq-len", "16", "--max-bytes", "50000"])
    assert config.tf32 is (expected == "tf32")
    train(config, progress=False)
    assert seen and set(seen) == {expected}
    assert knob.fp32_precision == before


def test_cuda_fp32_matmuls_restores_the_knob_and_refuses_other_precisions():
    from minifloat.core.autocast import cuda_fp32_matmuls

    knob = torch.backends.cuda.matmul
    before = knob.fp32_precision
    with cuda_fp32_matmuls("ieee"):
        assert knob.fp32_precision == "ieee"
        with cuda_fp32_matmuls("tf32"):
            assert knob.fp32_precision == "tf32"
        assert knob.fp32_precision == "ieee"
    assert knob.fp32_precision == before
    with pytest.raises(ValueError, match="precision must be one of"):
        with cuda_fp32_matmuls("high"):
            pass
    with pytest.raises(CliError, match="--tf32 must be on or off"):
        _parse(["--tf32", "maybe"])


# ---- the groups ---------------------------------------------------------------------------------------------------

# (name, group, fields, words of the error): each group checks its own fields when built, naming the field
BAD_GROUPS = [
    ("unknown model", ModelData, dict(model="huge"), ["model", "'huge'"]),
    ("seq_len past the context", ModelData, dict(model="tiny", seq_len=10**6), ["seq_len must be <=", "tiny"]),
    ("no batch", ModelData, dict(batch_size=0), ["batch_size", "0"]),
    # a step draws its micro-batches first: 10^11 of them grew past 13 GB and ignored SIGTERM
    ("endless accumulation", ModelData, dict(grad_accum=10**11), ["grad_accum", "[1, 65536]"]),
    ("endless batch", ModelData, dict(batch_size=10**12), ["batch_size", "[1, 65536]"]),
    ("empty data path", ModelData, dict(data=""), ["data", "''"]),
    ("floor above the peak", OptimizerSettings, dict(lr=1e-3, min_lr=1e-2), ["min_lr", "0.01"]),
    ("no steps", OptimizerSettings, dict(steps=0), ["steps", "0"]),
    ("one state format", OptimizerSettings, dict(optimizer_state=("e4m3",)), ["optimizer_state", "got e4m3"]),
    ("unknown preset", Precision, dict(preset="fp7"), ["preset", "'fp7'"]),
    ("keep_blocks out of range", Precision, dict(preset="fp8-delayed", keep_blocks=(0, 1.5)), ["keep_blocks=0,1.5 is not FIRST,LAST"]),
    ("keep_blocks without a recipe", Precision, dict(keep_blocks=(0, 1)), ["keep_blocks=0,1 keeps", "preset='bf16'"]),
    ("fp8 override without fp8-delayed", Precision, dict(fp8_margin=1), ["fp8_margin", "fp8-delayed"]),
    ("bf16 master on fp16", Precision, dict(preset="fp16", master="bf16-sr"), ["master bf16-sr", "'fp16'"]),
    ("negative nan step", SafetyNets, dict(nan_steps=(3, -1)), ["nan_steps", "-1"]),
    ("alpha above 1", SafetyNets, dict(embedding_grad_alpha=2.0), ["embedding_grad_alpha", "2.0"]),
    ("ranks without a layout", Parallelism, dict(nproc=2), ["nproc=2", "parallel"]),
    ("unknown device", Parallelism, dict(device="tpu"), ["device", "'tpu'"]),
    ("tp size not dividing nproc", Parallelism, dict(nproc=3, parallel="fsdp+tp"), ["--tp-size 2", "nproc is 3"]),
    ("resume and overwrite", RunSettings, dict(resume=True, overwrite=True), ["resume", "overwrite"]),
    ("empty out", RunSettings, dict(out=""), ["out", "''"]),
]


@pytest.mark.parametrize("name, group, fields, words", BAD_GROUPS, ids=[case[0] for case in BAD_GROUPS])
def test_each_group_checks_its_own_fields(name, group, fields, words):
    """A bad value is refused by its group, naming the field; built from flat names, TrainConfig says the same."""
    for build in (group, TrainConfig):
        with pytest.raises(ValueError) as err:
            build(**fields)
        assert all(w in str(err.value) for w in words), str(err.value)


def test_the_groups_take_typed_values_only():
    """The flag spellings are parsed by TrainConfig (and the CLI); a group holds the tuples."""
    with pytest.raises(ValueError, match="optimizer_state must be two formats M,V.*'e4m3,bf16'"):
        OptimizerSettings(optimizer_state="e4m3,bf16")
    with pytest.raises(ValueError, match="keep_blocks must be a tuple.*'0,1'"):
        Precision(preset="fp8-delayed", keep_blocks="0,1")


@pytest.mark.parametrize("group", [TrainConfig, *GROUP_CLASSES.values()], ids=lambda c: c.__name__)
def test_the_config_and_its_groups_are_frozen(group):
    value = group()
    name = dataclasses.fields(value)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, name, getattr(value, name))
    with pytest.raises(AttributeError):
        TrainConfig().lr = 1.0  # a flat read has no setter


def test_what_spans_groups_is_checked_by_the_config():
    with pytest.raises(ValueError, match="fsdp\\+tp splits seq_len .* seq_len is 9"):
        TrainConfig(seq_len=9, nproc=2, parallel="fsdp+tp")
    with pytest.raises(ValueError, match="master bf16-sr trains in one process"):
        TrainConfig(master="bf16-sr", nproc=2, parallel="ddp")
    with pytest.raises(ValueError, match="shadow_every checks FP8 against BF16"):
        TrainConfig(shadow_every=5)


def test_flat_and_nested_construction_agree():
    """Flat names are routed to their groups: the same config either way, and flat reads are the groups' fields."""
    flat = TrainConfig(model="10m", seq_len=128, lr=2e-3, min_lr=2e-4, preset="fp8-delayed", keep_blocks="0,1",
                       optimizer_state="e4m3,bf16", nan_steps=(3,), nproc=2, parallel="ddp", out="runs/x")
    nested = TrainConfig(model_data=ModelData(model="10m", seq_len=128),
                         optimizer=OptimizerSettings(lr=2e-3, min_lr=2e-4, optimizer_state=("e4m3", "bf16")),
                         precision=Precision(preset="fp8-delayed", keep_blocks=(0, 1)),
                         safety=SafetyNets(nan_steps=(3,)), parallelism=Parallelism(nproc=2, parallel="ddp"),
                         run=RunSettings(out="runs/x"))
    assert flat == nested and hash(flat) == hash(nested)
    for attr, cls in GROUP_CLASSES.items():
        group = getattr(flat, attr)
        assert isinstance(group, cls)
        for f in dataclasses.fields(cls):
            assert getattr(flat, f.name) == getattr(group, f.name), f.name
    # names on top of a group; dataclasses.replace passes the groups whole with the names on top
    assert TrainConfig(precision=nested.precision, preset="fp8-current").precision.keep_blocks == (0, 1)
    assert dataclasses.replace(flat, lr=4e-3).optimizer == dataclasses.replace(nested.optimizer, lr=4e-3)
    assert dataclasses.replace(flat, keep_blocks="1,1") == dataclasses.replace(flat, keep_blocks=(1, 1))
    with pytest.raises(TypeError, match="unknown settings \\['batchsize'\\]"):
        TrainConfig(batchsize=4)
    with pytest.raises(ValueError, match="precision must be a Precision"):
        TrainConfig(precision="fp8-delayed")


def test_typed_keep_blocks_and_state_formats():
    """The groups hold tuples; the flag spellings are parsed to them."""
    config = TrainConfig(preset="nvfp4", keep_blocks="0,0.15", optimizer_state="e4m3,bf16")
    assert config.precision.keep_blocks == (0, 0.15) and config.optimizer.optimizer_state == ("e4m3", "bf16")
    assert config.precision.blocks_kept == (0, 0.15) and Precision(preset="nvfp4").blocks_kept == (0, 1)
    assert config.policy().keep_blocks == (0, 0.15)
    with pytest.raises(ValueError, match="keep_blocks must be 'FIRST,LAST'.*'0,x'"):
        TrainConfig(preset="fp8-delayed", keep_blocks="0,x")
    # the recipe itself, its overrides applied
    precision = Precision(preset="fp8-delayed", fp8_margin=2, fp8_format="e4m3")
    assert precision.recipe.margin == 2 and precision.recipe.format == "e4m3"
    assert Precision().recipe is None


# the config a checkpoint written before the groups records (tests/data/llama_tiny_bf16_losses.json's, with out and
# preset): flat, keep_blocks and optimizer_state in their flag spelling
OLD_RECORD = {
    "model": "tiny", "steps": 400, "batch_size": 16, "seq_len": 64, "lr": 0.001, "min_lr": 0.0001, "warmup": 20,
    "lr_decay_steps": None, "weight_decay": 0.1, "grad_clip": 1.0, "eval_every": 100, "eval_batches": 16, "seed": 0,
    "out": "runs/old", "data": None, "max_bytes": 2000000, "tokenizer": None, "attention": "auto",
    "checkpoint_every": 100, "resume": False, "fp8_format": None, "fp8_amax_history_len": None, "fp8_margin": None,
    "nan_steps": [], "shadow_every": 0, "shadow_threshold": 0.05, "rollback_after": 0, "snapshot_every": 50,
    "embedding_grad_alpha": 1.0, "compile": False, "compile_mode": "default", "grad_accum": 1, "overwrite": False,
    "device": "auto", "nproc": 1, "parallel": None, "tp_size": 2, "optimizer_state": "e4m3,bf16", "master": "fp32",
    "bf16_tail": 0.0, "nvfp4_weight_2d": None, "nvfp4_rht": None, "nvfp4_stochastic_rounding": None,
    "keep_blocks": "0,1", "preset": "fp8-delayed"}


def test_checkpoints_keep_the_flat_record_of_earlier_releases():
    """flat() writes what earlier releases wrote (dataclasses.asdict of the flat config), so either reads the
    other's checkpoints; a resume reads the record's spellings and lists, and names a change in flag spelling."""
    config = config_from({"out": "runs/old"}, OLD_RECORD)  # as a resume inherits it (out is fresh)
    assert config.precision.keep_blocks == (0, 1) and config.optimizer_state == ("e4m3", "bf16")
    newer = {"tf32", "compile_scope"}  # settings newer than the record: fresh ones, never read back from a checkpoint
    assert all(SETTINGS[name].metadata["resume"] == "fresh" for name in newer)
    absent = {"fp8_layers"}  # fixed settings newer than the record: it ran with their `absent` value
    assert all(config.flat()[name] == SETTINGS[name].metadata["absent"] for name in absent)
    assert {k: v for k, v in {**config.flat(), "nan_steps": []}.items() if k not in newer | absent} == OLD_RECORD
    config.check_resume(OLD_RECORD, 3, where="ckpt")
    with pytest.raises(ValueError, match="--keep-blocks 0,1, this run asks for 1,0"):
        dataclasses.replace(config, keep_blocks=(1, 0)).check_resume(OLD_RECORD, 3, where="ckpt")
    with pytest.raises(ValueError, match="--optimizer-state e4m3,bf16, this run asks for fp32,fp32"):
        dataclasses.replace(config, optimizer_state="fp32,fp32").check_resume(OLD_RECORD, 3, where="ckpt")


def test_a_run_with_typed_settings_resumes_from_its_flat_record(tmp_path):
    """train() records the flat config in the checkpoint; the library and the CLI resume it alike."""
    out = str(tmp_path / "run")
    first = TrainConfig(**TINY, preset="fp8-delayed", keep_blocks=(0, 1), optimizer_state=("e4m3", "bf16"), steps=2,
                        checkpoint_every=2, device="cpu", out=out)
    train(first, progress=False)
    record = read_extra(tmp_path / "run" / CHECKPOINT_DIR)["config"]
    assert record["keep_blocks"] == "0,1" and record["optimizer_state"] == "e4m3,bf16" and "precision" not in record
    resumed = TrainConfig.resuming(out, steps=3)
    assert resumed == dataclasses.replace(first, steps=3, resume=True, device="auto")
    assert resumed == _parse(["--out", out, "--resume", "--steps", "3"])
    assert train(resumed, progress=False).last_step == 3


def test_a_resume_that_cannot_split_the_micro_batches_names_a_layout_that_can():
    """An fsdp+tp checkpoint on 2 ranks (one data rank, 1 micro-batch per step) resumed under ddp on 2 ranks: the
    refusal used to say "resume with --nproc 2", the very flag given."""
    saved = TrainConfig(nproc=2, parallel="fsdp+tp", tp_size=2, preset="fp8-delayed", out="x").flat()
    config = TrainConfig(nproc=2, parallel="ddp", preset="fp8-delayed", out="x")
    with pytest.raises(ValueError, match=r"1 micro-batches per step, which 2 data ranks cannot split evenly: resume "
                                         r"on --nproc 1 \(with --grad-accum 1\)"):
        config.check_resume(saved, 3, where="ckpt")


def test_tensor_parallel_needs_a_per_tensor_recipe():
    """MX and block scaling split no weight over tensor-parallel ranks: refused before any rank starts (it failed
    in every rank, with a Python repr of the recipe, leaving an empty run folder)."""
    for preset in ("mxfp8", "fp8-block", "nvfp4"):
        with pytest.raises(ValueError, match=rf"parallel='fsdp\+tp' .* but preset='{preset}'"):
            TrainConfig(nproc=2, parallel="fsdp+tp", preset=preset, out="x")
    assert TrainConfig(nproc=2, parallel="fsdp+tp", preset="fp8-current", out="x").parallel == "fsdp+tp"


def test_an_override_equal_to_the_presets_value_resumes():
    # --fp8-margin 0 on a checkpoint that left the preset's margin (None, which is 0) was refused, and the fix it
    # named, --fp8-margin None, is not a value the flag takes
    saved = TrainConfig(preset="fp8-delayed").flat()
    for given in (dict(fp8_margin=0), dict(fp8_format="hybrid"), dict(fp8_amax_history_len=16)):
        TrainConfig(preset="fp8-delayed", steps=saved["steps"] + 1, **given).check_resume(saved, 3, where="ckpt")
    # and the line said "was trained with --fp8-margin None"
    with pytest.raises(ValueError, match="trained without --fp8-margin \\(the preset's\\), this run asks for 2.* "
                                         "resume without --fp8-margin \\(the preset's\\)"):
        TrainConfig(preset="fp8-delayed", steps=saved["steps"] + 1, fp8_margin=2).check_resume(saved, 3, where="ckpt")
    again = TrainConfig(preset="fp8-delayed", fp8_margin=0).flat()  # and back: the explicit record, no flag given
    TrainConfig(preset="fp8-delayed", steps=again["steps"] + 1).check_resume(again, 3, where="ckpt")


def test_a_decay_that_ends_within_the_warmup_is_refused():
    # the lr climbed past the cosine's end and dropped to min_lr in one step
    with pytest.raises(ValueError, match="lr_decay_steps=3 ends the cosine decay within the warm-up"):
        TrainConfig(warmup=5, lr_decay_steps=3)
    TrainConfig(warmup=5, lr_decay_steps=6)
    TrainConfig(warmup=20, steps=3)  # the default decay end (steps) may fall in the warm-up: a short trial run


def test_an_out_inside_a_text_data_folder_is_refused(tmp_path):
    # the run's log.csv, run.json and checkpoint manifest were read as corpus text, so --resume found the data changed
    (tmp_path / "a.txt").write_text("text " * 100)
    with pytest.raises(ValueError, match="lies inside data"):
        TrainConfig(data=str(tmp_path), out=str(tmp_path / "runs" / "train"))
    TrainConfig(data=str(tmp_path / "a.txt"), out=str(tmp_path / "runs" / "train"))  # one file: nothing read around it


def test_a_refusal_spells_on_off_flags_as_they_are_given():
    # "resume with --nvfp4-rht True": a value the flag refuses (it takes on or off)
    saved = TrainConfig(preset="nvfp4", nvfp4_rht=True).flat()
    with pytest.raises(ValueError, match="--nvfp4-rht on, this run asks for off.*resume with --nvfp4-rht on"):
        TrainConfig(preset="nvfp4", nvfp4_rht=False, steps=saved["steps"] + 1).check_resume(saved, 3, where="ckpt")


def test_keep_blocks_that_keep_every_block_are_refused_by_the_config():
    # refused only when the model was built, after --out had been made
    with pytest.raises(ValueError, match="keeps every one of the tiny model's 2 blocks"):
        TrainConfig(model="tiny", preset="fp8-delayed", keep_blocks=(5, 5))
