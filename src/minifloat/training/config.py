"""TrainConfig: one training run of the reference Llama, validated as a whole when built."""

from __future__ import annotations

import dataclasses
import re

import torch

from minifloat.amp.policy import PRESETS, PrecisionPolicy
from minifloat.fp8.convert import KEEP_BLOCKS_RULE, check_keep_blocks
from minifloat.fp8.recipes import NVFP4Scaling
from minifloat.numerics.stateformats import StateFormat
from minifloat.core.validate import check_bool, check_choice, check_int, check_number
from minifloat.safety.shadow import ShadowConfig
from minifloat.training.parallel import Parallel
from minifloat.training.model import SIZES
from minifloat.training.optimizer import MASTER_UPDATES, master_policy

PARALLEL = [p.value for p in Parallel]  # TrainConfig.parallel
DEVICE_PATTERN = re.compile(r"auto|cpu|meta|cuda(:\d+)?")  # TrainConfig.device
# fields a resumed run must share with its checkpoint, and what a change would do (TrainConfig.check_resume)
RESUME_FIXED = (
    ("batch_size", "changes the tokens per step and the batches the run sees from here"),
    ("seq_len", "changes the tokens per step and the batches the run sees from here"),
    ("grad_accum", "changes the tokens per step and the batches the run sees from here"),
    ("seed", "changes the order of the batches"),
    ("fp8_format", "changes the FP8 formats the scaling state was built for"),
    ("fp8_amax_history_len", "changes the shape of the FP8 amax histories"),
    ("fp8_margin", "changes the FP8 scales"),
    ("lr", "changes the learning-rate schedule"),
    ("min_lr", "changes the learning-rate schedule"),
    ("warmup", "changes the learning-rate schedule"),
    ("optimizer_state", "changes how the optimizer state is stored"),
    ("master", "changes the weights' dtype and how updates reach them"),
    ("bf16_tail", "changes which steps run in BF16"),
    ("nvfp4_weight_2d", "changes how the NVFP4 weights are quantized"),
    ("nvfp4_rht", "changes the NVFP4 weight gradients' quantization"),
    ("nvfp4_stochastic_rounding", "changes how the NVFP4 gradients are rounded"),
    ("keep_blocks", "changes which layers run in low precision"),
)
# RESUME_FIXED fields added after checkpoints were written without them: the value such a checkpoint ran with
RESUME_ABSENT = {"master": "fp32", "bf16_tail": 0.0, "nvfp4_weight_2d": None, "nvfp4_rht": None,
                 "nvfp4_stochastic_rounding": None, "keep_blocks": None}
# TrainConfig's NVFP4 overrides and the NVFP4Scaling field each replaces
NVFP4_OVERRIDES = {"nvfp4_weight_2d": "weight_2d", "nvfp4_rht": "rht",
                   "nvfp4_stochastic_rounding": "stochastic_rounding"}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run.

    Args:
        model: model size, a key of minifloat.training.model.SIZES ("tiny", "small", "10m", "100m").
        preset: precision preset, a key of minifloat.amp.policy.PRESETS ("bf16", "fp8-delayed", ...).
        steps: optimizer steps to run up to (a resumed run continues from the checkpoint's step to this).
        batch_size, seq_len: B and T of each (micro-)batch; seq_len <= the model's max_seq_len.
        grad_accum: micro-batches per optimizer step (gradient accumulation): each step trains on grad_accum ×
            batch_size sequences, and the FP8 scales advance once per step, not per micro-batch.
        lr, min_lr: peak learning rate and the floor of the cosine decay (min_lr <= lr).
        warmup: steps of linear warm-up.
        lr_decay_steps: step at which the cosine reaches min_lr; None means `steps` (nanoGPT's lr_decay_iters).
            Set it when a run is cut short on purpose and resumed later, so both halves follow one schedule. On
            resume, None keeps the checkpoint's schedule (an extended run stays at min_lr past the old decay end);
            a value different from the checkpoint's re-plans the decay from the lr reached down to min_lr at that
            step, never upwards (minifloat.training.schedule).
        weight_decay: AdamW decay of matrices and embeddings (none on norms).
        grad_clip: gradient L2 norm limit.
        eval_every: steps between validation passes (one more at the end); eval_batches: batches per pass.
        seed: seeds the weights and the batch order.
        out: output folder (log.csv, val.csv, ckpt/, run.json, tensorboard/). A folder that holds a run is refused
            unless `resume` or `overwrite` is set (minifloat.training.rundir).
        data: folder of text files; None for the Python standard library's sources.
        max_bytes: cap on the corpus bytes (train + val); None for no cap.
        checkpoint_every: steps between checkpoints into out/ckpt (one more at the end); 0 for none.
        resume: continue from out/ckpt. The checkpoint's model, preset, batch_size, seq_len, grad_accum and seed
            must be this config's (anything else would not continue the same run), and steps must exceed its step.
        overwrite: replace the run in `out`: the files a run writes there are removed first, nothing else.
        device: "auto" (CUDA when available, else CPU), "cpu", "cuda", "cuda:N", or "meta" (shapes only, for
            tests: it cannot train). Autocast and the FP8 GEMM backend follow the device (native FP8 GEMMs on
            GPUs that have them).
        fp8_format, fp8_amax_history_len, fp8_margin: override the preset's DelayedScaling recipe (Megatron-LM's
            --fp8-format / --fp8-amax-history-len / --fp8-margin); None keeps the preset's value.
        nan_steps: fault injection for testing the guards: the loss of these batch groups is multiplied by NaN, so
            their gradients are NaN too. Group k (the grad_accum micro-batches k·grad_accum, ...) is step k's until a
            rollback skips batches (so a rolled-back run does not meet the same poison again). Leave empty outside
            tests.
        shadow_every: run the FP8-vs-BF16 shadow check (minifloat.safety.shadow) every N steps, falling back to
            BF16 after
            ShadowConfig().patience unhealthy checks in a row and returning to FP8 after recover_after healthy ones;
            0 turns it off. Needs a preset with an FP8 recipe.
        shadow_threshold: largest healthy relative loss difference |L_fp8 - L_bf16| / |L_bf16| of a check.
        rollback_after: skipped steps in a row that roll the run back to the last in-memory snapshot and on past
            the bad batches (PaLM, minifloat.safety.guards); 0 turns rollback off.
        snapshot_every: steps between rollback snapshots (used when rollback_after > 0).
        embedding_grad_alpha: multiplier of the gradient flowing into the token embedding's output, in (0, 1]
            (GLM-130B's embedding gradient shrink uses 0.1); 1 turns it off. With tied embeddings the lm_head's
            gradient of the shared matrix is not shrunk.
        compile: run the training forward and backward under torch.compile (evaluation and checks stay eager).
        nproc: processes (ranks) training together, each on grad_accum micro-batches of every step, so a step trains
            on nproc × grad_accum × batch_size sequences (minifloat.training.parallel); 1 is one plain process.
        parallel: how the ranks hold the model: "ddp" (replicated, DistributedDataParallel), "fsdp" (sharded,
            FSDP2's fully_shard) or "fsdp+tp" (tensor/sequence parallel in groups of tp_size ranks, FSDP2 across the
            groups: a (nproc / tp_size, tp_size) mesh); None for one plain process. Needs torchrun (`minifloat train
            --nproc N` starts it). A checkpoint continues on any nproc and parallel with the same data ranks ×
            grad_accum (data ranks: nproc, or nproc / tp_size for fsdp+tp).
        tp_size: ranks per tensor-parallel group under "fsdp+tp" (they train on the same tokens); ignored otherwise.
        optimizer_state: "M,V", the formats AdamW stores its two moments in (minifloat.optim.StateFormat: fp32,
            bf16, e4m3, e5m2, int8, int8-dynamic, int4), per block of 128 with fp32 scales; norms, embeddings and
            tensors under 4096 elements keep fp32 state. "fp32,fp32" is torch.optim.AdamW itself.
        master: how the weights keep small updates (minifloat.training.optimizer): "fp32" (fp32 parameters, their
            own master), "bf16-sr" (bf16 parameters updated by stochastic rounding, no fp32 copy) or "bf16-kahan"
            (bf16 parameters and a bf16 Kahan compensation buffer). Norms, embeddings and the head stay fp32 (the
            policy's islands). The bf16 modes need a preset that computes in bf16 and one process (nproc 1).
        bf16_tail: the fraction of `steps` at the end that run the FP8/FP4 layers in BF16 (mf.autocast(enabled=
            False)), evaluation included: NVIDIA's late switch (arXiv 2509.25149 Appendix D) narrowed NVFP4's loss
            gap to BF16 from about 1.5% to 0.5%. From step `bf16_tail_start` on; 0 for none. Needs a preset with a
            recipe.
        nvfp4_weight_2d, nvfp4_rht, nvfp4_stochastic_rounding: override the nvfp4 preset's NVFP4Scaling fields of
            those names (ablations: each of arXiv 2509.25149's fixes on or off); None keeps the preset's value.
        keep_blocks: "FIRST,LAST": the linear layers of the first FIRST and last LAST transformer blocks stay in
            BF16 (PrecisionPolicy.keep_blocks); each a count or a fraction of the blocks below 1 ("0,0.15" keeps the
            last 15%, rounded up); None keeps the preset's (nvfp4 and mxfp4 keep the last block).
    """

    model: str = "tiny"
    preset: str = "bf16"
    steps: int = 200
    batch_size: int = 16
    seq_len: int = 64
    lr: float = 1e-3  # nanoGPT's baby-GPT value; docs/benchmarks.md shows FP8 tracking BF16 less closely at 3e-3
    min_lr: float = 1e-4
    warmup: int = 20
    lr_decay_steps: int | None = None
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 8
    seed: int = 0
    out: str = "runs/train"
    data: str | None = None
    max_bytes: int | None = 2_000_000
    checkpoint_every: int = 100
    resume: bool = False
    fp8_format: str | None = None
    fp8_amax_history_len: int | None = None
    fp8_margin: int | None = None
    nan_steps: tuple[int, ...] = ()
    shadow_every: int = 0
    shadow_threshold: float = ShadowConfig().threshold
    rollback_after: int = 0
    snapshot_every: int = 50
    embedding_grad_alpha: float = 1.0
    compile: bool = False
    grad_accum: int = 1
    overwrite: bool = False
    device: str = "auto"
    nproc: int = 1
    parallel: str | None = None
    tp_size: int = 2
    optimizer_state: str = "fp32,fp32"
    master: str = "fp32"
    bf16_tail: float = 0.0
    nvfp4_weight_2d: bool | None = None
    nvfp4_rht: bool | None = None
    nvfp4_stochastic_rounding: bool | None = None
    keep_blocks: str | None = None

    def __post_init__(self):
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
            if recipe is None:
                raise ValueError(f"keep_blocks keeps transformer blocks out of a low-precision recipe, but preset "
                                 f"{self.preset!r} has none; use an fp8 or fp4 preset")
            self.blocks_kept  # "FIRST,LAST" parses
        self.policy()  # DelayedScaling validates the overridden values

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


def data_ranks(config: dict) -> int:
    """The ranks of a run (a TrainConfig as a dict, e.g. a checkpoint's) that train on different batches: nproc, or
    nproc / tp_size under fsdp+tp, whose tensor-parallel groups share their tokens."""
    nproc = config.get("nproc", 1)
    return nproc // config.get("tp_size", 2) if config.get("parallel") == "fsdp+tp" else nproc
