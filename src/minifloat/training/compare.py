"""Train one model under several precision presets and compare them against BF16: numbers, curves, numerics.

    summary = compare(["bf16", "fp8-delayed", "mxfp8"], base=DEFAULT_CONFIG, out="runs/compare")
    summary["presets"]["mxfp8"]["rel_diff_vs_bf16"]

Every preset trains with the same seed, data, model and steps (`base` with only `preset` and `out` replaced), each
into out/<preset>/. Then, in `out`:
    summary.json          per preset: final train / val loss, val loss relative to BF16, tokens/s, skipped steps,
                          FP8 -> BF16 fallbacks of the shadow check
    loss_curves.png       training loss per step (raw faint, smoothed solid) and the smoothed loss's % difference
                          to BF16, with the ±1% band and DeepSeek-V3's 0.25% marked
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
from minifloat.training.data import ByteCorpus, DataConfig, val_batches
from minifloat.training.model import Llama, LlamaConfig
from minifloat.amp.policy import PRESETS
from minifloat.fp8.recipes import ROLES
from minifloat.training.loop import CHECKPOINT_DIR, TrainConfig, TrainResult, train

log = logging.getLogger("minifloat")

BASELINE = "bf16"
DEFAULT_PRESETS = ("bf16", "fp8-delayed", "fp8-current", "fp8-block", "mxfp8")
# Five presets of the tiny model in about two minutes on 2 CPU cores (FP8 emulation dominates). The learning rate is
# TrainConfig's 1e-3: at 3e-3 the tiny model's FP8 runs wander 1-2% from BF16, by seed (docs/benchmarks.md)
DEFAULT_CONFIG = TrainConfig(model="tiny", steps=400, batch_size=16, seq_len=64, eval_every=100, eval_batches=16,
                             out="runs/compare")
SMOOTHING = 0.9  # EMA weight of the previous smoothed loss (TensorBoard's slider)
RANGE_BAND_PCT = 1.0  # a common acceptance band for low-precision loss curves
# DeepSeek-V3 technical report (arXiv:2412.19437), §3.3: FP8 training's relative loss error vs BF16 "consistently
# remains below 0.25%"
DEEPSEEK_V3_PCT = 0.25
ANNOTATE_FRACTION = 0.0005  # saturated / underflowed fractions below this print as 0.0%, so are left out


def _ema(values: list[float], beta: float = SMOOTHING) -> list[float]:
    """Bias-corrected exponential moving average; non-finite values (poisoned steps) are passed over."""
    out, avg, weight = [], 0.0, 0.0
    for v in values:
        if math.isfinite(v):
            avg, weight = beta * avg + (1 - beta) * v, beta * weight + (1 - beta)
        out.append(avg / weight if weight else math.nan)
    return out


def _summarize(result: TrainResult) -> dict:
    return {"final_train_loss": result.final_loss,
            "final_val_loss": result.val_losses[-1][1] if result.val_losses else math.nan,
            "tokens_per_s": result.tokens_per_s,
            "skipped_steps": len(result.skipped),
            "fallbacks": len(result.fallbacks)}  # FP8 -> BF16 switches of the shadow check (base.shadow_every)


def _command(presets: list[str], base: TrainConfig, out: pathlib.Path) -> str:
    """The `minifloat compare` command line that reproduces the run."""
    flags = {"--presets": ",".join(presets), "--model": base.model, "--steps": base.steps,
             "--batch-size": base.batch_size, "--seq-len": base.seq_len, "--seed": base.seed, "--data": base.data,
             "--max-bytes": base.max_bytes, "--out": str(out)}
    if base.shadow_every:
        flags.update({"--shadow-every": base.shadow_every, "--shadow-threshold": base.shadow_threshold})
    return "minifloat compare " + " ".join(f"{k} {v}" for k, v in flags.items() if v is not None)


def capture_numerics(config: TrainConfig) -> telemetry.Recorder:
    """Telemetry of one forward+backward of the model trained by `config` (rebuilt from out/ckpt) on the first
    validation batch, under the config's policy. The gradients it makes are thrown away with the model."""
    torch.manual_seed(config.seed)
    policy = config.policy()
    model = policy.apply(Llama(LlamaConfig.preset(config.model)))
    load_checkpoint(pathlib.Path(config.out) / CHECKPOINT_DIR, model=model, restore_rng=False)
    corpus = ByteCorpus.load(DataConfig(path=config.data, max_bytes=config.max_bytes))
    x, y = next(iter(val_batches(corpus.val, batch_size=config.batch_size, seq_len=config.seq_len, max_batches=1)))
    with telemetry.capture() as rec:
        with policy.autocast("cpu"):
            _, loss = model(x, y)  # (B, T, V) logits, fp32 scalar
        loss.backward()
    return rec


def plot_loss_curves(losses: dict[str, list[float]], path: pathlib.Path, *, title: str) -> None:
    """Top: training loss per step per preset (raw faint, smoothed solid). Bottom: smoothed loss relative to BF16."""
    from matplotlib.figure import Figure  # no pyplot: no global backend to switch, no figure registry to close

    fig = Figure(figsize=(11, 8.5))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    smooth = {name: _ema(values) for name, values in losses.items()}
    base = smooth[BASELINE]
    for i, (name, values) in enumerate(losses.items()):
        color = f"C{i}"
        steps = range(len(values))
        top.plot(steps, values, color=color, alpha=0.3, linewidth=0.8)
        top.plot(steps, smooth[name], color=color, linewidth=1.8, label=name)
        if name != BASELINE:
            rel = [100 * (s - b) / b for s, b in zip(smooth[name], base)]
            bottom.plot(steps, rel, color=color, linewidth=1.6, label=name)
    top.set_ylabel("training loss (nats / byte)")
    top.set_title(f"{title}\nfaint: per step · solid: EMA (β = {SMOOTHING})")
    top.legend(title="preset")
    top.grid(alpha=0.3)

    bottom.axhspan(-RANGE_BAND_PCT, RANGE_BAND_PCT, color="0.85", alpha=0.6, label=f"±{RANGE_BAND_PCT:g}%")
    for sign in (1, -1):
        bottom.axhline(sign * DEEPSEEK_V3_PCT, color="0.3", linestyle="--", linewidth=1,
                       label=f"±{DEEPSEEK_V3_PCT}% (DeepSeek-V3 FP8 vs BF16)" if sign == 1 else None)
    bottom.axhline(0, color="black", linewidth=0.8)
    low, high = bottom.get_ylim()
    bottom.set_ylim(min(low, -1.5 * RANGE_BAND_PCT), max(high, 1.5 * RANGE_BAND_PCT))
    bottom.set_xlabel("step")
    bottom.set_ylabel("smoothed loss vs BF16 (%)")
    bottom.set_title("relative difference to BF16 (positive: higher loss than BF16)")
    bottom.legend(fontsize="small", ncol=2)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_numerics(numerics: dict[str, telemetry.Recorder], path: pathlib.Path) -> None:
    """One heatmap per FP8 preset: rows are layers, columns tensor roles; colour and number are the SQNR (dB) of the
    cast, averaged over the batch's casts; a second line gives the saturated / underflowed fractions when non-zero."""
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    tables = {}
    for name, rec in numerics.items():
        cells = rec.by_layer()
        layers = list(dict.fromkeys(layer for layer, _ in cells))
        tables[name] = (layers, cells)
    roles = [r.value for r in ROLES]
    values = [sum(r.sqnr_db for r in recs) / len(recs) for _, cells in tables.values() for recs in cells.values()]
    finite = [v for v in values if math.isfinite(v)] or [0.0]
    norm = Normalize(vmin=min(finite), vmax=max(finite))
    n_layers = max(len(layers) for layers, _ in tables.values())

    fig = Figure(figsize=(2.2 + 3.6 * len(tables), 1.6 + 0.55 * n_layers))
    axes = fig.subplots(1, len(tables), squeeze=False)
    image = None
    for ax, (name, (layers, cells)) in zip(axes[0], tables.items()):
        grid = [[math.nan] * len(roles) for _ in layers]
        for (layer, role), recs in cells.items():
            i, j = layers.index(layer), roles.index(role)
            grid[i][j] = sum(r.sqnr_db for r in recs) / len(recs)
            sat = max(r.saturated for r in recs)
            under = max(r.underflow for r in recs)
            text = f"{grid[i][j]:.1f}"
            if sat >= ANNOTATE_FRACTION or under >= ANNOTATE_FRACTION:
                text += f"\nsat {sat:.1%} uf {under:.1%}"
            dark = norm(grid[i][j]) < 0.5 if math.isfinite(grid[i][j]) else False
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if dark else "black")
        image = ax.imshow(grid, cmap="viridis", norm=norm, aspect="auto")
        ax.set_xticks(range(len(roles)), roles)
        ax.set_yticks(range(len(layers)), layers if ax is axes[0][0] else [""] * len(layers))
        fmts = sorted({r.fmt for recs in cells.values() for r in recs})
        ax.set_title(f"{name}\n({', '.join(fmts)})", fontsize=10)
        ax.set_xlabel("tensor role")
    axes[0][0].set_ylabel("layer")
    fig.suptitle("FP8 cast numerics after training: SQNR (dB, higher is better) per layer and role, one batch\n"
                 "second line: saturated (sat) / flushed-to-zero (uf) fractions where ≥ 0.05%; layers the policy "
                 "keeps out of FP8 (first q/k/v projections, head) are absent", fontsize=10)
    fig.colorbar(image, ax=axes[0].tolist(), label="SQNR (dB)", fraction=0.03, pad=0.02)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def finished_result(config: TrainConfig) -> TrainResult | None:
    """The TrainResult of a run of `config` that already finished in config.out, rebuilt from its log.csv, val.csv
    and final checkpoint; None when there is none, or it was made with another config or stopped early.

    Only the summary's fields are rebuilt: losses, final loss, validation losses, tokens/s (from the per-step
    timings), skipped steps and the shadow check's switches (from the checkpoint's shadow state)."""
    out = pathlib.Path(config.out)
    manifest = out / CHECKPOINT_DIR / MANIFEST_FILE
    if not (manifest.exists() and (out / "log.csv").exists() and (out / "val.csv").exists()):
        return None
    extra = checkpoint_extra(out / CHECKPOINT_DIR)
    if extra.get("step") != config.steps or extra.get("config") != dataclasses.asdict(config):
        return None
    with open(out / "log.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    with open(out / "val.csv", newline="") as f:
        val = tuple((int(r["step"]), float(r["val_loss"])) for r in csv.DictReader(f))
    if len(rows) != config.steps or not val or val[-1][0] != config.steps:
        return None
    applied = [float(r["loss"]) for r in rows if r["skipped"] == "0"]
    seconds = sum(1 / float(r["tokens_per_s"]) for r in rows)  # per token; dt = tokens_per_step / tokens_per_s
    events = extra.get("shadow", {}).get("events", [])
    return TrainResult(first_step=0, losses=tuple(float(r["loss"]) for r in rows),
                       final_loss=applied[-1] if applied else math.nan, val_losses=val,
                       tokens_per_s=len(rows) / seconds if seconds else 0.0,
                       skipped=tuple((int(r["step"]), r["reason"]) for r in rows if r["skipped"] != "0"),
                       shadow_events=tuple((e["step"], e["switched_to"], e["reason"]) for e in events))


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
        reuse: take the result of a preset whose run already finished in out/p with the same config (see
            `finished_result`) instead of training it again, e.g. after an interrupted compare.
    Returns:
        The summary written to summary.json: {"command", "config", "presets": {name: metrics}, "files"}.
        rel_diff_vs_bf16 is (val_loss - val_loss_bf16) / val_loss_bf16, a fraction. numerics_heatmap.png is written
        only when an FP8 preset is among `presets` ("files" lists what was written).
    Raises:
        ValueError: an unknown or repeated preset, or an invalid `base` (before anything trains).
    """
    presets = list(presets)
    if unknown := [p for p in presets if p not in PRESETS]:
        raise ValueError(f"presets must be keys of {list(PRESETS)}, got unknown {unknown}")
    if len(set(presets)) != len(presets):
        raise ValueError(f"presets must not repeat, got {presets}")
    if BASELINE not in presets:
        presets.insert(0, BASELINE)
    out = pathlib.Path(out)
    configs = {p: dataclasses.replace(base, preset=p, out=str(out / p), resume=False,
                                      checkpoint_every=base.checkpoint_every or base.steps,
                                      shadow_every=base.shadow_every if PRESETS[p].recipe is not None else 0)
               for p in presets}

    results = {}
    for p, config in configs.items():
        if reuse and (done := finished_result(config)) is not None:
            log.info("minifloat: compare: reusing the finished run of %s in %s", p, config.out)
            results[p] = done
            continue
        log.info("minifloat: compare: training %s into %s", p, config.out)
        results[p] = train(config, progress=progress)
    metrics = {p: _summarize(r) for p, r in results.items()}
    baseline = metrics[BASELINE]["final_val_loss"]
    for m in metrics.values():
        m["rel_diff_vs_bf16"] = (m["final_val_loss"] - baseline) / baseline

    files = {"summary": out / "summary.json", "loss_curves": out / "loss_curves.png"}
    title = (f"{base.model} Llama, {base.steps} steps, batch {base.batch_size} × {base.seq_len} bytes, "
             f"seed {base.seed}")
    plot_loss_curves({p: list(r.losses) for p, r in results.items()}, files["loss_curves"], title=title)
    fp8 = [p for p in presets if PRESETS[p].recipe is not None]
    if fp8:
        files["numerics_heatmap"] = out / "numerics_heatmap.png"
        plot_numerics({p: capture_numerics(configs[p]) for p in fp8}, files["numerics_heatmap"])

    summary = {"command": _command(presets, base, out),
               "config": {k: v for k, v in dataclasses.asdict(base).items() if k not in ("preset", "out", "resume")},
               "presets": metrics, "files": {k: str(v) for k, v in files.items()}}
    text = json.dumps(summary, indent=1)
    files["summary"].write_text(text)
    return json.loads(text)  # exactly what the file holds (tuples become lists)
