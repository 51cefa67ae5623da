"""The groups of a run's settings, each a frozen dataclass of `setting`s (flag, help, resume rule in the metadata).

TrainConfig (minifloat.training.config) holds one of each; Precision lives in minifloat.training.precision. A group
checks its own fields when built; what spans groups (a model's context against seq_len) TrainConfig checks.
"""

from __future__ import annotations

import dataclasses
import re
import typing

from minifloat.core.validate import check_bool, check_choice, check_int, check_number, check_seed
from minifloat.numerics.stateformats import StateFormat
from minifloat.safety.shadow import ShadowConfig
from minifloat.training.model import SIZES
from minifloat.training.parallel import Parallel

# the groups of settings, in the order `minifloat train --help` lists them
GROUPS = ("model and data", "optimizer and schedule", "precision", "safety nets", "parallelism and device", "run")
RESUMES = ("inherit", "fixed", "fresh")
NOT_RECORDED = object()
PARALLEL = [p.value for p in Parallel]  # Parallelism.parallel
DEVICE_PATTERN = re.compile(r"auto|cpu|meta|cuda(:\d+)?")  # Parallelism.device
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")  # Parallelism.compile_mode: torch.compile's modes
COMPILE_SCOPES = ("blocks", "model")  # Parallelism.compile_scope: what one compiled graph holds
STATE_FORMATS = [f.value for f in StateFormat]  # OptimizerSettings.optimizer_state, each moment

_SAME_BATCHES = "changes the tokens per step and the batches the run sees from here"
_SCHEDULE = "changes the learning-rate schedule"


def setting(default, help: str, *, resume: str = "inherit", why: str = "", absent=NOT_RECORDED,
            metavar: str | None = None, choices: tuple | None = None, on_off: bool = False, flag: bool = True):
    """A field of a settings group and all that is said of it: its flag and help (minifloat.cli.train) and resume
    rule. The group is the class's (`setting_group`).

    Args:
        default: the default value.
        help: what the setting does (the flag's help; the default is appended).
        resume: what a resumed run does with it: "inherit" (takes the checkpoint's value unless given), "fixed"
            (must equal the checkpoint's: `why` says what a change would do) or "fresh" (never inherited: where and
            how this call runs).
        absent: for "fixed" settings newer than some checkpoints, the value such a checkpoint ran with.
        metavar, choices: for the flag's help. on_off: a bool whose flag takes on|off (ablations must say off).
        flag: False for settings with no flag.
    """
    if resume not in RESUMES or (resume == "fixed") != bool(why):
        raise ValueError(f"bad setting metadata: resume={resume!r}, why={why!r}")
    meta = dict(help=help, resume=resume, why=why, absent=absent, metavar=metavar, choices=choices, on_off=on_off,
                flag=flag)
    return dataclasses.field(default=default, metadata=meta)


@typing.dataclass_transform()
def setting_group(group: str):
    """Class decorator: a frozen dataclass whose fields are `setting`s of `group` (one of GROUPS), each field's
    metadata given the group, so that a walk over the fields finds it there."""
    if group not in GROUPS:
        raise ValueError(f"bad settings group {group!r}; known: {', '.join(GROUPS)}")

    def make(cls):
        for name in cls.__annotations__:
            f = cls.__dict__[name]
            setattr(cls, name, dataclasses.field(default=f.default, metadata={**f.metadata, "group": group}))
        cls.GROUP = group
        return dataclasses.dataclass(frozen=True)(cls)

    return make


def _check_path(name: str, value, what: str) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{name} must be {what} or None, got {value!r}")


# the most sequences per micro-batch, and micro-batches per step (a step draws its micro-batches before it runs: at
# 10^11 the list alone grew past 13 GB); Megatron-scale steps take a few thousand
MAX_BATCH = 1 << 16


@setting_group("model and data")
class ModelData:
    """The model trained and the batches it sees."""

    model: str = setting("tiny", "model size: " + ", ".join(SIZES))
    batch_size: int = setting(16, "sequences per (micro-)batch", resume="fixed", why=_SAME_BATCHES)
    seq_len: int = setting(64, "tokens per sequence (bytes of text by default; at most the model's max_seq_len)",
                           resume="fixed", why=_SAME_BATCHES)
    seed: int = setting(0, "seed for the weights and the batch order", resume="fixed",
                        why="changes the order of the batches")
    data: str | None = setting(None, "folder of text files, or token shards: a .bin file or a folder of them, "
                                     "memory-mapped (default: the Python standard library's sources)")
    max_bytes: int | None = setting(2_000_000, "cap on the corpus bytes, train + val, of a folder of text files "
                                               "(token shards are memory-mapped, never capped)")
    tokenizer: str | None = setting(
        None, "tokenizer.json of Hugging Face tokenizers that turns the --data text into tokens; the model's "
              "vocabulary is the tokenizer's (default: bytes, 256 ids; token shards name their own). A resumed run "
              "takes the run's unless given, and checks the file by its content, as it checks --data",
        metavar="FILE")
    grad_accum: int = setting(1, "micro-batches of --batch-size per optimizer step; FP8 scales advance once per "
                                 "step", resume="fixed", why=_SAME_BATCHES, metavar="K")

    def __post_init__(self):
        check_choice("model", self.model, list(SIZES))
        for field in ("batch_size", "seq_len", "grad_accum"):  # a step holds its micro-batches: bounded
            check_int(field, getattr(self, field), low=1, high=MAX_BATCH if field != "seq_len" else None)
        check_seed("seed", self.seed)
        if self.seq_len > SIZES[self.model].max_seq_len:
            raise ValueError(f"seq_len must be <= {SIZES[self.model].max_seq_len} (max_seq_len of model "
                             f"{self.model!r}), got {self.seq_len!r}")
        _check_path("data", self.data, "a non-empty path string")
        check_int("max_bytes", self.max_bytes, low=2, allow_none=True)
        _check_path("tokenizer", self.tokenizer, "a path to a tokenizer.json")


@setting_group("optimizer and schedule")
class OptimizerSettings:
    """AdamW, its learning-rate schedule and how its state is stored."""

    steps: int = setting(200, "optimizer steps to run up to (a resumed run continues from the checkpoint's step)")
    # nanoGPT's baby-GPT value; docs/benchmarks.md shows FP8 tracking BF16 less closely at 3e-3
    lr: float = setting(1e-3, "peak learning rate; given alone, the cosine floor --min-lr follows as lr/10",
                        resume="fixed", why=_SCHEDULE)
    min_lr: float = setting(1e-4, "floor of the cosine decay (at most --lr)", resume="fixed", why=_SCHEDULE)
    warmup: int = setting(20, "steps of linear learning-rate warm-up", resume="fixed", why=_SCHEDULE)
    lr_decay_steps: int | None = setting(
        None, "step at which the cosine reaches --min-lr (default: --steps). Set it when a run is cut short on "
              "purpose and resumed later, so both halves follow one schedule; on --resume a new value re-plans the "
              "rest of the decay from the lr reached, never upwards", resume="fresh", metavar="N")
    weight_decay: float = setting(0.1, "AdamW weight decay of matrices and embeddings (none on norms)")
    grad_clip: float = setting(1.0, "gradient L2 norm limit")
    optimizer_state: tuple[str, str] = setting(
        ("fp32", "fp32"), "formats of AdamW's two moments M,V, stored per block of 128: fp32, bf16, e4m3, e5m2, "
                          "int8, int8-dynamic, int4 or int4-dynamic each (e.g. e4m3,bf16: 3 B/param instead of 8; "
                          "norms, embeddings and small tensors keep fp32)", resume="fixed",
        why="changes how the optimizer state is stored", metavar="M,V")

    def __post_init__(self):
        check_int("steps", self.steps, low=1)
        check_int("warmup", self.warmup, low=0)
        check_int("lr_decay_steps", self.lr_decay_steps, low=1, allow_none=True)
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.warmup:  # the cosine starts after warm-up
            raise ValueError(f"lr_decay_steps={self.lr_decay_steps} ends the cosine decay within the warm-up of "
                             f"warmup={self.warmup} steps (the lr would climb past it, then drop to min_lr at once); "
                             f"give lr_decay_steps above {self.warmup}, or a shorter warmup")
        check_number("lr", self.lr, low=0.0, low_open=True)
        check_number("min_lr", self.min_lr, low=0.0, high=self.lr)
        check_number("weight_decay", self.weight_decay, low=0.0)
        check_number("grad_clip", self.grad_clip, low=0.0, low_open=True)
        if (not isinstance(self.optimizer_state, tuple) or len(self.optimizer_state) != 2
                or any(f not in STATE_FORMATS for f in self.optimizer_state)):
            got = (",".join(map(str, self.optimizer_state)) if isinstance(self.optimizer_state, tuple)
                   else repr(self.optimizer_state))
            raise ValueError(f"optimizer_state must be two formats M,V (the moments of AdamW), each one of "
                             f"{', '.join(STATE_FORMATS)}; got {got}")


def state_formats_from(text: str) -> tuple[str, ...]:
    """--optimizer-state's spelling "e4m3,bf16" -> ("e4m3", "bf16") (OptimizerSettings checks the values)."""
    return tuple(f.strip() for f in text.split(","))


@setting_group("safety nets")
class SafetyNets:
    """The checks that catch a diverging run, and fault injection to try them."""

    nan_steps: tuple[int, ...] = setting(
        (), "fault injection: comma list of steps whose loss is made NaN, to try the guards (batch groups: once a "
            "rollback skipped batches, the poison stays with its batches)", metavar="S,S")
    shadow_every: int = setting(
        0, f"every N steps, run the batch in FP8 and in BF16 and compare the losses; {ShadowConfig().patience} "
           f"unhealthy checks in a row move the run to BF16, {ShadowConfig().recover_after} healthy ones back to "
           f"FP8; 0 for off (needs an FP8 preset)", metavar="N")
    shadow_threshold: float = setting(ShadowConfig().threshold, "largest healthy relative loss difference "
                                      "|fp8 - bf16| / bf16 of a shadow check", metavar="X")
    rollback_after: int = setting(0, "after N skipped steps in a row, restore the last in-memory snapshot and "
                                     "continue past the bad batches; 0 for off", metavar="N")
    snapshot_every: int = setting(50, "steps between the in-memory rollback snapshots", metavar="N")
    embedding_grad_alpha: float = setting(
        1.0, "multiply the gradient into the token embedding's output by A in (0, 1] (GLM-130B: 0.1); 1 for off",
        metavar="A")

    def __post_init__(self):
        if not isinstance(self.nan_steps, tuple):
            raise ValueError(f"nan_steps must be a tuple of step numbers, got {self.nan_steps!r}")
        for s in self.nan_steps:
            check_int("nan_steps", s, low=0)
        for field in ("shadow_every", "rollback_after"):
            check_int(field, getattr(self, field), low=0)
        check_int("snapshot_every", self.snapshot_every, low=1)
        check_number("shadow_threshold", self.shadow_threshold, low=0.0, low_open=True)
        check_number("embedding_grad_alpha", self.embedding_grad_alpha, low=0.0, high=1.0, low_open=True)


@setting_group("parallelism and device")
class Parallelism:
    """Where the run computes: the device, the processes and how they hold the model, and torch.compile."""

    compile: bool = setting(False, "run the training forward and backward under torch.compile (the first steps "
                                   "compile; evaluation and checks stay eager)", resume="fresh")
    compile_mode: str = setting(
        "default", "torch.compile's mode with --compile: default, reduce-overhead (CUDA graphs: for small steps, "
                   "where launching kernels costs more than running them) or max-autotune", resume="fresh",
        choices=COMPILE_MODES)
    compile_scope: str = setting(
        "blocks", "what --compile compiles: blocks (each transformer block on its own, one graph per distinct block "
                  "reused by the others: minutes less compiling for an FP8 model; embedding, head and loss stay "
                  "eager) or model (the whole forward in one graph)", resume="fresh", choices=COMPILE_SCOPES)
    device: str = setting("auto", "auto (a CUDA GPU when torch sees one, else the CPU), cpu, cuda or cuda:N; meta "
                                  "for shapes only", resume="fresh")
    tf32: bool = setting(True, "on a CUDA GPU, run the float32 matmuls (the policy's fp32 head, --attention fp32) on "
                               "TF32 tensor cores: float32 weights, accumulation and outputs, inputs rounded to 10 "
                               "mantissa bits (bfloat16 has 7), about 8x the IEEE rate on an H100; on (default) or "
                               "off. The CPU is not affected", resume="fresh", on_off=True)
    nproc: int = setting(1, "train on N processes of this machine (torchrun; gloo on CPU, NCCL on GPU), each on "
                            "--grad-accum micro-batches of every step; logs, progress and checkpoints come from "
                            "rank 0", metavar="N")
    parallel: str | None = setting(
        None, "how the ranks hold the model: ddp (replicated), fsdp (sharded, FSDP2, FP8 weights gathered in FP8) "
              "or fsdp+tp (tensor/sequence parallel in groups of --tp-size ranks, FSDP2 across them); default ddp "
              "when --nproc is above 1", choices=tuple(PARALLEL))
    tp_size: int = setting(2, "ranks per tensor-parallel group with --parallel fsdp+tp; must divide --nproc and "
                              "--seq-len", metavar="T")

    def __post_init__(self):
        check_bool("compile", self.compile)
        check_bool("tf32", self.tf32)
        check_choice("compile_mode", self.compile_mode, list(COMPILE_MODES))
        check_choice("compile_scope", self.compile_scope, list(COMPILE_SCOPES))
        if not isinstance(self.device, str) or not DEVICE_PATTERN.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda, cuda:N or meta, got {self.device!r}")
        check_int("nproc", self.nproc, low=1)
        check_choice("parallel", self.parallel, [None, *PARALLEL])
        if self.nproc > 1 and self.parallel is None:
            raise ValueError(f"nproc={self.nproc} ranks need parallel ddp or fsdp, got parallel=None")
        check_int("tp_size", self.tp_size, low=2)
        if self.parallel == "fsdp+tp" and self.nproc == 1:
            raise ValueError(f"fsdp+tp splits nproc over tensor-parallel groups of --tp-size {self.tp_size} ranks, "
                             f"but nproc is 1: add --nproc N (a multiple of {self.tp_size}), or launch the ranks "
                             f"with torchrun")
        if self.parallel == "fsdp+tp" and self.nproc % self.tp_size:
            raise ValueError(f"fsdp+tp splits nproc over tensor-parallel groups of --tp-size {self.tp_size} ranks, "
                             f"but nproc is {self.nproc}: choose a --tp-size dividing it")


@setting_group("run")
class RunSettings:
    """The run's folder, its evaluations and checkpoints, and whether it continues or replaces a run there."""

    eval_every: int = setting(50, "steps between validation passes (one more at the end)")
    eval_batches: int = setting(8, "validation batches per pass")
    out: str = setting("runs/train", "output folder: log.csv, val.csv, ckpt/, run.json, tensorboard/. A folder that "
                                     "holds a run is refused unless --resume or --overwrite", resume="fresh")
    checkpoint_every: int = setting(100, "steps between checkpoints into OUT/ckpt (one more at the end), 0 for none")
    resume: bool = setting(False, "continue the run in OUT from OUT/ckpt: settings not given keep the checkpoint's "
                                  "values, and --steps must go beyond its step", resume="fresh")
    overwrite: bool = setting(False, "replace the run in OUT (only the files a run writes there are removed)",
                              resume="fresh")

    def __post_init__(self):
        for field in ("eval_every", "eval_batches"):
            check_int(field, getattr(self, field), low=1)
        check_int("checkpoint_every", self.checkpoint_every, low=0)
        if not isinstance(self.out, str) or not self.out:
            raise ValueError(f"out must be a non-empty path string, got {self.out!r}")
        check_bool("resume", self.resume)
        check_bool("overwrite", self.overwrite)
        if self.resume and self.overwrite:
            raise ValueError(f"resume=True continues the run in out={self.out!r} and overwrite=True replaces it: "
                             f"choose one")
