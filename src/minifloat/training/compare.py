"""Train one model under several precision presets and compare them against BF16: numbers, curves, numerics.

    summary = compare(["bf16", "fp8-delayed", "mxfp8"], base=DEFAULT_CONFIG, out="runs/compare")
    summary["presets"]["mxfp8"]["rel_diff_vs_bf16"]

Every preset trains with the same seed, data, model and steps (`base` with only `preset` and `out` replaced), each
into out/<preset>/. Then, in `out`:
    summary.json          per preset: final train / val loss, val loss relative to BF16, tokens/s and the warm-up
                          steps it excludes, skipped steps, FP8 -> BF16 fallbacks of the shadow check
    loss_curves.png       the training loss (BF16's, and any preset's apart from it at that scale), each preset's
                          per-step difference to BF16 over the last quarter, and its smoothed difference over the
                          run against the band of step-to-step noise and DeepSeek-V3's 0.25% (`loss_curves_figure`)
    numerics_heatmap.png  per FP8 preset: SQNR of each layer's casts by tensor role, from telemetry captured on one
                          forward+backward of the trained model (rebuilt from its checkpoint) on a validation batch
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import pathlib

import torch

from minifloat.fp8 import telemetry
from minifloat.training.checkpoint import MANIFEST_FILE, checkpoint_extra, load_checkpoint
from minifloat.training.data import load_corpus, val_batches
from minifloat.training.model import Llama
from minifloat.amp.policy import PRESETS
from minifloat.training.config import NOT_INHERITED
from minifloat.training.loop import CHECKPOINT_DIR, TrainConfig, TrainResult, train, warmup_steps
from minifloat.training.rundir import RUN_FILE, RunExistsError, run_items
from minifloat.training.run import low_precision_layers
from minifloat.training.throughput import resolve_device
from minifloat.training.plots import (  # noqa: F401 (re-exported: the comparison's constants and figures)
    BASELINE, DEEPSEEK_V3_PCT, RANGE_BAND_PCT, SMOOTHING, TAIL_FRACTION, ZERO_LABEL, loss_curves_figure, noise_band_pct,
    plot_loss_curves, plot_numerics)

log = logging.getLogger("minifloat")

DEFAULT_PRESETS = ("bf16", "fp8-delayed", "fp8-current", "fp8-block", "mxfp8")
# Five presets of the tiny model in about two minutes on 2 CPU cores (FP8 emulation dominates). The learning rate is
# TrainConfig's 1e-3: at 3e-3 the tiny model's FP8 runs wander 1-2% from BF16, by seed (docs/benchmarks.md)
DEFAULT_CONFIG = TrainConfig(model="tiny", steps=400, batch_size=16, seq_len=64, eval_every=100, eval_batches=16,
                             out="runs/compare")
# On a GPU a comparison is the seed's experiment at a size where FP8 pays: the Llama-3-shaped 1b preset on its whole
# 2048-token context, 8 sequences (16k tokens) per step, 300 steps (about 5M tokens, minutes per preset on an H100),
# at a learning rate a billion-parameter model takes without spikes (Llama 3.2 1B: 3e-4 peak)
GPU_SETTINGS = dict(model="1b", steps=300, batch_size=8, seq_len=2048, lr=3e-4, min_lr=3e-5, warmup=30,
                    eval_every=100, eval_batches=20, max_bytes=None)
BYTES = 2**30


def default_config(device: str = "auto") -> TrainConfig:
    """The comparison a device runs when nothing else is asked for: DEFAULT_CONFIG on a CPU, with GPU_SETTINGS on
    CUDA."""
    cuda = resolve_device(device).type == "cuda"
    return dataclasses.replace(DEFAULT_CONFIG, device=device, **GPU_SETTINGS) if cuda else DEFAULT_CONFIG


def _summarize(result: TrainResult) -> dict:
    """A run's row of summary.json (rel_diff_vs_bf16 and speedup_vs_bf16 are added once every preset has run)."""
    return {"final_train_loss": result.final_loss,
            "final_val_loss": result.val_losses[-1][1] if result.val_losses else math.nan,
            "tokens_per_s": result.tokens_per_s,  # the first warmup_steps (compilation) left out
            "warmup_steps_excluded": result.warmup_steps,
            "mfu": result.mfu,  # against the GPU's dense BF16 peak, for every preset; None on a CPU
            "peak_memory_gib": None if result.peak_memory is None else result.peak_memory / BYTES,
            "skipped_steps": len(result.skipped),
            "fallbacks": len(result.fallbacks)}  # FP8 -> BF16 switches of the shadow check (base.shadow_every)


# the settings a comparison's command line restates: what makes its runs (compare's own flags, minifloat.cli.compare)
COMMAND_SETTINGS = ("model", "steps", "batch_size", "seq_len", "seed", "data", "max_bytes", "tokenizer", "attention",
                    "lr", "min_lr", "warmup", "grad_accum", "eval_every", "eval_batches", "compile", "compile_mode",
                    "compile_scope", "tf32", "shadow_every", "shadow_threshold", "fp8_layers")
ON_OFF = ("tf32",)  # of those, the settings whose flag takes on|off


def _command(presets: list[str], base: TrainConfig, out: pathlib.Path) -> str:
    """The `minifloat compare` command line that reproduces the run: the model, steps and batch shape, and every
    other setting that differs from the comparison's defaults on its device (`default_config`)."""
    defaults = default_config(base.device)
    flags = {"--presets": ",".join(presets)}
    for name in COMMAND_SETTINGS:
        value = getattr(base, name)
        always = name in ("model", "steps", "batch_size", "seq_len") or (
            name == "shadow_threshold" and base.shadow_every)
        if always or value != getattr(defaults, name):
            flags["--" + name.replace("_", "-")] = ("on" if value else "off") if name in ON_OFF else value
    flags["--out"] = str(out)
    return "minifloat compare " + " ".join(k if v is True else f"{k} {v}" for k, v in flags.items()
                                           if v is not None and v is not False)


def capture_numerics(config: TrainConfig) -> telemetry.Recorder:
    """Telemetry of one forward+backward of the model trained by `config` (rebuilt from out/ckpt) on the first
    validation batch, under the config's policy. The gradients it makes are thrown away with the model."""
    torch.manual_seed(config.seed)
    policy = config.policy()
    device = resolve_device(config.device)
    corpus = load_corpus(config.data, max_bytes=config.max_bytes, tokenizer=config.tokenizer)
    model = policy.apply(Llama(config.model_config(corpus.vocab_size)), filter=config.layer_filter()).to(device)
    load_checkpoint(pathlib.Path(config.out) / CHECKPOINT_DIR, model=model, restore_rng=False)
    x, y = next(iter(val_batches(corpus.val, batch_size=config.batch_size, seq_len=config.seq_len, max_batches=1)))
    with telemetry.capture() as rec:
        with policy.autocast("cuda" if device.type == "cuda" else "cpu"):
            _, loss = model(x.to(device), y.to(device))  # (B, T, V) logits, fp32 scalar
        loss.backward()
    return rec


def finished_result(config: TrainConfig, corpus=None) -> TrainResult | None:
    """The TrainResult of a run of `config` that already finished in config.out, rebuilt from its log.csv, val.csv
    and final checkpoint; None when there is none, or it was made with other settings (`_difference`; the data
    compared with `corpus`, the loaded data, by content) or stopped early.

    Only the summary's fields are rebuilt: losses, final loss, validation losses, tokens/s (from the per-step
    timings, the loop's warm-up steps left out as in the run), skipped steps and the shadow check's switches (from
    the checkpoint's shadow state)."""
    out = pathlib.Path(config.out)
    manifest = out / CHECKPOINT_DIR / MANIFEST_FILE
    if not (manifest.exists() and (out / "log.csv").exists() and (out / "val.csv").exists()):
        return None
    extra = checkpoint_extra(out / CHECKPOINT_DIR)
    if extra.get("step") != config.steps or _difference(extra, config, corpus) is not None:
        return None
    with open(out / "log.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    with open(out / "val.csv", newline="") as f:
        val = tuple((int(r["step"]), float(r["val_loss"])) for r in csv.DictReader(f))
    if len(rows) != config.steps or not val or val[-1][0] != config.steps:
        return None
    applied = [float(r["loss"]) for r in rows if r["skipped"] == "0"]
    warmup = warmup_steps(config, len(rows))  # left out of tokens/s, as the run itself did
    timed = rows[warmup:]
    seconds = sum(1 / float(r["tokens_per_s"]) for r in timed)  # per token; dt = tokens_per_step / tokens_per_s
    events = extra.get("shadow", {}).get("events", [])
    measured = _measured(out, config)
    return TrainResult(first_step=0, losses=tuple(float(r["loss"]) for r in rows),
                       final_loss=applied[-1] if applied else math.nan, val_losses=val,
                       tokens_per_s=len(timed) / seconds if seconds else 0.0,
                       skipped=tuple((int(r["step"]), r["reason"]) for r in rows if r["skipped"] != "0"),
                       shadow_events=tuple((e["step"], e["switched_to"], e["reason"]) for e in events),
                       warmup_steps=warmup, device=measured.get("device", "cpu"), mfu=measured.get("mfu"),
                       peak_memory=measured.get("peak_memory"))


def _measured(out: pathlib.Path, config: TrainConfig) -> dict:
    """What run.json says of the run of `config`: the device it trained on and, when its last call ended at
    config.steps, that call's MFU and peak memory ({} for another config; no MFU or memory for a run from before
    minifloat recorded them)."""
    try:
        info = json.loads((out / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(info, dict) or _differing(info.get("config"), config) is not None:
        return {}
    measured = info.get("measured")
    if not (isinstance(measured, dict) and measured.get("last_step") == config.steps):
        measured = {}
    return {"device": info.get("device", "cpu"), "mfu": measured.get("mfu"), "peak_memory": measured.get("peak_memory")}


COMPARE_FILES = ("summary.json", "loss_curves.png", "numerics_heatmap.png")  # written into `out` itself


# settings that say how and where a call runs, not what it trains (never inherited by a resume): a run made with
# other values is the same run. The data and tokenizer are compared by content (the corpus manifest), not by path.
RUN_CONTROL = (*NOT_INHERITED, "data", "tokenizer")


def _differing(saved, config: TrainConfig) -> str | None:
    """The first setting (but RUN_CONTROL) `saved`, a recorded config, has another value for than `config`, as
    "made with --flag X, this comparison asks for Y"; None when they agree."""
    if not isinstance(saved, dict):
        return "no recorded settings"
    wanted, saved = json.loads(json.dumps(config.flat())), json.loads(json.dumps(saved))  # tuples become lists
    for key, value in wanted.items():
        if key not in RUN_CONTROL and key in saved and saved[key] != value:
            return f"made with --{key.replace('_', '-')} {saved[key]!r}, this comparison asks for {value!r}"
    return None


def _difference(extra: dict, config: TrainConfig, corpus) -> str | None:
    """Why the checkpoint whose extra is `extra` is not a run of `config` on `corpus`'s data; None when it is."""
    why = _differing(extra.get("config"), config)
    saved = extra.get("data")
    if why is None and corpus is not None:
        changes = corpus.manifest.changes(saved) if isinstance(saved, dict) else ["no record of it"]
        why = f"trained on other data ({changes[0]})" if changes else None
    return why


def _state(config: TrainConfig, corpus) -> tuple[str, str]:
    """("finished" | "resumable" | "other", why) of the run in config.out, for --reuse."""
    if finished_result(config, corpus) is not None:
        return "finished", ""
    try:
        extra = checkpoint_extra(pathlib.Path(config.out) / CHECKPOINT_DIR)
    except (OSError, ValueError):
        return "other", "no complete checkpoint"
    if (why := _difference(extra, config, corpus)) is not None:
        return "other", why
    step = extra.get("step")
    if isinstance(step, int) and step < config.steps:
        return "resumable", f"stopped at step {step} of {config.steps}"
    return "other", f"at step {step}, this comparison asks for {config.steps}" if step != config.steps else \
        "its logs are incomplete"


def _refuse_existing(out: pathlib.Path, configs: dict[str, TrainConfig], overwrite: bool, reuse) -> None:
    """Raise RunExistsError when `out` holds an earlier comparison that this one would replace: a preset's run
    (unless `reuse`, the loaded corpus, finds it finished or resumable) or the comparison's own files (kept out of the
    check by `reuse`, which asks for them to be written again). `overwrite` allows both; the runs' own rule
    (minifloat.training.rundir) then removes only what a run writes. A `minifloat train` run in `out` itself is
    refused either way: the comparison's runs and files would mix with it."""
    if (out / RUN_FILE).exists():
        raise RunExistsError(f"--out {out} holds a training run ({RUN_FILE}); compare trains each preset into "
                             f"OUT/<preset>: choose another --out")
    if overwrite:
        return
    states = {p: _state(c, reuse) if reuse is not None else ("other", "") for p, c in configs.items()
              if run_items(pathlib.Path(c.out))}
    taken = [p for p, (state, _) in states.items() if state == "other"]
    taken += [] if reuse is not None else [f for f in COMPARE_FILES if (out / f).exists()]
    if taken and reuse is not None:
        why = "; ".join(f"{p}: {states[p][1]}" for p in taken)
        raise RunExistsError(f"--out {out} holds runs --reuse cannot take ({why}); pass --overwrite to replace them, "
                             f"or choose another --out")
    if taken:
        raise RunExistsError(f"--out {out} already holds a comparison ({', '.join(taken)}); pass --overwrite to "
                             f"replace it, or --reuse to keep its finished runs and resume the interrupted ones")


class ComparisonStopped(Exception):
    """A signal (SIGTERM, SIGINT) stopped a preset's run: the comparison stops too, with nothing summarized."""

    def __init__(self, preset: str, result: TrainResult, steps: int):
        super().__init__(f"stopped by {result.stopped_by} while training {preset} (step {result.last_step} of "
                         f"{steps}, checkpointed); no summary written. The same command with --reuse keeps the "
                         f"finished presets and resumes {preset}")
        self.preset, self.result = preset, result


def compare(presets: list[str] | tuple[str, ...] = DEFAULT_PRESETS, *, base: TrainConfig = DEFAULT_CONFIG,
            out: str | pathlib.Path = "runs/compare", progress: bool = True, reuse: bool = False) -> dict:
    """Train `base` under each preset and write summary.json, loss_curves.png and numerics_heatmap.png into `out`.

    Args:
        presets: keys of minifloat.amp.policy.PRESETS; "bf16" is added first when missing (it is the baseline).
        base: the run every preset shares; its `preset`, `out` and `resume` are replaced, and checkpoint_every=0
            becomes `steps` (the numerics capture reloads the final checkpoint). Its shadow_every (which needs an
            FP8 preset in `base`) applies to the FP8 presets; the others run without the shadow check.
        out: output folder; preset p trains into out/p/.
        progress: show each run's progress bar.
        reuse: take the result of a preset whose run already finished in out/p with the same settings (see
            `finished_result`) instead of training it again, and resume one a signal stopped (an interrupted
            compare); settings of how a call runs (RUN_CONTROL: device, compile, overwrite, ...) may differ.
    Returns:
        The summary written to summary.json: {"command", "config", "presets": {name: metrics}, "files"}.
        rel_diff_vs_bf16 is (val_loss - val_loss_bf16) / val_loss_bf16, a fraction. numerics_heatmap.png is written
        only when an FP8 preset is among `presets` ("files" lists what was written).
    Raises:
        ValueError: an unknown or repeated preset, or an invalid `base` (before anything trains).
        RunExistsError: `out` holds an earlier comparison and base.overwrite is off (before anything trains).
        ComparisonStopped: a signal stopped a preset's run (after its checkpoint); nothing is summarized.
    """
    presets = list(presets)
    if not presets:
        raise ValueError(f"presets must name at least one of {list(PRESETS)}, got none")
    if unknown := [p for p in presets if p not in PRESETS]:
        raise ValueError(f"presets must be keys of {list(PRESETS)}, got unknown {unknown}")
    for field, off in (("fp8_layers", "all"), ("shadow_every", 0)):  # train refuses these without a recipe too
        if getattr(base, field) != off and all(PRESETS[p].recipe is None for p in presets):
            raise ValueError(f"{field}={getattr(base, field)} acts on FP8/FP4 presets, but presets {presets} have "
                             f"none; add one (e.g. fp8-delayed), or leave {field} out")
    if len(set(presets)) != len(presets):
        raise ValueError(f"presets must not repeat, got {presets}")
    if BASELINE not in presets:
        presets.insert(0, BASELINE)
    out = pathlib.Path(out)
    configs = {p: dataclasses.replace(base, preset=p, out=str(out / p), resume=False,
                                      checkpoint_every=base.checkpoint_every or base.steps,
                                      shadow_every=base.shadow_every if PRESETS[p].recipe is not None else 0,
                                      fp8_layers=base.fp8_layers if PRESETS[p].recipe is not None else "all")
               for p in presets}

    if reuse and base.overwrite:
        raise ValueError("--reuse keeps the finished runs in --out and --overwrite replaces them: pass one of them")
    corpus = load_corpus(base.data, max_bytes=base.max_bytes, tokenizer=base.tokenizer) if reuse else None
    _refuse_existing(out, configs, base.overwrite, corpus if reuse else None)
    results = {}
    for p, config in configs.items():
        state = _state(config, corpus)[0] if reuse and run_items(pathlib.Path(config.out)) else "new"
        if state == "finished":
            log.info("minifloat: compare: reusing the finished run of %s in %s", p, config.out)
            results[p] = finished_result(config, corpus)
            continue
        log.info("minifloat: compare: %s %s in %s", "resuming" if state == "resumable" else "training", p, config.out)
        results[p] = train(dataclasses.replace(config, resume=state == "resumable"), progress=progress)
        if results[p].stopped_by:
            raise ComparisonStopped(p, results[p], config.steps)
    metrics = {p: _summarize(r) for p, r in results.items()}
    baseline, speed = metrics[BASELINE]["final_val_loss"], metrics[BASELINE]["tokens_per_s"]
    for m in metrics.values():
        m["rel_diff_vs_bf16"] = (m["final_val_loss"] - baseline) / baseline
        m["speedup_vs_bf16"] = m["tokens_per_s"] / speed if speed else math.nan

    files = {"summary": out / "summary.json", "loss_curves": out / "loss_curves.png"}
    title = (f"{base.model} Llama, {base.steps} steps, batch {base.batch_size} × {base.seq_len} tokens, "
             f"seed {base.seed}")
    plot_loss_curves({p: list(r.losses) for p, r in results.items()}, files["loss_curves"], title=title)
    fp8 = [p for p in presets if PRESETS[p].recipe is not None]
    for p in presets:  # with --fp8-layers fewer than every eligible layer, and none where none pays
        metrics[p]["low_precision_layers"] = low_precision_layers(configs[p])[0]
    numerics = {p: capture_numerics(configs[p]) for p in fp8 if metrics[p]["low_precision_layers"]}
    if numerics:
        files["numerics_heatmap"] = out / "numerics_heatmap.png"
        plot_numerics(numerics, files["numerics_heatmap"])

    device = torch.device(results[BASELINE].device)
    summary = {"command": _command(presets, base, out),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
               "config": {k: v for k, v in base.flat().items() if k not in ("preset", "out", "resume")},
               "presets": metrics, "files": {k: str(v) for k, v in files.items()}}
    text = json.dumps(summary, indent=1)
    files["summary"].write_text(text)
    for name in COMPARE_FILES:  # one an earlier comparison wrote (--overwrite, --reuse) that this one did not
        if (out / name).exists() and out / name not in files.values():
            (out / name).unlink()
    return json.loads(text)  # exactly what the file holds (tuples become lists)
