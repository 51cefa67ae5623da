"""TrainConfig: one training run of the reference Llama, validated as a whole when built."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import torch

from minifloat.amp.policy import PRESETS, PrecisionPolicy
from minifloat.fp8.convert import KEEP_BLOCKS_RULE, check_keep_blocks
from minifloat.fp8.recipes import NVFP4Scaling
from minifloat.numerics.stateformats import StateFormat
from minifloat.core.validate import check_bool, check_choice, check_int, check_number
from minifloat.safety.shadow import ShadowConfig
from minifloat.training.parallel import Parallel
from minifloat.training.settings import GROUPS, NOT_RECORDED, RESUMES, setting  # noqa: F401 (re-exported)
from minifloat.training.model import ATTENTIONS, SIZES, LlamaConfig
from minifloat.training.optimizer import MASTER_HELP, MASTER_UPDATES, master_policy

PARALLEL = [p.value for p in Parallel]  # TrainConfig.parallel
DEVICE_PATTERN = re.compile(r"auto|cpu|meta|cuda(:\d+)?")  # TrainConfig.device
# TrainConfig's NVFP4 overrides and the NVFP4Scaling field each replaces
NVFP4_OVERRIDES = {"nvfp4_weight_2d": "weight_2d", "nvfp4_rht": "rht",
                   "nvfp4_stochastic_rounding": "stochastic_rounding"}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")  # TrainConfig.compile_mode: torch.compile's modes


_SAME_BATCHES = "changes the tokens per step and the batches the run sees from here"
_SCHEDULE = "changes the learning-rate schedule"
_MODEL_HELP, _PRESET_HELP = "model size: " + ", ".join(SIZES), "precision preset: " + ", ".join(PRESETS)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. Each field is a `setting`: its help, group, flag and resume rule are in its metadata
    (`minifloat train --help` prints them, grouped).

    A resumed run (resume=True) continues out/ckpt: the checkpoint's model, preset and "fixed" settings must be this
    config's, and steps must exceed its step (`check_resume`). `TrainConfig.resuming(out, **given)` builds that
    config the way `minifloat train --resume` does: every setting not given is the checkpoint's, except the "fresh"
    ones (out, device, compile, lr_decay_steps, ...).
    """

    model: str = setting("tiny", _MODEL_HELP, group="model and data")
    preset: str = setting("bf16", _PRESET_HELP, group="precision")
    steps: int = setting(200, "optimizer steps to run up to (a resumed run continues from the checkpoint's step)",
                         group="optimizer and schedule")
    batch_size: int = setting(16, "sequences per (micro-)batch", group="model and data", resume="fixed",
                              why=_SAME_BATCHES)
    seq_len: int = setting(64, "tokens per sequence (bytes of text by default; at most the model's max_seq_len)",
                           group="model and data",
                           resume="fixed", why=_SAME_BATCHES)
    # nanoGPT's baby-GPT value; docs/benchmarks.md shows FP8 tracking BF16 less closely at 3e-3
    lr: float = setting(1e-3, "peak learning rate; given alone, the cosine floor --min-lr follows as lr/10",
                        group="optimizer and schedule", resume="fixed", why=_SCHEDULE)
    min_lr: float = setting(1e-4, "floor of the cosine decay (at most --lr)", group="optimizer and schedule",
                            resume="fixed", why=_SCHEDULE)
    warmup: int = setting(20, "steps of linear learning-rate warm-up", group="optimizer and schedule",
                          resume="fixed", why=_SCHEDULE)
    lr_decay_steps: int | None = setting(
        None, "step at which the cosine reaches --min-lr (default: --steps). Set it when a run is cut short on "
              "purpose and resumed later, so both halves follow one schedule; on --resume a new value re-plans the "
              "rest of the decay from the lr reached, never upwards", group="optimizer and schedule",
        resume="fresh", metavar="N")
    weight_decay: float = setting(0.1, "AdamW weight decay of matrices and embeddings (none on norms)",
                                  group="optimizer and schedule")
    grad_clip: float = setting(1.0, "gradient L2 norm limit", group="optimizer and schedule")
    eval_every: int = setting(50, "steps between validation passes (one more at the end)", group="run")
    eval_batches: int = setting(8, "validation batches per pass", group="run")
    seed: int = setting(0, "seed for the weights and the batch order", group="model and data", resume="fixed",
                        why="changes the order of the batches")
    out: str = setting("runs/train", "output folder: log.csv, val.csv, ckpt/, run.json, tensorboard/. A folder that "
                                     "holds a run is refused unless --resume or --overwrite", group="run",
                       resume="fresh")
    data: str | None = setting(None, "folder of text files, or token shards: a .bin file or a folder of them, "
                                     "memory-mapped (default: the Python standard library's sources)",
                               group="model and data")
    max_bytes: int | None = setting(2_000_000, "cap on the corpus bytes, train + val, of a folder of text files "
                                               "(token shards are memory-mapped, never capped)", group="model and data")
    tokenizer: str | None = setting(
        None, "tokenizer.json of Hugging Face tokenizers that turns the --data text into tokens; the model's "
              "vocabulary is the tokenizer's (default: bytes, 256 ids; token shards name their own)",
        group="model and data", resume="fixed", why="changes the tokens the model reads", absent=None,
        metavar="FILE")
    attention: str = setting(
        "auto", "how attention computes softmax(QKᵀ/√d)·V: sdpa (torch's scaled_dot_product_attention: flash or "
                "cuDNN kernels that keep the softmax and the accumulation in fp32 inside, never storing the T×T "
                "scores), fp32 (explicit fp32 scores, softmax and scores·V) or auto (sdpa on CUDA, fp32 elsewhere)",
        group="precision", choices=ATTENTIONS)
    checkpoint_every: int = setting(100, "steps between checkpoints into OUT/ckpt (one more at the end), 0 for none",
                                    group="run")
    resume: bool = setting(False, "continue the run in OUT from OUT/ckpt: settings not given keep the checkpoint's "
                                  "values, and --steps must go beyond its step", group="run", resume="fresh")
    fp8_format: str | None = setting(
        None, "FP8 formats of the delayed recipe: hybrid (E4M3 forward, E5M2 gradients) or e4m3 (needs "
              "fp8-delayed; default: the preset's)", group="precision", resume="fixed",
        why="changes the FP8 formats the scaling state was built for", choices=("hybrid", "e4m3"))
    fp8_amax_history_len: int | None = setting(
        None, "steps of amax history of the delayed recipe (needs fp8-delayed)", group="precision",
        resume="fixed", why="changes the shape of the FP8 amax histories", metavar="N")
    fp8_margin: int | None = setting(None, "scale = fp8_max / amax / 2^N: N bits of headroom (needs fp8-delayed)",
                                     group="precision", resume="fixed", why="changes the FP8 scales", metavar="N")
    nan_steps: tuple[int, ...] = setting(
        (), "fault injection: comma list of steps whose loss is made NaN, to try the guards (batch groups: once a "
            "rollback skipped batches, the poison stays with its batches)", group="safety nets", metavar="S,S")
    shadow_every: int = setting(
        0, f"every N steps, run the batch in FP8 and in BF16 and compare the losses; {ShadowConfig().patience} "
           f"unhealthy checks in a row move the run to BF16, {ShadowConfig().recover_after} healthy ones back to "
           f"FP8; 0 for off (needs an FP8 preset)", group="safety nets", metavar="N")
    shadow_threshold: float = setting(ShadowConfig().threshold, "largest healthy relative loss difference "
                                      "|fp8 - bf16| / bf16 of a shadow check", group="safety nets", metavar="X")
    rollback_after: int = setting(0, "after N skipped steps in a row, restore the last in-memory snapshot and "
                                     "continue past the bad batches; 0 for off", group="safety nets", metavar="N")
    snapshot_every: int = setting(50, "steps between the in-memory rollback snapshots", group="safety nets",
                                  metavar="N")
    embedding_grad_alpha: float = setting(
        1.0, "multiply the gradient into the token embedding's output by A in (0, 1] (GLM-130B: 0.1); 1 for off",
        group="safety nets", metavar="A")
    compile: bool = setting(False, "run the training forward and backward under torch.compile (the first steps "
                                   "compile; evaluation and checks stay eager)", group="parallelism and device",
                            resume="fresh")
    compile_mode: str = setting(
        "default", "torch.compile's mode with --compile: default, reduce-overhead (CUDA graphs: for small steps, "
                   "where launching kernels costs more than running them) or max-autotune",
        group="parallelism and device", resume="fresh", choices=COMPILE_MODES)
    grad_accum: int = setting(1, "micro-batches of --batch-size per optimizer step; FP8 scales advance once per "
                                 "step", group="model and data", resume="fixed", why=_SAME_BATCHES, metavar="K")
    overwrite: bool = setting(False, "replace the run in OUT (only the files a run writes there are removed)",
                              group="run", resume="fresh")
    device: str = setting("auto", "auto (a CUDA GPU when torch sees one, else the CPU), cpu, cuda or cuda:N; meta "
                                  "for shapes only", group="parallelism and device", resume="fresh")
    nproc: int = setting(1, "train on N processes of this machine (torchrun; gloo on CPU, NCCL on GPU), each on "
                            "--grad-accum micro-batches of every step; logs, progress and checkpoints come from "
                            "rank 0", group="parallelism and device", metavar="N")
    parallel: str | None = setting(
        None, "how the ranks hold the model: ddp (replicated), fsdp (sharded, FSDP2, FP8 weights gathered in FP8) "
              "or fsdp+tp (tensor/sequence parallel in groups of --tp-size ranks, FSDP2 across them); default ddp "
              "when --nproc is above 1", group="parallelism and device", choices=tuple(PARALLEL))
    tp_size: int = setting(2, "ranks per tensor-parallel group with --parallel fsdp+tp; must divide --nproc and "
                              "--seq-len", group="parallelism and device", metavar="T")
    optimizer_state: str = setting(
        "fp32,fp32", "formats of AdamW's two moments M,V, stored per block of 128: fp32, bf16, e4m3, e5m2, int8, "
                     "int8-dynamic or int4 each (e.g. e4m3,bf16: 3 B/param instead of 8; norms, embeddings and small "
                     "tensors keep fp32)", group="optimizer and schedule", resume="fixed",
        why="changes how the optimizer state is stored", metavar="M,V")
    master: str = setting(
        "fp32", "how the weights outside the fp32 norms, embeddings and head keep small updates: "
                + "; ".join(f"{mode}: {text}" for mode, text in MASTER_HELP.items())
                + ". The bf16 modes halve the gradients too, need a bf16-computing preset and --nproc 1",
        group="precision", resume="fixed", why="changes the weights' dtype and how updates reach them",
        absent="fp32", metavar="MODE")
    bf16_tail: float = setting(
        0.0, "run the FP8/FP4 layers in BF16 for the last fraction F of --steps (NVIDIA's late switch for NVFP4; "
             "needs an fp8 or fp4 preset)", group="precision", resume="fixed", why="changes which steps run in BF16",
        absent=0.0, metavar="F")
    nvfp4_weight_2d: bool | None = setting(
        None, "16×16 weight tiles, so that dgrad's Wᵀ holds the forward's numbers: on (the nvfp4 preset's default) "
              "or off, for ablations (needs --preset nvfp4)", group="precision", resume="fixed",
        why="changes how the NVFP4 weights are quantized", absent=None, on_off=True)
    nvfp4_rht: bool | None = setting(
        None, "the random Hadamard transform of the wgrad operands: on (the nvfp4 preset's default) or off, for "
              "ablations (needs --preset nvfp4)", group="precision", resume="fixed",
        why="changes the NVFP4 weight gradients' quantization", absent=None, on_off=True)
    nvfp4_stochastic_rounding: bool | None = setting(
        None, "stochastic rounding of the gradients: on (the nvfp4 preset's default) or off, for ablations (needs "
              "--preset nvfp4)", group="precision", resume="fixed", why="changes how the NVFP4 gradients are rounded",
        absent=None, on_off=True)
    keep_blocks: str | None = setting(
        None, "keep the linear layers of the first FIRST and last LAST transformer blocks in BF16 under an fp8 or "
              "fp4 preset; each a count or a fraction of the blocks below 1, rounded up (0,0.15 keeps the last 15%) "
              "(default: the preset's; nvfp4 and mxfp4 keep the last block: 0,1)", group="precision",
        resume="fixed", why="changes which layers run in low precision", absent=None, metavar="FIRST,LAST")

    def __post_init__(self):
        # typed forms accepted: keep_blocks=(0, 1), optimizer_state=("e4m3", "bf16"); stored as their flag spelling,
        # which checkpoints record (JSON) and resumes compare
        for name in ("keep_blocks", "optimizer_state"):
            value = getattr(self, name)
            if isinstance(value, tuple):
                object.__setattr__(self, name, ",".join(str(v) for v in value))
        check_choice("model", self.model, list(SIZES))
        check_choice("preset", self.preset, list(PRESETS))
        for field, low in (("steps", 1), ("batch_size", 1), ("seq_len", 1), ("warmup", 0), ("eval_every", 1),
                           ("eval_batches", 1), ("seed", 0), ("checkpoint_every", 0), ("shadow_every", 0),
                           ("rollback_after", 0), ("snapshot_every", 1), ("grad_accum", 1), ("nproc", 1)):
            check_int(field, getattr(self, field), low=low)
        if self.seq_len > SIZES[self.model].max_seq_len:
            raise ValueError(f"seq_len must be <= {SIZES[self.model].max_seq_len} (max_seq_len of model "
                             f"{self.model!r}), got {self.seq_len!r}")
        check_int("lr_decay_steps", self.lr_decay_steps, low=1, allow_none=True)
        check_number("lr", self.lr, low=0.0, low_open=True)
        check_number("min_lr", self.min_lr, low=0.0, high=self.lr)
        check_number("weight_decay", self.weight_decay, low=0.0)
        check_number("grad_clip", self.grad_clip, low=0.0, low_open=True)
        if not isinstance(self.out, str) or not self.out:
            raise ValueError(f"out must be a non-empty path string, got {self.out!r}")
        if self.data is not None and (not isinstance(self.data, str) or not self.data):
            raise ValueError(f"data must be a non-empty path string or None, got {self.data!r}")
        check_int("max_bytes", self.max_bytes, low=2, allow_none=True)
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise ValueError(f"tokenizer must be a path to a tokenizer.json or None, got {self.tokenizer!r}")
        check_choice("attention", self.attention, list(ATTENTIONS))
        check_bool("resume", self.resume)
        check_bool("overwrite", self.overwrite)
        if self.resume and self.overwrite:
            raise ValueError("resume continues the run in out and overwrite replaces it: choose one")
        if not isinstance(self.device, str) or not DEVICE_PATTERN.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda, cuda:N or meta, got {self.device!r}")
        if not isinstance(self.nan_steps, tuple):
            raise ValueError(f"nan_steps must be a tuple of step numbers, got {self.nan_steps!r}")
        for s in self.nan_steps:
            check_int("nan_steps", s, low=0)
        check_number("shadow_threshold", self.shadow_threshold, low=0.0, low_open=True)
        check_number("embedding_grad_alpha", self.embedding_grad_alpha, low=0.0, high=1.0, low_open=True)
        check_bool("compile", self.compile)
        check_choice("compile_mode", self.compile_mode, list(COMPILE_MODES))
        check_choice("parallel", self.parallel, [None, *PARALLEL])
        if self.nproc > 1 and self.parallel is None:
            raise ValueError(f"nproc={self.nproc} ranks need parallel ddp or fsdp, got parallel=None")
        check_int("tp_size", self.tp_size, low=2)
        formats = [f.value for f in StateFormat]
        if (not isinstance(self.optimizer_state, str) or len(self.state_formats) != 2
                or any(f not in formats for f in self.state_formats)):
            raise ValueError(f"optimizer_state must be two formats M,V (the moments of AdamW), each one of "
                             f"{', '.join(formats)}; got {self.optimizer_state!r}")
        self._check_master()
        if self.parallel == "fsdp+tp":
            for name, value in (("nproc", self.nproc), ("seq_len", self.seq_len)):
                if value % self.tp_size:
                    raise ValueError(f"fsdp+tp splits {name} over tensor-parallel groups of --tp-size "
                                     f"{self.tp_size} ranks, but {name} is {value}: choose a --tp-size dividing it")
        recipe = PRESETS[self.preset].recipe
        check_number("bf16_tail", self.bf16_tail, low=0.0, high=1.0, high_open=True)
        if self.bf16_tail and recipe is None:
            raise ValueError(f"bf16_tail switches the FP8/FP4 layers to BF16 late in training, but preset "
                             f"{self.preset!r} has none; use an fp8 or fp4 preset or bf16_tail=0, got "
                             f"bf16_tail={self.bf16_tail!r}")
        if self.shadow_every and recipe is None:
            raise ValueError(f"shadow_every checks FP8 against BF16, but preset {self.preset!r} has no FP8 recipe; "
                             f"use an fp8 preset or shadow_every=0, got shadow_every={self.shadow_every!r}")
        for field in ("fp8_format", "fp8_amax_history_len", "fp8_margin"):
            if getattr(self, field) is not None and not (recipe is not None and recipe.delayed):
                raise ValueError(f"{field} overrides a DelayedScaling recipe, but preset {self.preset!r} has "
                                 f"{type(recipe).__name__ if recipe else 'no FP8 recipe'}; use fp8-delayed")
        for field in NVFP4_OVERRIDES:
            value = getattr(self, field)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{field} must be True, False or None, got {value!r}")
            if value is not None and not isinstance(recipe, NVFP4Scaling):
                raise ValueError(f"{field} overrides an NVFP4Scaling recipe, but preset {self.preset!r} has "
                                 f"{type(recipe).__name__ if recipe else 'no low-precision recipe'}; use nvfp4")
        if self.keep_blocks is not None:
            self.blocks_kept  # "FIRST,LAST" parses: a malformed value is named before the preset is judged
            if recipe is None:
                raise ValueError(f"keep_blocks {self.keep_blocks!r} keeps transformer blocks out of a low-precision "
                                 f"recipe, but preset {self.preset!r} has none; use an fp8 or fp4 preset")
        self.policy()  # DelayedScaling validates the overridden values

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

    def _check_master(self) -> None:
        if not isinstance(self.master, str) or self.master not in MASTER_UPDATES:
            raise ValueError(f"master must be one of {', '.join(MASTER_UPDATES)}, got {self.master!r}")
        if self.master == "fp32":
            return
        compute = PRESETS[self.preset].compute_dtype
        if compute != torch.bfloat16:
            raise ValueError(f"master {self.master} stores bf16 weights, which need a preset that computes in bf16 "
                             f"(bf16 or an fp8 one), but preset {self.preset!r} computes in "
                             f"{str(compute).removeprefix('torch.')}; use --master fp32 or another --preset")
        if self.nproc > 1:
            raise ValueError(f"master {self.master} trains in one process: sharded checkpoints cannot store its "
                             f"{'generator' if self.master == 'bf16-sr' else 'compensation'} state yet; got "
                             f"nproc={self.nproc}, use --nproc 1 or --master fp32")

    def policy(self) -> PrecisionPolicy:
        """The preset's policy with the fp8_* overrides applied to its DelayedScaling recipe, the nvfp4_* ones to
        its NVFP4Scaling recipe, keep_blocks, and the weights `master` asks for (bf16 parameters outside the fp32
        islands for the bf16 modes)."""
        policy = master_policy(PrecisionPolicy.preset(self.preset), self.master)
        if self.keep_blocks is not None:
            policy = dataclasses.replace(policy, keep_blocks=self.blocks_kept)
        fp8 = {name: value for name, value in (("format", self.fp8_format), ("margin", self.fp8_margin),
                                               ("amax_history_len", self.fp8_amax_history_len)) if value is not None}
        if fp8:
            try:
                policy = dataclasses.replace(policy, recipe=dataclasses.replace(policy.recipe, **fp8))
            except ValueError as err:
                raise ValueError(f"fp8_{str(err)}") from None  # DelayedScaling names its field: "margin must be ..."
        nvfp4 = {field: getattr(self, name) for name, field in NVFP4_OVERRIDES.items()
                 if getattr(self, name) is not None}
        if nvfp4:
            policy = dataclasses.replace(policy, recipe=dataclasses.replace(policy.recipe, **nvfp4))
        return policy

    @property
    def blocks_kept(self) -> tuple[int | float, int | float]:
        """keep_blocks as (first, last), the preset's when None; ValueError naming the field when malformed."""
        if self.keep_blocks is None:
            return PRESETS[self.preset].keep_blocks
        parts = self.keep_blocks.split(",") if isinstance(self.keep_blocks, str) else []
        error = ValueError(f"keep_blocks must be 'FIRST,LAST', {KEEP_BLOCKS_RULE}, such as '0,1' or '0,0.15', "
                           f"got {self.keep_blocks!r}")
        try:
            values = tuple(int(p) if p.strip().isdigit() else float(p) for p in parts)
            return check_keep_blocks(values if len(values) == 2 else None)
        except ValueError:
            raise error from None

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
        return tuple(f.strip() for f in str(self.optimizer_state).split(","))

    @property
    def data_ranks(self) -> int:
        """Ranks training on different batches (TrainConfig fields as a dict: `data_ranks(asdict(config))`)."""
        return data_ranks(dataclasses.asdict(self))

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
                                 f"which {ranks} data ranks cannot split evenly: resume with --nproc "
                                 f"{saved.get('nproc', 1)}")
        for field, consequence in RESUME_FIXED:
            if field == "grad_accum" and saved_ranks != ranks:
                continue  # checked above, as micro-batches per step
            was = saved.get(field, RESUME_ABSENT.get(field, getattr(self, field)))  # absent: not checkable
            if was != getattr(self, field):
                flag = "--" + field.replace("_", "-")
                raise ValueError(f"the checkpoint at {where} was trained with {flag} {was}, this run asks for "
                                 f"{getattr(self, field)}: that {consequence}, so it would not continue the same run; "
                                 f"resume with {flag} {was}, or start a new run elsewhere")
        if self.steps <= saved_step:
            raise ValueError(f"--steps {self.steps}: the checkpoint at {where} is already at step {saved_step}; pass "
                             f"--steps above {saved_step} to train on")


SETTINGS = {f.name: f for f in dataclasses.fields(TrainConfig)}
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
        inherited = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()
                     if k in SETTINGS and k not in NOT_INHERITED}
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
