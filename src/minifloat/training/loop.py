"""Train the reference Llama on the byte corpus under a precision policy: one plain loop, nanoGPT-style.

    result = train(TrainConfig(model="tiny", preset="fp8-delayed", steps=200, out="runs/a", device="auto"))
    result.losses, result.val_losses, result.skipped, result.tokens_per_s, result.mfu

Every step: grad_accum micro-batches of the hashed loader, (every `shadow_every` steps) the FP8-vs-BF16 shadow check,
each micro-batch's forward under the policy's autocast on the run's device and the shadow's mode and its scaled
backward, unscale, the guard's verdict (non-finite loss, gradients or FP8 operands / spike → the update is skipped;
`rollback_after` skips in a row → back to the last snapshot, past the bad batches), clip, step, scaler update. The
FP8 scales advance once per optimizer step, however many micro-batches it has (docs/fp8.md, "The FP8 step").

The learning rate is a pure function of the step (minifloat.training.schedule), so a run resumed from `out/ckpt`
continues bitwise where the uninterrupted run would be: model, optimizer, scaler, guard, shadow mode, loader
position, schedule and RNG are all in the checkpoint. Resuming checks the checkpoint is of this run (model, preset,
batch shape, seed, corpus) and keeps its schedule: more steps never raise the lr. (Rollback snapshots live in memory
only: a resumed run takes its first one at the step it resumes from.)

Outputs under `out/` (minifloat.training.rundir; a folder holding a run is never replaced without `overwrite`):
log.csv (one row per step run, flushed as written; a rollback re-runs steps, so their numbers repeat), val.csv (one
row per evaluation), ckpt/ (latest checkpoint), run.json (config and device) and, if tensorboard is installed,
tensorboard/. SIGTERM or SIGINT ends the run after the current step with a checkpoint (TrainResult.stopped_by).

No lost work: both data splits are checked for one sequence before the run folder is touched, and an error after
training started checkpoints the steps done (the failing step's start when its update was not applied) before
`TrainingFailed` says, in one line, what failed and that --resume continues (one process; the ranks of a
multi-process run keep their last periodic checkpoint). The objects of a run and one step's computation live in
minifloat.training.run.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import pathlib
import time

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from minifloat.core.autocast import cuda_fp32_matmuls
from minifloat.core.files import write_json
from minifloat.core.version import __version__
from minifloat.safety.shadow import Mode
from minifloat.training.checkpoint import load_checkpoint, save_checkpoint
from minifloat.training.compiled import compile_forward
from minifloat.training.config import TrainConfig
from minifloat.training.data import BatchLoader, ByteCorpus, load_corpus, require_windows
from minifloat.training.optimizer import grad_param_groups
from minifloat.distributed.fsdp import precompute_fp8_scales
from minifloat.fp8.convert import fp8_layers
from minifloat.fp8.step import rescale_gradient_amaxes
from minifloat.training.parallel import (Discard, any_rank, barrier, join_world, mean_over_ranks, rank_batches,
                                         rank_device)
from minifloat.training.rundir import (CHECKPOINT_DIR, CHECKPOINT_TOKENIZER, RUN_FILE, CsvLog, save_failed,
                                       GracefulStop, prepare_run_dir, tensorboard_writer)
from minifloat.training.run import Run, build, evaluate, forward_backward  # noqa: F401 - Run, re-exported
from minifloat.training.schedule import Schedule, resumed_schedule
from minifloat.training.sharded import is_sharded, load_sharded, read_extra, save_sharded
from minifloat.training.throughput import flops_per_token, mfu, peak_bf16_flops, resolve_device

log = logging.getLogger("minifloat")

# mode: "fp8" or "bf16" (the shadow check's fallback) for presets with an FP8 recipe, "" for the others
LOG_FIELDS = ("step", "loss", "lr", "grad_norm", "skipped", "reason", "tokens_per_s", "mode")
WARMUP_STEPS = 1  # first steps of a call left out of its tokens/s (lazy initialisation, kernel selection)
WARMUP_STEPS_COMPILED = 3  # the same under torch.compile: the first steps compile the forward and backward


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a run did.

    Attributes:
        first_step: the step this call started at (0, or the checkpoint's step when resuming).
        losses: training loss of each step run in this call, in the order run (skipped steps included, NaN where
            poisoned; steps re-run after a rollback appear again).
        final_loss: loss of the last step whose update was applied (NaN if none was).
        val_losses: (step, mean validation loss) per evaluation, step counted after the update.
        tokens_per_s: trained tokens / time spent in training steps, leaving out the first `warmup_steps` steps
            (compilation) as well as evaluation and checkpoints.
        skipped: (step, reason) of each step the guard skipped.
        shadow_events: (step, mode switched to, reason) of every shadow switch in this call, recoveries included.
        rollbacks: (step, restored step, batches skipped) of each rollback in this call.
        level_shifts: steps the guard applied as a level shift after a run of spike skips (GuardConfig.spike_max_skips).
        warmup_steps: first steps of this call left out of tokens_per_s.
        device: where the run trained ("cpu", "cuda:0", ...).
        mfu: model FLOPs utilisation against the GPU's dense BF16 peak (minifloat.training.throughput); None on a
            CPU or a GPU of unknown peak.
        peak_memory: the most bytes the device's caching allocator held in tensors during this call (CUDA's
            max_memory_allocated, this rank's); None on a CPU.
        stopped_by: "SIGTERM" or "SIGINT" when a signal stopped the run early (after writing a checkpoint at
            `last_step`), else None.
        last_step: the step the run reached (steps done).
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
    warmup_steps: int = 0
    device: str = "cpu"
    mfu: float | None = None
    peak_memory: int | None = None
    stopped_by: str | None = None
    last_step: int = 0

    @property
    def fallbacks(self) -> tuple[tuple[int, str], ...]:
        """(step, reason) of each switch from FP8 to BF16 by the shadow check in this call."""
        return tuple((step, reason) for step, to, reason in self.shadow_events if to == Mode.BF16.value)


def get_lr(step: int, config: TrainConfig) -> float:
    """The learning rate of `step` under the config's own plan (minifloat.training.schedule.Schedule)."""
    return Schedule.from_config(config).lr_at(step)


def _resume(run: Run, ckpt_dir: pathlib.Path, loader: BatchLoader, corpus: ByteCorpus) -> tuple[int, Schedule]:
    """Load the checkpoint into the run after checking it continues the same run; (its step, the schedule)."""
    config = run.config
    saved = read_extra(ckpt_dir)
    config.check_resume(saved.get("config"), saved.get("step"), where=ckpt_dir)
    schedule = resumed_schedule(saved, config)
    changes = corpus.manifest.changes(saved["data"])
    if changes:
        raise ValueError(f"the corpus differs from the one checkpoint {ckpt_dir} was trained on: "
                         f"{'; '.join(changes[:5])}; resume with the same --data, --max-bytes and --tokenizer "
                         f"(the same contents: paths may differ)")
    if is_sharded(ckpt_dir):  # written by several ranks: DCP reshards it to this run's ranks
        extra = load_sharded(ckpt_dir, model=run.model, optimizer=run.optimizer, scaler=run.scaler, guard=run.guard,
                             loader=loader)
    elif run.world.parallel is not None and run.world.parallel.sharded:
        raise ValueError(f"the checkpoint at {ckpt_dir} was written by one process; resume it with --parallel ddp or "
                         f"in one process (a sharded model loads checkpoints written by --nproc runs)")
    else:  # every DDP rank loads the same full state
        extra = load_checkpoint(ckpt_dir, model=run.model, optimizer=run.optimizer, scaler=run.scaler,
                                guard=run.guard, loader=loader)
    if (old_k := saved["config"].get("grad_accum", 1)) != config.grad_accum:  # other ranks: each divides by its K
        rescale_gradient_amaxes(run.model, old_k / config.grad_accum)  # delayed scales follow the gradients' size
    if config.shadow_every and "shadow" in extra:  # resumed without the check, the run is plain FP8 again
        run.shadow.load_state_dict(extra["shadow"])
    log.info("minifloat: resumed from %s at step %d", ckpt_dir, extra["step"])
    return extra["step"], schedule


def _write_run_file(out: pathlib.Path, config: TrainConfig, run: Run, measured: dict | None = None) -> None:
    """out/run.json: the config and where it ran, rewritten (atomically) by every call that trains the run, and at
    its end with what it `measured` (device, MFU, peak memory, the step reached)."""
    info = {"config": config.flat(), "device": str(run.device), "torch": torch.__version__,
            "minifloat": __version__, **({"measured": measured} if measured else {})}
    write_json(out / RUN_FILE, info, atomic=True)


@dataclasses.dataclass
class _Loop:
    """One call of `train`: the run's objects, its outputs and what happened so far; one method per part of a step."""

    run: Run
    loader: BatchLoader
    corpus: ByteCorpus
    schedule: Schedule
    out: pathlib.Path
    log_rows: CsvLog | Discard
    val_rows: CsvLog | Discard
    writer: object | None  # a tensorboard SummaryWriter
    forward: torch.nn.Module  # what the training step calls: the model, DDP-wrapped or compiled
    losses: list = dataclasses.field(default_factory=list)
    val_losses: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)
    shadow_events: list = dataclasses.field(default_factory=list)
    rollbacks: list = dataclasses.field(default_factory=list)
    level_shifts: list = dataclasses.field(default_factory=list)
    times: list = dataclasses.field(default_factory=list)
    final_loss: float = math.nan
    resume_at: list = dataclasses.field(default_factory=list)  # (steps done, loader position) a failure would keep

    @property
    def config(self) -> TrainConfig:
        return self.run.config

    @functools.cached_property
    def low_precision(self) -> bool:
        """Whether any layer trains in the run's FP8/FP4 recipe (--fp8-layers may leave none): log.csv's mode column
        is empty when none does, as for a bf16 run."""
        return self.run.policy.recipe is not None and bool(fp8_layers(self.run.model))

    def tokens_per_s(self) -> float:
        """Trained tokens per second over this call's steps so far, its first (warming-up) steps left out."""
        timed = self.times[warmup_steps(self.config, len(self.times)):] or self.times[-1:]
        return self.per_step * self.config.batch_size * self.config.seq_len * len(timed) / sum(timed) if timed else 0.0

    @property
    def per_step(self) -> int:
        """Micro-batches per optimizer step, all ranks together."""
        return self.config.grad_accum * self.run.world.data_size

    def update(self, step: int):
        """One optimizer step: the batches, the shadow check, forward and backward, the guard's verdict, the update.
        Returns (the guard's report, the mode the step ran in, its lr)."""
        run, loader, config = self.run, self.loader, self.config
        self.resume_at[:] = [step, loader.position]  # a failure before the update keeps the steps before this one
        lr = self.schedule.lr_at(step)
        for group in run.optimizer.param_groups:  # a bf16 --master wrapper's groups are its inner AdamW's
            group["lr"] = lr
        group_position = loader.position // self.per_step  # the step's batch group (guard and rollback count these)
        first = loader.position
        batches = [tuple(t.to(run.device, non_blocking=True) for t in b)
                   for b in rank_batches(loader, accum=config.grad_accum, world=run.world)]
        if config.shadow_every:  # on every rank the step's first micro-batch, so all ranks reach one verdict
            check_batch = tuple(t.to(run.device) for t in loader.batch(first))
            event = run.shadow.maybe_check(step, run.model, lambda output, _batch: output[1], check_batch)
            if event is not None:
                self.shadow_events.append((step, event.switched_to, event.reason))
        run.guard.begin_step(step, data_position=group_position)
        loss, mode = forward_backward(run, self.forward, batches, step, poison=group_position in config.nan_steps)
        loss = mean_over_ranks(loss, run.world)
        run.scaler.unscale_(run.optimizer)
        report = run.guard.check(loss)  # on a skip the gradients are already dropped; on a rollback, state restored
        if not report.skipped:
            run.stability.clip_grad_norms(grad_param_groups(run.optimizer))  # the model's gradients
            run.scaler.step(run.optimizer)  # ends the FP8 step: amaxes reduced over the ranks, scales advanced
            self.resume_at[:] = [step + 1, loader.position]  # the update is in
            if run.world.parallel is not None and run.world.parallel.sharded:
                precompute_fp8_scales(run.model)  # the next FP8 all-gathers' scales, in one all-reduce
            self.final_loss = report.loss
        else:
            self.skipped.append((step, report.reason.value))
        if report.level_shift:
            self.level_shifts.append(step)
        run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
        loader.skip(report.next_data_position * self.per_step - loader.position)  # 0 batches, unless rolled back
        self.resume_at[:] = [report.next_step, loader.position]
        if report.rollback is not None:  # back at the snapshot's step, past the bad batches
            self.rollbacks.append((step, report.rollback.restored_step, report.rollback.skip_batches))
        return report, mode, lr

    def log(self, step: int, report, mode: Mode, lr: float, dt: float) -> dict:
        """The step's row in log.csv (and tensorboard)."""
        self.times.append(dt)
        self.losses.append(report.loss)
        tokens = self.per_step * self.config.batch_size * self.config.seq_len
        row = {"step": step, "loss": report.loss, "lr": lr, "grad_norm": report.grad_norm,
               "skipped": int(report.skipped), "reason": report.reason.value if report.skipped else "",
               "tokens_per_s": tokens / dt, "mode": mode.value if self.low_precision else ""}
        self.log_rows.write(row)
        if self.writer is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
                self.writer.add_scalar(f"train/{key}", row[key], step)
        return row

    def evaluate(self, done: int) -> None:
        """A validation pass after `done` steps (in BF16 while the shadow check or the BF16 tail has FP8 off)."""
        run = self.run
        val = evaluate(run.model, self.corpus.val, run.policy, self.config, device=run.device,
                       fp8=run.shadow.mode == Mode.FP8 and done <= self.config.bf16_tail_start)
        self.val_losses.append((done, val))
        self.val_rows.write({"step": done, "val_loss": val})
        if self.writer is not None:
            self.writer.add_scalar("val/loss", val, done)

    def save(self, done: int) -> None:
        """A checkpoint of the run after `done` steps in out/ckpt (sharded across ranks where the run is)."""
        run, config, ckpt_dir = self.run, self.config, self.out / CHECKPOINT_DIR
        extra = {"step": done, "config": config.flat(), "data": self.corpus.manifest.to_dict(),
                 "shadow": run.shadow.state_dict(), "schedule": dataclasses.asdict(self.schedule)}
        kept = self.corpus.tokenizer_json  # the tokenizer a token run's ids mean travels with each checkpoint
        state = dict(model=run.model, optimizer=run.optimizer, scaler=run.scaler, guard=run.guard, loader=self.loader,
                     extra=extra, files={CHECKPOINT_TOKENIZER: kept} if kept is not None else None)
        if run.world.distributed or is_sharded(ckpt_dir):  # one process continuing a sharded run keeps its format
            save_sharded(ckpt_dir, world=run.world, **state)
        else:
            save_checkpoint(ckpt_dir, **state)

    def after_update(self, done: int, stopping: bool) -> None:
        """Checkpoint and evaluate on their cadences (and at the last step); checkpoint when the run is stopping."""
        config = self.config
        if config.checkpoint_every and (done % config.checkpoint_every == 0 or done == config.steps) or stopping:
            self.save(done)
        if done % config.eval_every == 0 or done == config.steps:
            self.evaluate(done)


def train(config: TrainConfig, *, progress: bool = True) -> TrainResult:
    """Run `config` (see the module docstring).

    Args:
        config: the run.
        progress: show a rich progress bar, labelled with the preset, with loss, tokens/s and skipped steps.
    Returns:
        TrainResult (`stopped_by` says when SIGTERM / SIGINT ended it early, after a checkpoint).
    Raises:
        RunExistsError: out holds a run and neither resume nor overwrite is set.
        FileNotFoundError: resume=True and out/ckpt does not exist.
        ValueError: bad data (a split too short for one sequence), or resume=True and the checkpoint is of another
            run (model, preset, batch, seed, corpus) or already at `steps`; or the device is not available.
        TrainingFailed: an error after training started (the steps done were checkpointed: the message says).
    """
    out = pathlib.Path(config.out)
    device = rank_device(resolve_device(config.device))
    if device.type == "meta":  # build() takes it (shape checks); a step cannot: meta tensors hold no numbers
        raise ValueError("--device meta builds a run with shapes only and cannot train it; use --device cpu, cuda or "
                         "auto")
    corpus = load_corpus(config.data, max_bytes=config.max_bytes, tokenizer=config.tokenizer)  # bad input fails first
    require_windows(corpus, seq_len=config.seq_len)  # both splits: not at the first evaluation, steps later
    world = join_world(config.parallel, nproc=config.nproc, device=device, tp=config.tp_size)
    if world.is_main:  # rank 0 owns the run folder: its logs, run.json and checkpoints
        prepare_run_dir(out, resume=config.resume, overwrite=config.overwrite)
    barrier(world)
    loader = BatchLoader(corpus.train, batch_size=config.batch_size, seq_len=config.seq_len, seed=config.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # TrainResult.peak_memory: this call's, model and optimizer included
    run = build(config, device, world, vocab_size=corpus.vocab_size)
    start_step, schedule = (_resume(run, out / CHECKPOINT_DIR, loader, corpus) if config.resume
                            else (0, Schedule.from_config(config)))
    # train rows are numbered by step, validation rows by steps done: the checkpoint's own evaluation is kept
    if world.is_main:
        _write_run_file(out, config, run)
        log_rows = CsvLog(out / "log.csv", LOG_FIELDS, keep_before=start_step if config.resume else None)
        val_rows = CsvLog(out / "val.csv", ("step", "val_loss"), keep_before=start_step + 1 if config.resume else None)
    else:
        log_rows, val_rows = Discard(), Discard()
    writer = tensorboard_writer(out) if world.is_main else None
    loop = _Loop(run, loader, corpus, schedule, out, log_rows, val_rows, writer,
                 compile_forward(run.train_module, config.compile_mode, config.compile_scope) if config.compile
                 else run.train_module,
                 resume_at=[start_step, loader.position])
    # the bar is labelled with the preset: `minifloat compare` draws one bar per preset
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[info]}"), TimeRemainingColumn(), disable=not progress or not world.is_main)
    with bar, log_rows, val_rows, GracefulStop() as stop, cuda_fp32_matmuls("tf32" if config.tf32 else "ieee"):
        task = bar.add_task(config.preset, total=config.steps, completed=start_step, info="")
        step, stopping = start_step, False
        try:
            while step < config.steps:
                t0 = time.perf_counter()
                report, mode, lr = loop.update(step)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # the step's time is the GPU's, not the launch queue's
                loop.log(step, report, mode, lr, time.perf_counter() - t0)
                stopping = any_rank(stop.signal is not None, world)  # all ranks stop at the same step
                if report.rollback is None:
                    loop.after_update(step + 1, stopping)
                step = report.next_step
                info = f"loss {report.loss:.4f}  {loop.tokens_per_s():,.0f} tok/s  skipped {len(loop.skipped)}"
                bar.update(task, completed=step, info=info + (f"  {mode.value}" if config.shadow_every else ""))
                if stopping:
                    if report.rollback is not None:  # the step ended in a rollback: checkpoint the restored state
                        loop.save(step)
                    break
        except Exception as err:  # noqa: BLE001 - any failure: checkpoint the steps done, then say it in one line
            raise _keep_steps(err, loop, world, out) from err
    if loop.writer is not None:
        loop.writer.close()
    result = _result(loop, start_step, step, stop.signal or ("SIGTERM" if stopping else None))
    if world.is_main:  # what this call measured, for `compare --reuse` (minifloat.training.compare.finished_result)
        _write_run_file(out, config, run, measured={"device": result.device, "mfu": result.mfu,
                                                    "peak_memory": result.peak_memory, "last_step": result.last_step})
    return result


def _result(loop: _Loop, start_step: int, step: int, stopped_by: str | None) -> TrainResult:
    """What the call did; tokens/s leaves out its first, warming-up steps (another rank's signal reads SIGTERM:
    torchrun forwards it)."""
    config, run = loop.config, loop.run
    warmup = warmup_steps(config, len(loop.times))
    tokens_per_s = loop.tokens_per_s() if loop.times[warmup:] else 0.0
    model = run.model
    flops = flops_per_token(model, n_layers=model.config.n_layer, d_model=model.config.d_model, seq_len=config.seq_len)
    peak = peak_bf16_flops(run.device)
    peak = peak * run.world.size if peak is not None else None  # tokens/s counts every rank's tokens
    return TrainResult(first_step=start_step, losses=tuple(loop.losses), final_loss=loop.final_loss,
                       val_losses=tuple(loop.val_losses), tokens_per_s=tokens_per_s, skipped=tuple(loop.skipped),
                       shadow_events=tuple(loop.shadow_events), rollbacks=tuple(loop.rollbacks),
                       level_shifts=tuple(loop.level_shifts), warmup_steps=warmup, device=str(run.device),
                       mfu=mfu(tokens_per_s, flops, peak), stopped_by=stopped_by, last_step=step,
                       peak_memory=torch.cuda.max_memory_allocated(run.device) if run.device.type == "cuda" else None)


class TrainingFailed(RuntimeError):
    """A run failed after it started; the steps done were checkpointed where possible (the message says)."""


def _keep_steps(err: Exception, loop: _Loop, world, out: pathlib.Path) -> TrainingFailed:
    """Checkpoint the last consistent state of a run that `err` stopped and say, in one line, how to continue.

    `loop.resume_at` is (steps done, loader position) as of the failure: the failing step's start when its update
    had not been applied (its batches are drawn again), else after it. Ranks of a multi-process run cannot write a
    checkpoint on their own (it is collective), so there the last periodic checkpoint is what remains."""
    done, position = loop.resume_at
    cause = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
    if world.distributed:
        return TrainingFailed(f"training failed at step {done} ({cause}); continue from the last checkpoint in "
                              f"{out / CHECKPOINT_DIR} with --resume once the cause is fixed")
    try:
        loop.run.optimizer.zero_grad(set_to_none=True)
        loop.loader.load_state_dict({"position": position, "seed": loop.loader.seed})
        loop.save(done)
    except Exception as save_err:  # noqa: BLE001 - report both
        return TrainingFailed(save_failed(done, cause, save_err, out))
    # the fix before the cause: the command line prints the first MESSAGE_LIMIT characters of a line
    return TrainingFailed(f"training failed at step {done}; the {done} steps done are saved in {out / CHECKPOINT_DIR}: "
                          f"fix the cause and continue with --resume (same --out and flags; a fix that changes the "
                          f"data or a fixed flag needs a new run, --overwrite). The cause: {cause}")


def warmup_steps(config: TrainConfig, steps_run: int) -> int:
    """How many of a call's first steps its tokens/s leaves out: the first step (lazy initialisation, kernel
    selection), or WARMUP_STEPS_COMPILED under torch.compile (the first steps compile the forward and backward);
    none when the call ran no more steps than that."""
    n = WARMUP_STEPS_COMPILED if config.compile else WARMUP_STEPS
    return n if steps_run > n else 0
