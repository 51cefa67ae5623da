"""TrainConfig: one training run of the reference Llama, its settings in six frozen groups, validated as a whole."""

from __future__ import annotations

import dataclasses
import operator
import pathlib

import torch

from minifloat.amp.policy import PRESETS, PrecisionPolicy
from minifloat.core.files import is_within
from minifloat.fp8.recipes import ROLES
from minifloat.training.model import Llama, LlamaConfig
from minifloat.training.tokens import is_token_data
from minifloat.training.precision import (FP8_OVERRIDES, NVFP4_OVERRIDES, Precision, keep_blocks_from,  # noqa: F401
                                          keep_blocks_spelled)
from minifloat.training.settings import (COMPILE_MODES, DEVICE_PATTERN, GROUPS, NOT_RECORDED, PARALLEL,  # noqa: F401
                                         RESUMES, ModelData, OptimizerSettings, Parallelism, RunSettings, SafetyNets,
                                         setting, state_formats_from)

# TrainConfig's groups: the attribute that holds each, and its class (in the order of GROUPS)
GROUP_CLASSES = {"model_data": ModelData, "optimizer": OptimizerSettings, "precision": Precision,
                 "safety": SafetyNets, "parallelism": Parallelism, "run": RunSettings}
# precision settings whose None means "the preset's value" (resume compares what they make, not their spelling)
PRESET_OVERRIDES = (*FP8_OVERRIDES, *NVFP4_OVERRIDES, "keep_blocks")
# every setting by its (flat) name, and the group attribute that holds it
SETTINGS = {f.name: f for cls in GROUP_CLASSES.values() for f in dataclasses.fields(cls)}
GROUP_OF = {f.name: attr for attr, cls in GROUP_CLASSES.items() for f in dataclasses.fields(cls)}
# the settings typed as tuples whose flags (and the checkpoints of earlier releases) spell them "A,B": parse, spell
SPELLINGS = {"keep_blocks": (keep_blocks_from, keep_blocks_spelled), "optimizer_state": (state_formats_from, ",".join)}


def typed(name: str, value):
    """A setting's value as its group holds it: a flag spelling ("0,1", "e4m3,bf16") parsed."""
    return SPELLINGS[name][0](value) if name in SPELLINGS and isinstance(value, str) else value


def recorded(name: str, value):
    """A setting's value from a checkpoint's record (JSON): lists made tuples, flag spellings parsed."""
    return typed(name, tuple(value) if isinstance(value, list) else value)


def spelled(name: str, value):
    """A setting's value as its flag spells it and checkpoints record it: ("e4m3", "bf16") -> "e4m3,bf16"."""
    return SPELLINGS[name][1](value) if name in SPELLINGS and isinstance(value, tuple) else value


@dataclasses.dataclass(frozen=True, init=False)
class TrainConfig:
    """One training run: its settings in six frozen groups (`config.precision.preset`, `config.optimizer.lr`). Each
    group's field is a `setting`: its help, group, flag and resume rule are in its metadata (`minifloat train --help`
    prints them, grouped).

    Built from groups, from flat setting names, or both (the names on top of the groups):
    `TrainConfig(model="tiny", lr=2e-3)` == `TrainConfig(optimizer=OptimizerSettings(lr=2e-3))`; so
    `dataclasses.replace(config, lr=2e-3)` works too. Each setting reads flat as well: `config.lr` is
    `config.optimizer.lr`. `flat()` is the record checkpoints keep.

    A resumed run (resume=True) continues out/ckpt: the checkpoint's model, preset and "fixed" settings must be this
    config's, and steps must exceed its step (`check_resume`). `TrainConfig.resuming(out, **given)` builds that
    config the way `minifloat train --resume` does: every setting not given is the checkpoint's, except the "fresh"
    ones (out, device, compile, lr_decay_steps, ...).
    """

    model_data: ModelData = ModelData()
    optimizer: OptimizerSettings = OptimizerSettings()
    precision: Precision = Precision()
    safety: SafetyNets = SafetyNets()
    parallelism: Parallelism = Parallelism()
    run: RunSettings = RunSettings()

    def __init__(self, model_data: ModelData | None = None, optimizer: OptimizerSettings | None = None,
                 precision: Precision | None = None, safety: SafetyNets | None = None,
                 parallelism: Parallelism | None = None, run: RunSettings | None = None, **settings):
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise TypeError(f"TrainConfig got unknown settings {unknown}; known: {', '.join(SETTINGS)}")
        given = dict(model_data=model_data, optimizer=optimizer, precision=precision, safety=safety,
                     parallelism=parallelism, run=run)
        for attr, cls in GROUP_CLASSES.items():
            group = given[attr]
            if group is not None and not isinstance(group, cls):
                raise ValueError(f"{attr} must be a {cls.__name__} or None, got {group!r}")
            mine = {name: typed(name, value) for name, value in settings.items() if GROUP_OF[name] == attr}
            group = cls(**mine) if group is None else dataclasses.replace(group, **mine) if mine else group
            # the one assignment to a frozen field, as dataclass's own __init__ makes it (this one routes flat names)
            object.__setattr__(self, attr, group)
        self.__post_init__()

    def __post_init__(self):
        """What spans groups; each group checked its own fields when built."""
        if self.parallel == "fsdp+tp" and self.seq_len % self.tp_size:
            raise ValueError(f"fsdp+tp splits seq_len over tensor-parallel groups of --tp-size {self.tp_size} ranks, "
                             f"but seq_len is {self.seq_len}: choose a --tp-size dividing it")
        recipe = self.policy().recipe
        if self.parallel == "fsdp+tp" and recipe is not None and not all(
                getattr(recipe.spec(role), "per_tensor", False) for role in ROLES):
            raise ValueError(f"parallel='fsdp+tp' splits each linear layer over its tensor-parallel ranks, which needs "
                             f"one scale per tensor, but preset={self.preset!r} scales {type(recipe).__name__}'s "
                             f"rows or blocks: use preset='fp8-delayed' or preset='fp8-current', or parallel='fsdp'")
        if self.master != "fp32" and self.nproc > 1:
            raise ValueError(f"master {self.master} trains in one process: sharded checkpoints cannot store its "
                             f"{'generator' if self.master == 'bf16-sr' else 'compensation'} state yet; got "
                             f"nproc={self.nproc}, use --nproc 1 or --master fp32")
        if self.nan_steps and max(self.nan_steps) >= self.steps:
            last = max(self.nan_steps)
            raise ValueError(f"nan_steps={','.join(map(str, self.nan_steps))} puts NaN into step {last}, which a run "
                             f"of steps={self.steps} never reaches (its steps are 0 to {self.steps - 1})")
        if is_within(self.out, self.data) and not is_token_data(str(self.data)):  # a text folder is read whole
            raise ValueError(f"out={self.out} lies inside data={self.data}: the run's own files (logs, checkpoints) "
                             f"would be read as training data, and a resume would find the data changed; choose an "
                             f"out outside the data folder")
        if PRESETS[self.preset].recipe is not None and any(self.blocks_kept):  # before any folder is made
            with torch.device("meta"):
                llama = Llama(self.model_config())
            if "fp8" not in self.policy().plan(llama).values():
                raise ValueError(f"preset={self.preset!r} trains its linear layers in low precision, but "
                                 f"keep_blocks={','.join(map(str, self.blocks_kept))} keeps every one of the "
                                 f"{self.model} model's {llama.config.n_layer} blocks in high precision: nothing "
                                 f"would train in low precision; keep fewer blocks")
        if self.shadow_every and PRESETS[self.preset].recipe is None:
            raise ValueError(f"shadow_every checks FP8 against BF16, but preset={self.preset!r} has no FP8 recipe; "
                             f"use an fp8 preset or shadow_every=0, got shadow_every={self.shadow_every!r}")

    def flat(self) -> dict:
        """Every setting by name, as checkpoints and run.json record the config: keep_blocks and optimizer_state in
        their flag spelling ("0,1", "e4m3,bf16"), as before the groups, so that either reads the other's."""
        return {name: spelled(name, getattr(self, name)) for name in SETTINGS}

    @classmethod
    def resuming(cls, out: str, **given) -> TrainConfig:
        """The config that continues the run in `out` as `minifloat train --resume --out OUT` does: the checkpoint's
        settings, except the "fresh" ones, with `given` on top (e.g. steps=800). FileNotFoundError without one."""
        from minifloat.training.rundir import CHECKPOINT_DIR
        from minifloat.training.sharded import read_extra

        ckpt = pathlib.Path(out) / CHECKPOINT_DIR
        if not ckpt.is_dir():
            raise FileNotFoundError(f"there is no checkpoint at {ckpt} to resume")
        return config_from({**given, "out": str(out), "resume": True}, read_extra(ckpt).get("config") or {})

    def policy(self) -> PrecisionPolicy:
        """The precision policy of the run (`Precision.policy`)."""
        return self.precision.policy()

    def layer_filter(self):
        """The low-precision layers' filter (`Precision.layer_filter`) at this run's tokens per micro-batch."""
        return self.precision.layer_filter(self.batch_size * self.seq_len)

    @property
    def blocks_kept(self) -> tuple[int | float, int | float]:
        """keep_blocks as (first, last), the preset's when None."""
        return self.precision.blocks_kept

    def model_config(self, vocab_size: int = 256) -> LlamaConfig:
        """The model this run trains: the size preset `model`, with the data's vocabulary (padded up to a multiple
        of 16) and this run's attention."""
        return LlamaConfig.preset(self.model, vocab_size=16 * -(-vocab_size // 16), attention=self.attention)

    @property
    def bf16_tail_start(self) -> int:
        """The first step of the BF16 tail (`steps` when there is none)."""
        return self.steps - round(self.bf16_tail * self.steps)

    @property
    def state_formats(self) -> tuple[str, ...]:
        """optimizer_state as (m format, v format)."""
        return self.optimizer_state

    @property
    def data_ranks(self) -> int:
        """Ranks training on different batches (TrainConfig fields as a dict: `data_ranks(config.flat())`)."""
        return data_ranks(self.flat())

    def check_resume(self, saved: dict | None, saved_step: int | None, *, where) -> None:
        """Raise ValueError unless resuming the checkpoint at `where` (its config `saved`, reached at `saved_step`)
        under this config continues the same run: one line naming the difference and the flag that fixes it."""
        if not isinstance(saved, dict) or not isinstance(saved_step, int):
            raise ValueError(f"the checkpoint at {where} records no training config or step (not written by "
                             f"`minifloat train`); start a new run in another --out")
        if saved.get("model") != self.model:
            raise ValueError(f"the checkpoint at {where} is a {saved.get('model')} model, this run asks for "
                             f"{self.model}: resume with --model {saved.get('model')}, or start a new run elsewhere")
        if saved.get("preset") != self.preset:
            raise ValueError(f"the checkpoint at {where} was trained with preset {saved.get('preset')}, this run asks "
                             f"for {self.preset}: resume with --preset {saved.get('preset')}, or start a new run "
                             f"elsewhere")
        saved_ranks, ranks = data_ranks(saved), self.data_ranks
        if saved_ranks != ranks:  # another number of ranks continues the run if the micro-batches per step stay
            saved_micro, micro = saved.get("grad_accum", 1) * saved_ranks, self.grad_accum * ranks
            if saved_micro != micro:
                raise ValueError(f"the checkpoint at {where} was trained on {saved_ranks} data rank(s) with "
                                 f"--grad-accum {saved.get('grad_accum', 1)} ({saved_micro} micro-batches per step), "
                                 f"this run asks for {micro} on {ranks}: resume with --grad-accum "
                                 f"{saved_micro // ranks}" if saved_micro % ranks == 0 else
                                 f"the checkpoint at {where} was trained with {saved_micro} micro-batches per step, "
                                 f"which {ranks} data ranks cannot split evenly: resume on "
                                 f"{_ranks_for(saved_micro)}")
        for field, consequence in RESUME_FIXED:
            if field == "grad_accum" and saved_ranks != ranks:
                continue  # checked above, as micro-batches per step
            # absent: not checkable; a checkpoint spells "A,B" settings as their flags do (typed compares them)
            was = recorded(field, saved.get(field, RESUME_ABSENT.get(field, getattr(self, field))))
            if was != getattr(self, field) and not self._same_by_preset(field, was):
                flag, spelt = "--" + field.replace("_", "-"), _as_flag(field, was)
                asked = _as_flag(field, getattr(self, field))
                fix = f"without {flag} (the preset's)" if was is None else f"with {flag} {spelt}"
                raise ValueError(f"the checkpoint at {where} was trained {fix}, this run asks for "
                                 f"{asked}: that {consequence}, so it would not continue the same run; resume {fix}, "
                                 f"or start a new run elsewhere")
        if self.steps <= saved_step:
            raise ValueError(f"--steps {self.steps}: the checkpoint at {where} is already at step {saved_step}; pass "
                             f"--steps above {saved_step} to train on")


    def _same_by_preset(self, field: str, was) -> bool:
        """Whether `field` = `was` (a precision override whose None means the preset's value) makes this run's own
        recipe and kept blocks: --fp8-margin 0 given where the checkpoint left the preset's 0 continues the run."""
        if field not in PRESET_OVERRIDES:
            return False
        try:
            other = dataclasses.replace(self, **{field: was})
        except ValueError:
            return False
        return other.policy() == self.policy() and other.blocks_kept == self.blocks_kept


def _as_flag(field: str, value) -> str:
    """A setting's value as its flag takes it: on/off for on_off settings, the "A,B" spelling of tuples."""
    if SETTINGS[field].metadata.get("on_off") and isinstance(value, bool):
        return "on" if value else "off"
    return str(spelled(field, value))


def _ranks_for(micro: int) -> str:
    """How a resume gets a number of data ranks that splits `micro` micro-batches per step evenly, in flags."""
    return "--nproc 1 (with --grad-accum {micro}), or data ranks dividing {micro}".format(micro=micro)


def _flat_reads() -> None:
    """Each setting read flat, `config.lr` for `config.optimizer.lr`: a read-only property of TrainConfig."""
    for name, attr in GROUP_OF.items():
        read = property(operator.attrgetter(f"{attr}.{name}"), doc=SETTINGS[name].metadata["help"])
        setattr(TrainConfig, name, read)


_flat_reads()

# derived from the settings: what a resumed run must share with its checkpoint (and what a change would do), the
# value a checkpoint written before a fixed setting existed ran with, and what a resume never inherits
RESUME_FIXED = tuple((n, f.metadata["why"]) for n, f in SETTINGS.items() if f.metadata["resume"] == "fixed")
RESUME_ABSENT = {n: f.metadata["absent"] for n, f in SETTINGS.items() if f.metadata["absent"] is not NOT_RECORDED}
NOT_INHERITED = tuple(n for n, f in SETTINGS.items() if f.metadata["resume"] == "fresh")


def config_from(given: dict, saved: dict | None = None) -> TrainConfig:
    """The TrainConfig that `given` (setting -> value, only the settings chosen) asks for.

    Given `lr` without `min_lr`, the floor follows as lr / 10. With `saved`, a checkpoint's config (resuming), the
    settings not given are the checkpoint's, except the "fresh" ones; a new `nproc` without `parallel` chooses the
    layout anew. More than one process defaults to parallel ddp.
    """
    unknown = sorted(set(given) - set(SETTINGS))
    if unknown:
        raise ValueError(f"unknown TrainConfig settings {unknown}; known: {', '.join(SETTINGS)}")
    fields = dict(given)
    if "lr" in fields and "min_lr" not in fields:
        fields["min_lr"] = fields["lr"] / 10
    if saved:
        # a checkpoint's record is flat (TrainConfig.flat): JSON lists for tuples, "A,B" spellings
        inherited = {k: recorded(k, v) for k, v in saved.items() if k in SETTINGS and k not in NOT_INHERITED}
        if "nproc" in given and "parallel" not in given:
            inherited.pop("parallel", None)
        fields = {**inherited, **fields}
    if fields.get("nproc", 1) > 1 and fields.get("parallel") is None:
        fields["parallel"] = "ddp"
    return TrainConfig(**fields)


def data_ranks(config: dict) -> int:
    """The ranks of a run (a TrainConfig as a dict, e.g. a checkpoint's) that train on different batches: nproc, or
    nproc / tp_size under fsdp+tp, whose tensor-parallel groups share their tokens."""
    nproc = config.get("nproc", 1)
    return nproc // config.get("tp_size", 2) if config.get("parallel") == "fsdp+tp" else nproc
