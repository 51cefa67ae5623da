"""Train the reference Llama on the byte corpus under a precision policy: one plain loop, nanoGPT-style.

    result = train(TrainConfig(model="tiny", preset="fp8-delayed", steps=200, out="runs/a"))
    result.losses, result.val_losses, result.skipped

Every step: batch k of the hashed loader, (every `shadow_every` steps) the FP8-vs-BF16 shadow check, forward under
the policy's autocast and the shadow's mode, scaled backward, unscale, the guard's verdict (non-finite / spike → the
update is skipped; `rollback_after` skips in a row → back to the last snapshot, past the bad batches), clip, step,
scaler update. The learning rate is a pure function of the step (linear warm-up, cosine decay to min_lr), so a run
resumed from `out/ckpt` continues bitwise where the uninterrupted run would be: model, optimizer, scaler, guard,
shadow mode, loader position and RNG are all in the checkpoint. (Rollback snapshots live in memory only: a resumed
run takes its first one at the step it resumes from.)

Outputs under `out/`: log.csv (one row per step run; a rollback re-runs steps, so their numbers repeat), val.csv (one
row per evaluation), ckpt/ (latest checkpoint) and, if tensorboard is installed, TensorBoard event files.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import math
import pathlib
import time

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from minifloat.amp.policy import PRESETS, PrecisionPolicy
from minifloat.amp.scaler import LossScaler
from minifloat.core.validate import check_bool, check_choice, check_int, check_number
from minifloat.fp8.modules import autocast
from minifloat.safety.guards import GuardConfig, StepGuard
from minifloat.safety.shadow import Mode, ShadowCheck, ShadowConfig
from minifloat.safety.stability import StabilityConfig
from minifloat.training.checkpoint import load_checkpoint, save_checkpoint
from minifloat.training.data import BatchLoader, ByteCorpus, DataConfig, val_batches
from minifloat.training.model import SIZES, Llama, LlamaConfig

log = logging.getLogger("minifloat")

# mode: "fp8" or "bf16" (the shadow check's fallback) for presets with an FP8 recipe, "" for the others
LOG_FIELDS = ("step", "loss", "lr", "grad_norm", "skipped", "reason", "tokens_per_s", "mode")
CHECKPOINT_DIR = "ckpt"
ADAMW_BETAS = (0.9, 0.95)  # nanoGPT / Llama; beta2 = 0.95 reacts faster to the gradient growth of low precision


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run.

    Args:
        model: model size, a key of minifloat.training.model.SIZES ("tiny", "small", "10m", "100m").
        preset: precision preset, a key of minifloat.amp.policy.PRESETS ("bf16", "fp8-delayed", ...).
        steps: optimizer steps to run up to (a resumed run continues from the checkpoint's step to this).
        batch_size, seq_len: B and T of each batch; seq_len <= the model's max_seq_len.
        lr, min_lr: peak learning rate and the floor of the cosine decay (min_lr <= lr).
        warmup: steps of linear warm-up.
        lr_decay_steps: step at which the cosine reaches min_lr; None means `steps` (nanoGPT's lr_decay_iters).
            Set it when a run is cut short on purpose and resumed later, so both halves follow one schedule.
        weight_decay: AdamW decay of matrices and embeddings (none on norms).
        grad_clip: gradient L2 norm limit.
        eval_every: steps between validation passes (one more at the end); eval_batches: batches per pass.
        seed: seeds the weights and the batch order.
        out: output folder (log.csv, val.csv, ckpt/).
        data: folder of text files; None for the Python standard library's sources.
        max_bytes: cap on the corpus bytes (train + val); None for no cap.
        checkpoint_every: steps between checkpoints into out/ckpt (one more at the end); 0 for none.
        resume: continue from out/ckpt.
        fp8_format, fp8_amax_history_len, fp8_margin: override the preset's DelayedScaling recipe (Megatron-LM's
            --fp8-format / --fp8-amax-history-len / --fp8-margin); None keeps the preset's value.
        nan_steps: fault injection for testing the guards: the loss on these batches is multiplied by NaN, so their
            gradients are NaN too. Batch k is step k's until a rollback skips batches (so a rolled-back run does not
            meet the same poison again). Leave empty outside tests.
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

    def __post_init__(self):
        check_choice("model", self.model, list(SIZES))
        check_choice("preset", self.preset, list(PRESETS))
        for field, low in (("steps", 1), ("batch_size", 1), ("seq_len", 1), ("warmup", 0), ("eval_every", 1),
                           ("eval_batches", 1), ("seed", 0), ("checkpoint_every", 0), ("shadow_every", 0),
                           ("rollback_after", 0), ("snapshot_every", 1)):
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
        if not isinstance(self.nan_steps, tuple):
            raise ValueError(f"nan_steps must be a tuple of step numbers, got {self.nan_steps!r}")
        for s in self.nan_steps:
            check_int("nan_steps", s, low=0)
        check_number("shadow_threshold", self.shadow_threshold, low=0.0, low_open=True)
        check_number("embedding_grad_alpha", self.embedding_grad_alpha, low=0.0, high=1.0, low_open=True)
        check_bool("compile", self.compile)
        recipe = PRESETS[self.preset].recipe
        if self.shadow_every and recipe is None:
            raise ValueError(f"shadow_every checks FP8 against BF16, but preset {self.preset!r} has no FP8 recipe; "
                             f"use an fp8 preset or shadow_every=0, got shadow_every={self.shadow_every!r}")
        for field in ("fp8_format", "fp8_amax_history_len", "fp8_margin"):
            if getattr(self, field) is not None and not (recipe is not None and recipe.delayed):
                raise ValueError(f"{field} overrides a DelayedScaling recipe, but preset {self.preset!r} has "
                                 f"{type(recipe).__name__ if recipe else 'no FP8 recipe'}; use fp8-delayed")
        self.policy()  # DelayedScaling validates the overridden values

    def policy(self) -> PrecisionPolicy:
        """The preset's policy with the fp8_* overrides applied to its DelayedScaling recipe."""
        policy = PrecisionPolicy.preset(self.preset)
        overrides = {name: value for name, value in (("format", self.fp8_format), ("margin", self.fp8_margin),
                                                     ("amax_history_len", self.fp8_amax_history_len))
                     if value is not None}
        if not overrides:
            return policy
        try:
            recipe = dataclasses.replace(policy.recipe, **overrides)
        except ValueError as err:
            raise ValueError(f"fp8_{str(err)}") from None  # DelayedScaling names its field: "margin must be ..."
        return dataclasses.replace(policy, recipe=recipe)


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a run did.

    Attributes:
        first_step: the step this call started at (0, or the checkpoint's step when resuming).
        losses: training loss of each step run in this call, in the order run (skipped steps included, NaN where
            poisoned; steps re-run after a rollback appear again).
        final_loss: loss of the last step whose update was applied (NaN if none was).
        val_losses: (step, mean validation loss) per evaluation, step counted after the update.
        tokens_per_s: trained tokens / time spent in training steps (evaluation and checkpoints excluded).
        skipped: (step, reason) of each step the guard skipped.
        shadow_events: (step, mode switched to, reason) of every shadow switch in this call, recoveries included.
        rollbacks: (step, restored step, batches skipped) of each rollback in this call.
        level_shifts: steps the guard applied as a level shift after a run of spike skips (GuardConfig.spike_max_skips).
    """

    first_step: int
    losses: tuple[float, ...]
    final_loss: float
    val_losses: tuple[tuple[int, float], ...]
    tokens_per_s: float
    skipped: tuple[tuple[int, str], ...]
    shadow_events: tuple[tuple[int, str, str], ...] = ()
    rollbacks: tuple[tuple[int, int, int], ...] = ()
    level_shifts: tuple[int, ...] = ()

    @property
    def fallbacks(self) -> tuple[tuple[int, str], ...]:
        """(step, reason) of each switch from FP8 to BF16 by the shadow check in this call."""
        return tuple((step, reason) for step, to, reason in self.shadow_events if to == Mode.BF16.value)


def get_lr(step: int, config: TrainConfig) -> float:
    """nanoGPT's schedule: linear warm-up over `warmup` steps, then cosine from lr down to min_lr at
    lr_decay_steps, then min_lr."""
    decay_steps = config.lr_decay_steps or config.steps
    if step < config.warmup:
        return config.lr * (step + 1) / (config.warmup + 1)
    if step >= decay_steps:
        return config.min_lr
    ratio = (step - config.warmup) / max(1, decay_steps - config.warmup)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # 1 → 0
    return config.min_lr + coeff * (config.lr - config.min_lr)


@torch.no_grad()
def evaluate(model: Llama, tokens: torch.Tensor, policy: PrecisionPolicy, config: TrainConfig, *,
             fp8: bool = True) -> float:
    """Mean cross-entropy over the first `eval_batches` fixed validation batches (rows weighted equally).

    fp8=False runs the FP8 layers in high precision (the shadow check's BF16 fallback), recording nothing."""
    model.eval()
    total, rows = 0.0, 0
    for x, y in val_batches(tokens, batch_size=config.batch_size, seq_len=config.seq_len,
                            max_batches=config.eval_batches):
        with policy.autocast("cpu"), autocast(enabled=fp8):
            _, loss = model(x, y)
        total += loss.item() * x.shape[0]
        rows += x.shape[0]
    model.train()
    return total / rows


def _tensorboard(out: pathlib.Path):
    """A SummaryWriter, or None when tensorboard is not installed (it is optional)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.info("minifloat: tensorboard is not installed; logging to log.csv only")
        return None
    return SummaryWriter(str(out))


def _open_log(path: pathlib.Path, fields: tuple[str, ...], keep_before: int | None):
    """A csv writer on `path`: a new file, or (on resume) the old rows with step < `keep_before` kept; rows a crashed
    run wrote after its last checkpoint are dropped, as the resumed run writes them again."""
    kept = []
    if keep_before is not None and path.is_file():
        with open(path, newline="") as f:
            kept = [row for row in csv.DictReader(f) if int(row["step"]) < keep_before]
    f = open(path, "w", newline="")
    writer = csv.DictWriter(f, fieldnames=fields)
    writer.writeheader()
    writer.writerows(kept)
    return f, writer


def train(config: TrainConfig, *, progress: bool = True) -> TrainResult:
    """Run `config` (see the module docstring).

    Args:
        config: the run.
        progress: show a rich progress bar with loss, tokens/s and skipped steps.
    Returns:
        TrainResult.
    Raises:
        FileNotFoundError: resume=True and out/ckpt does not exist.
        ValueError: resume=True and the corpus differs from the checkpoint's.
    """
    out = pathlib.Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = out / CHECKPOINT_DIR

    corpus = ByteCorpus.load(DataConfig(path=config.data, max_bytes=config.max_bytes))
    loader = BatchLoader(corpus.train, batch_size=config.batch_size, seq_len=config.seq_len, seed=config.seed)

    torch.manual_seed(config.seed)
    model = Llama(LlamaConfig.preset(config.model))
    policy = config.policy()
    model = policy.apply(model)
    stability = StabilityConfig(embedding_grad_alpha=config.embedding_grad_alpha, max_grad_norm=config.grad_clip,
                                weight_decay=config.weight_decay)
    if config.embedding_grad_alpha != 1.0:
        # GLM-130B: the embedding output's gradient times alpha (a forward hook, so the state-dict keys stay)
        model.wte.register_forward_hook(lambda _module, _args, h: stability.shrink_embedding_grad(h))
    optimizer = torch.optim.AdamW(stability.param_groups(model), lr=config.lr, betas=ADAMW_BETAS)
    scaler = LossScaler.for_dtype(policy.compute_dtype, model=model)  # a no-op for bf16 and fp32
    guard = StepGuard(model, optimizer, stateful={"scaler": scaler},
                      config=GuardConfig(rollback_after=config.rollback_after, snapshot_every=config.snapshot_every))
    # without checks the mode stays FP8 and shadow.context() changes nothing
    shadow = ShadowCheck(ShadowConfig(interval=config.shadow_every or 1, threshold=config.shadow_threshold,
                                      reference_dtype=str(policy.compute_dtype).removeprefix("torch.")))

    start_step = 0
    if config.resume:
        if not ckpt_dir.is_dir():
            raise FileNotFoundError(f"resume=True but there is no checkpoint at {ckpt_dir}")
        extra = load_checkpoint(ckpt_dir, model=model, optimizer=optimizer, scaler=scaler, guard=guard,
                                loader=loader)
        changes = corpus.manifest.changes(extra["data"])
        if changes:
            raise ValueError(f"the corpus differs from the one checkpoint {ckpt_dir} was trained on: "
                             f"{'; '.join(changes[:5])}")
        start_step = extra["step"]
        if config.shadow_every and "shadow" in extra:  # resumed without the check, the run is plain FP8 again
            shadow.load_state_dict(extra["shadow"])
        log.info("minifloat: resumed from %s at step %d", ckpt_dir, start_step)

    # train rows are numbered by step, validation rows by steps done: the checkpoint's own evaluation is kept
    log_file, log_rows = _open_log(out / "log.csv", LOG_FIELDS, start_step if config.resume else None)
    val_file, val_rows = _open_log(out / "val.csv", ("step", "val_loss"), start_step + 1 if config.resume else None)
    writer = _tensorboard(out)
    tokens_per_step = config.batch_size * config.seq_len
    losses, val_losses, skipped, shadow_events, rollbacks, level_shifts = [], [], [], [], [], []
    final_loss, train_time = math.nan, 0.0
    fp8 = policy.recipe is not None
    forward = torch.compile(model) if config.compile else model  # the same parameters and buffers either way

    bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                   TimeRemainingColumn(), disable=not progress)
    with bar, log_file, val_file:
        task = bar.add_task("train", total=config.steps, completed=start_step, info="")
        step = start_step
        while step < config.steps:
            t0 = time.perf_counter()
            lr = get_lr(step, config)
            for group in optimizer.param_groups:
                group["lr"] = lr
            data_position = loader.position
            x, y = next(loader)  # (B, T) each

            if config.shadow_every:
                event = shadow.maybe_check(step, model, lambda output, _batch: output[1], (x, y))  # model(x, y)
                if event is not None:
                    shadow_events.append((step, event.switched_to, event.reason))
            guard.begin_step(step, data_position=data_position)
            with policy.autocast("cpu"), shadow.context(step) as mode:
                logits, loss = forward(x, y)  # (B, T, V), fp32 scalar
                loss = loss + stability.z_loss(logits)
            if data_position in config.nan_steps:
                loss = loss * math.nan  # fault injection (TrainConfig.nan_steps)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            report = guard.check(loss)  # on a skip the gradients are already dropped; on a rollback, state restored
            if not report.skipped:
                stability.clip_grad_norms(optimizer.param_groups)
                scaler.step(optimizer)
                final_loss = report.loss
            else:
                skipped.append((step, report.reason.value))
            if report.level_shift:
                level_shifts.append(step)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            train_time += dt

            losses.append(report.loss)
            row = {"step": step, "loss": report.loss, "lr": lr, "grad_norm": report.grad_norm,
                   "skipped": int(report.skipped), "reason": report.reason.value if report.skipped else "",
                   "tokens_per_s": tokens_per_step / dt, "mode": mode.value if fp8 else ""}
            log_rows.writerow(row)
            if writer is not None:
                for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
                    writer.add_scalar(f"train/{key}", row[key], step)

            if report.rollback is not None:  # back at the snapshot's step, past the bad batches
                rollbacks.append((step, report.rollback.restored_step, report.rollback.skip_batches))
            else:
                done = step + 1
                if config.checkpoint_every and (done % config.checkpoint_every == 0 or done == config.steps):
                    save_checkpoint(ckpt_dir, model=model, optimizer=optimizer, scaler=scaler, guard=guard,
                                    loader=loader, extra={"step": done, "config": dataclasses.asdict(config),
                                                          "data": corpus.manifest.to_dict(),
                                                          "shadow": shadow.state_dict()})
                if done % config.eval_every == 0 or done == config.steps:
                    val = evaluate(model, corpus.val, policy, config, fp8=shadow.mode == Mode.FP8)
                    val_losses.append((done, val))
                    val_rows.writerow({"step": done, "val_loss": val})
                    if writer is not None:
                        writer.add_scalar("val/loss", val, done)
            step = report.next_step
            loader.skip(report.next_data_position - loader.position)  # 0 batches, unless rolled back
            info = f"loss {report.loss:.4f}  {row['tokens_per_s']:,.0f} tok/s  skipped {len(skipped)}"
            bar.update(task, completed=step, info=info + (f"  {mode.value}" if config.shadow_every else ""))
    if writer is not None:
        writer.close()

    return TrainResult(first_step=start_step, losses=tuple(losses), final_loss=final_loss,
                       val_losses=tuple(val_losses),
                       tokens_per_s=tokens_per_step * len(losses) / train_time if train_time else 0.0,
                       skipped=tuple(skipped), shadow_events=tuple(shadow_events),
                       rollbacks=tuple(rollbacks), level_shifts=tuple(level_shifts))
