"""compare(): one tiny run per preset, summary.json and the two figures; the `minifloat compare` command."""

import csv
import io
import json
import math
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import pytest
from rich.console import Console

from minifloat.cli import main
from minifloat.cli.compare import COLUMNS, SPEED_COLUMNS, speed_table, summary_table, table_note
from minifloat.training.compare import (BASELINE, DEEPSEEK_V3_PCT, DEFAULT_CONFIG, DEFAULT_PRESETS, GPU_SETTINGS,
                                        RANGE_BAND_PCT, SMOOTHING,
                                        TAIL_FRACTION, ZERO_LABEL, _command, _summarize, compare, loss_curves_figure,
                                        noise_band_pct)
from minifloat.training.loop import TrainConfig, TrainResult
from minifloat.training.rundir import RunExistsError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MIN_PNG_BYTES = 10_000  # a readable figure with text and curves is well above this; a blank one is ~5 kB
METRICS = ("final_train_loss", "final_val_loss", "rel_diff_vs_bf16", "tokens_per_s", "speedup_vs_bf16",
           "warmup_steps_excluded", "skipped_steps", "fallbacks", "low_precision_layers")
GPU_METRICS = ("mfu", "peak_memory_gib")  # None on a CPU: no peak FLOP/s, no device memory to measure
TERMINAL_COLUMNS = 80  # issue 22: the compare table fits an 80-column terminal
TINY = dict(model="tiny", steps=4, batch_size=4, seq_len=32, eval_every=2, eval_batches=1, max_bytes=200_000)


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    return out, compare(["fp8-current"], base=TrainConfig(**TINY, seed=0), out=out, progress=False)


def test_bf16_is_added_first_and_is_its_own_baseline(summary):
    _, s = summary
    assert list(s["presets"]) == ["bf16", "fp8-current"]
    assert s["presets"]["bf16"]["rel_diff_vs_bf16"] == 0


def test_summary_json_has_finite_metrics_per_preset(summary):
    out, s = summary
    written = json.loads((out / "summary.json").read_text())
    assert written == s
    assert written["command"].startswith("minifloat compare --presets bf16,fp8-current")
    assert written["config"]["steps"] == TINY["steps"]
    for preset, metrics in written["presets"].items():
        assert set(metrics) == set(METRICS + GPU_METRICS), preset
        for key in METRICS:
            assert math.isfinite(metrics[key]), (preset, key)
        assert [metrics[key] for key in GPU_METRICS] == [None, None]
        assert metrics["speedup_vs_bf16"] == metrics["tokens_per_s"] / written["presets"]["bf16"]["tokens_per_s"]
        assert (out / preset / "log.csv").is_file()
    assert written["presets"]["bf16"]["speedup_vs_bf16"] == 1.0 and written["device"] == "cpu"
    # the tiny Llama's 15 linears: its first q/k/v and the head stay in high precision
    assert [written["presets"][p]["low_precision_layers"] for p in ("bf16", "fp8-current")] == [0, 11]


@pytest.mark.parametrize("name", ["loss_curves.png", "numerics_heatmap.png"])
def test_figures_are_pngs(summary, name):
    out, _ = summary
    data = (out / name).read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > MIN_PNG_BYTES


@pytest.mark.parametrize("presets", [["fp7"], ["bf16", "bf16"]])
def test_rejects_bad_presets(presets, tmp_path):
    with pytest.raises(ValueError, match="presets"):
        compare(presets, base=TrainConfig(**TINY), out=tmp_path)


def test_summary_counts_fallbacks():
    result = TrainResult(first_step=0, losses=(5.0, 4.0), final_loss=4.0, val_losses=((2, 4.5),), tokens_per_s=1.0,
                         skipped=(),
                         shadow_events=((0, "bf16", "unhealthy"), (4, "fp8", "healthy"), (6, "bf16", "unhealthy")))
    assert _summarize(result)["fallbacks"] == 2
    assert result.fallbacks == ((0, "unhealthy"), (6, "unhealthy"))  # derived from the switches to bf16


def test_command_names_the_shadow_check(tmp_path):
    base = TrainConfig(**TINY, preset="fp8-delayed", shadow_every=5)
    assert "--shadow-every 5 --shadow-threshold 0.05" in _command(["bf16", "mxfp8"], base, tmp_path)
    assert "--shadow-every" not in _command(["bf16"], TrainConfig(**TINY), tmp_path)


def test_cli_compare_with_fp8_where_it_pays(tmp_path, capsys):
    # at 128 tokens per micro-batch no layer of the tiny Llama pays: the FP8 preset trains bf16's numbers, the
    # summary says how many layers ran FP8 (none), and no heatmap of casts that never happened is drawn; an earlier
    # comparison's heatmap is not left behind by --overwrite (it was), nor are its other presets' runs unmentioned
    (tmp_path / "numerics_heatmap.png").write_bytes(b"earlier")
    (tmp_path / "mxfp8").mkdir()
    (tmp_path / "mxfp8" / "log.csv").write_text("step,loss\n")
    assert main(["compare", "--presets", "bf16,fp8-delayed", "--steps", "2", "--batch-size", "4", "--seq-len",
                 "32", "--max-bytes", "200000", "--fp8-layers", "auto", "--out", str(tmp_path), "--overwrite"]) == 0
    with open(tmp_path / "fp8-delayed" / "log.csv") as f:  # no step ran FP8: the mode column says none (said fp8)
        assert [row["mode"] for row in csv.DictReader(f)] == ["", ""]
    assert (tmp_path / "mxfp8" / "log.csv").exists()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "--fp8-layers auto" in summary["command"] and summary["config"]["fp8_layers"] == "auto"
    assert [summary["presets"][p]["low_precision_layers"] for p in ("bf16", "fp8-delayed")] == [0, 0]
    assert summary["presets"]["fp8-delayed"]["final_val_loss"] == summary["presets"]["bf16"]["final_val_loss"]
    assert "numerics_heatmap" not in summary["files"] and not (tmp_path / "numerics_heatmap.png").exists()
    out = capsys.readouterr().out
    assert "--fp8-layers auto: low-precision linears per preset: fp8-delayed 0." in out
    assert "also holds runs of presets not in this comparison, left as they were: mxfp8" in " ".join(out.split())


@pytest.mark.parametrize("presets, extra, words", [
    ([], {}, "at least one"),
    (["fp32"], dict(fp8_layers="auto", preset="fp8-delayed"), "fp8_layers=auto acts on FP8/FP4 presets"),
    (["bf16"], dict(shadow_every=2, preset="fp8-delayed"), "shadow_every=2 acts on FP8/FP4 presets"),
], ids=["no-preset", "fp8-layers-without-fp8", "shadow-without-fp8"])
def test_settings_that_would_do_nothing_are_refused(tmp_path, presets, extra, words):
    # each trained only bf16 and exited 0, where train refuses the same settings
    with pytest.raises(ValueError, match=words):
        compare(presets, base=TrainConfig(**TINY, **extra), out=tmp_path / "c", progress=False)
    assert not (tmp_path / "c").exists()


def test_cli_compare(tmp_path, capsys):
    assert main(["compare", "--presets", "bf16,mxfp8", "--steps", "3", "--batch-size", "4", "--seq-len", "32",
                 "--max-bytes", "200000", "--shadow-every", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "mxfp8" in out and "fallbacks" in out
    assert (tmp_path / "numerics_heatmap.png").is_file()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "--shadow-every 1" in summary["command"]
    assert {name: m["fallbacks"] for name, m in summary["presets"].items()} == {"bf16": 0, "mxfp8": 0}


def test_cli_compare_rejects_unknown_preset(tmp_path):
    assert main(["compare", "--presets", "bf16,fp7", "--out", str(tmp_path)]) == 2


def test_reuse_rebuilds_finished_runs_without_training(summary, monkeypatch):
    out, s = summary
    import minifloat.training.compare as compare_module

    def no_training(*args, **kwargs):
        raise AssertionError("reuse=True trained a run that had already finished")

    monkeypatch.setattr(compare_module, "train", no_training)
    again = compare(["fp8-current"], base=TrainConfig(**TINY, seed=0), out=out, progress=False, reuse=True)
    for name, m in s["presets"].items():
        for key in ("final_train_loss", "final_val_loss", "rel_diff_vs_bf16", "warmup_steps_excluded",
                    "skipped_steps", "fallbacks"):
            assert again["presets"][name][key] == m[key], (name, key)
        # tokens/s comes back from the per-step timings of log.csv, the same warm-up steps left out: the same up to
        # their rounding in the file
        assert again["presets"][name]["tokens_per_s"] == pytest.approx(m["tokens_per_s"], rel=1e-6)


def test_reuse_trains_again_when_the_config_differs(summary, monkeypatch):
    out, _ = summary
    import minifloat.training.compare as compare_module

    trained = []
    monkeypatch.setattr(compare_module, "train", lambda config, **kw: trained.append(config.preset) or
                        (_ for _ in ()).throw(RuntimeError("stop")))
    # seed 1 was never run here: nothing to reuse, and the seed-0 runs are not replaced without overwrite
    with pytest.raises(RunExistsError, match="--reuse cannot take \\(bf16: made with --seed 0, this comparison asks "
                                              "for 1; fp8-current: made with --seed 0.*--overwrite"):
        compare(["fp8-current"], base=TrainConfig(**TINY, seed=1), out=out, progress=False, reuse=True)
    assert trained == []
    with pytest.raises(ValueError, match="--reuse keeps the finished runs in --out and --overwrite replaces them"):
        compare(["fp8-current"], base=TrainConfig(**TINY, seed=1, overwrite=True), out=out, progress=False,
                reuse=True)
    with pytest.raises(RuntimeError, match="stop"):
        compare(["fp8-current"], base=TrainConfig(**TINY, seed=1, overwrite=True), out=out, progress=False)
    assert trained == ["bf16"]


def test_an_earlier_comparison_is_refused_and_kept(summary, capsys):
    out, _ = summary
    before = {p: p.read_bytes() for p in sorted(pathlib.Path(out).rglob("*")) if p.is_file()}
    assert main(["compare", "--out", str(out), "--presets", "fp8-current", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite" in err and "Traceback" not in err
    assert {p: p.read_bytes() for p in sorted(pathlib.Path(out).rglob("*")) if p.is_file()} == before


def test_reuse_keeps_the_shadow_fallbacks_with_their_reasons(tmp_path, monkeypatch):
    # every check unhealthy (FP8 and BF16 losses always differ by more than 1e-9): a fallback after 3 checks
    base = TrainConfig(**TINY, seed=0, preset="fp8-current", shadow_every=1, shadow_threshold=1e-9)
    first = compare(["fp8-current"], base=base, out=tmp_path, progress=False)
    assert first["presets"]["fp8-current"]["fallbacks"] == 1
    import minifloat.training.compare as compare_module

    monkeypatch.setattr(compare_module, "train", lambda *a, **k: (_ for _ in ()).throw(AssertionError("trained")))
    config = compare_module.dataclasses.replace(base, out=str(tmp_path / "fp8-current"),
                                                checkpoint_every=base.checkpoint_every or base.steps)
    rebuilt = compare_module.finished_result(config)
    assert len(rebuilt.fallbacks) == 1 and "unhealthy" in rebuilt.fallbacks[0][1]
    again = compare(["fp8-current"], base=base, out=tmp_path, progress=False, reuse=True)
    assert again["presets"] == first["presets"] | {
        p: {**m, "tokens_per_s": again["presets"][p]["tokens_per_s"]} for p, m in first["presets"].items()}


def test_summary_reports_the_warmup_steps_left_out_of_tokens_per_s(summary):
    from minifloat.training.loop import warmup_steps

    _, s = summary
    expected = warmup_steps(TrainConfig(**TINY), TINY["steps"])
    assert expected > 0  # the tiny runs are long enough to leave the warm-up out
    assert {m["warmup_steps_excluded"] for m in s["presets"].values()} == {expected}


# --- the printed table -------------------------------------------------------------------------------------------

def fake_summary(*, warmup: int, shadow_every: int = 0) -> dict:
    """A summary of the default presets with the widest numbers a run prints (a GPU's tok/s, two-digit counts)."""
    presets = {name: {"final_train_loss": 12.3456 + i, "final_val_loss": 12.4567 + i,
                      "rel_diff_vs_bf16": -0.1234 * i if i else 0.0, "tokens_per_s": 12_345_678.9 * (i + 1),
                      "warmup_steps_excluded": warmup, "skipped_steps": 10 + i, "fallbacks": 20 + i,
                      "speedup_vs_bf16": 1.0 + 0.35 * i, "mfu": 0.4567 - 0.05 * i, "peak_memory_gib": 123.4 + i}
               for i, name in enumerate(DEFAULT_PRESETS)}
    return {"config": {"model": "100m", "steps": 100_000, "batch_size": 64, "seq_len": 2048, "seed": 12345,
                       "shadow_every": shadow_every}, "presets": presets, "device": "NVIDIA H100 80GB HBM3"}


def render(summary: dict, tables=(summary_table, speed_table)) -> list[str]:
    """The tables and their note as `minifloat compare` prints them, in an 80-column terminal."""
    console = Console(width=TERMINAL_COLUMNS, record=True, file=io.StringIO())
    for table in tables:
        console.print(table(summary))
    for line in table_note(summary):
        console.print(line, highlight=False)
    return console.export_text().splitlines()


@pytest.mark.parametrize("shadow_every", [0, 5])
def test_table_fits_80_columns_without_cutting_a_cell(shadow_every):
    s = fake_summary(warmup=3, shadow_every=shadow_every)
    lines = render(s)
    assert max(len(line) for line in lines) <= TERMINAL_COLUMNS
    assert not any("…" in line for line in lines)
    header = [line for line in lines if line.startswith("┃")]  # the headers' lines, two per table
    for columns, lines_of in ((COLUMNS, header[:2]), (SPEED_COLUMNS, header[2:])):
        for column in columns:  # every header whole: each of its lines' words in its own header line
            for i, part in enumerate(column.split("\n")):
                assert part in lines_of[i + len(lines_of) - len(column.split("\n"))], column
    for name, m in s["presets"].items():
        losses = [name, f"{m['final_train_loss']:.4f}", f"{m['final_val_loss']:.4f}", f"{m['rel_diff_vs_bf16']:+.2%}",
                  str(m["skipped_steps"])]
        speed = [name, f"{m['tokens_per_s']:,.0f}", f"{m['speedup_vs_bf16']:.2f}×", f"{m['mfu']:.1%}",
                 f"{m['peak_memory_gib']:.1f} GiB"]
        for cells in (losses, speed):  # the row is one line, every number whole
            assert sum(all(c in line for c in cells) for line in lines) == 1, (name, cells)
    for note in table_note(s):
        assert note in lines  # a note line is never wrapped either


def fallback_cells(summary: dict) -> dict[str, str]:
    """preset -> its fallbacks cell, the last column of the rendered table's body rows."""
    rows = [line.split("│")[1:-1] for line in render(summary, tables=(summary_table,)) if line.startswith("│")]
    return {cells[0].strip(): cells[-1].strip() for cells in rows}


def test_table_shows_fallbacks_only_for_presets_under_the_shadow_check():
    shadowed = fallback_cells(fake_summary(warmup=1, shadow_every=5))
    assert shadowed[BASELINE] == "-"  # BF16 runs without the shadow check
    assert shadowed["mxfp8"] == str(20 + DEFAULT_PRESETS.index("mxfp8"))
    assert set(fallback_cells(fake_summary(warmup=1)).values()) == {"-"}


@pytest.mark.parametrize("warmup, says", [(3, "after the first 3 steps (warm-up)"),
                                          (1, "after the first step (warm-up)"),
                                          (0, "over every step")])
def test_note_says_how_many_warmup_steps_tokens_per_s_leaves_out(warmup, says):
    (speed,) = [line for line in table_note(fake_summary(warmup=warmup)) if line.startswith("tok/s")]
    assert says in speed


# --- the loss-curve figure ---------------------------------------------------------------------------------------

CURVE_STEPS = 400
OFFSET_PCT = 0.1  # preset i's loss is BF16's times 1 + i * OFFSET_PCT / 100 (and noise): ±0.4%, as in issue 22
NOISE_PCT = 0.2  # each preset's per-step loss differs from BF16's by this much noise (standard deviation, %)


def synthetic_losses(*, noise_pct: float = NOISE_PCT, seed: int = 0) -> dict[str, list[float]]:
    """BF16's loss curve and, per other default preset, it times 1 + i·OFFSET_PCT% with independent per-step noise."""
    rng = random.Random(seed)
    bf16 = [2.0 + 3.0 * math.exp(-step / 60) + 0.05 * math.sin(step) for step in range(CURVE_STEPS)]
    return {name: [v * (1 + (i * OFFSET_PCT + (rng.gauss(0, noise_pct) if i else 0)) / 100) for v in bf16]
            for i, name in enumerate(DEFAULT_PRESETS)}


@pytest.fixture(scope="module")
def curves():
    fig = loss_curves_figure(synthetic_losses(), title="test")
    return {ax.get_label(): ax for ax in fig.axes if ax.get_label()}, fig


def preset_lines(ax):
    return {line.get_label(): line for line in ax.get_lines() if line.get_label() in DEFAULT_PRESETS}


def test_figure_has_the_loss_tail_and_difference_axes(curves):
    axes, _ = curves
    assert set(axes) == {"loss", "tail", "diff"}


def test_loss_panel_draws_bf16_and_names_the_presets_on_its_line(curves):
    axes, _ = curves
    assert set(preset_lines(axes["loss"])) == {BASELINE}  # ±0.4% of the loss: one line at this scale, not five
    title = axes["loss"].get_title()
    assert all(p in title for p in DEFAULT_PRESETS if p != BASELINE), title


def test_loss_panel_draws_a_preset_apart_from_bf16():
    losses = synthetic_losses()
    losses["mxfp8"] = [v * (1 + 0.2 * step / CURVE_STEPS) for step, v in enumerate(losses[BASELINE])]  # +20% at the end
    fig = loss_curves_figure(losses, title="test")
    (loss,) = [ax for ax in fig.axes if ax.get_label() == "loss"]
    assert set(preset_lines(loss)) == {BASELINE, "mxfp8"}
    assert "mxfp8" not in loss.get_title()


def test_tail_panel_has_a_box_per_preset_centred_on_its_offset(curves):
    axes, _ = curves
    tail = axes["tail"]
    others = [p for p in DEFAULT_PRESETS if p != BASELINE]
    assert [t.get_text() for t in tail.get_xticklabels()] == others
    means = [line for line in tail.get_lines() if line.get_marker() not in ("", "None", None)]
    assert len(means) == len(others)
    for name, mean in zip(others, means):  # the mean of ~100 per-step differences: within 4 standard errors
        expected = DEFAULT_PRESETS.index(name) * OFFSET_PCT
        n = CURVE_STEPS - int(CURVE_STEPS * (1 - TAIL_FRACTION))
        assert abs(mean.get_ydata()[0] - expected) < 4 * NOISE_PCT / math.sqrt(n), name


def test_difference_panel_has_one_distinguishable_curve_per_preset(curves):
    axes, _ = curves
    lines = preset_lines(axes["diff"])
    others = [p for p in DEFAULT_PRESETS if p != BASELINE]
    assert sorted(lines) == sorted(others)  # BF16 itself is the zero line, not a curve
    assert len({(line.get_color(), str(line.get_linestyle())) for line in lines.values()}) == len(others)
    # in grayscale the colours merge: dash pattern and marker alone still tell the curves apart
    assert len({(str(line.get_linestyle()), line.get_marker()) for line in lines.values()}) == len(others)


def noise_band(ax) -> float:
    (band,) = [patch for patch in ax.patches if patch.get_label().startswith("noise")]
    low, high = band.get_y(), band.get_y() + band.get_height()
    assert low == pytest.approx(-high)
    return high


def test_noise_band_is_the_smoothed_noise_of_the_data(curves):
    axes, _ = curves
    # an EMA of independent noise of standard deviation σ has σ·sqrt((1-β)/(1+β)); the band is 2 of those
    expected = 2 * NOISE_PCT * math.sqrt((1 - SMOOTHING) / (1 + SMOOTHING))
    assert noise_band(axes["diff"]) == pytest.approx(expected, rel=0.15)  # σ estimated from 400 steps
    assert noise_band_pct(synthetic_losses(noise_pct=2 * NOISE_PCT)) == pytest.approx(2 * expected, rel=0.15)


def test_difference_panel_fits_the_curves_not_a_fixed_band(curves):
    axes, _ = curves
    diff = axes["diff"]
    low, high = diff.get_ylim()
    assert noise_band(diff) < 0.5 * (high - low)  # the band shades part of the panel, not all of it
    assert low < -DEEPSEEK_V3_PCT and high > DEEPSEEK_V3_PCT  # DeepSeek-V3's lines in view
    (deepseek,) = [line for line in diff.get_lines() if "DeepSeek-V3" in line.get_label()]
    assert set(deepseek.get_ydata()) == {DEEPSEEK_V3_PCT}
    # the curves span -0.1% .. +0.5%: the ±1% lines would stretch the view, so they are left out
    assert high < RANGE_BAND_PCT and not [line for line in diff.get_lines() if "1%" in line.get_label()]
    (zero,) = [line for line in diff.get_lines() if set(line.get_ydata()) == {0}]
    assert zero.get_label().startswith("_")  # not in the legend ...
    assert ZERO_LABEL in [text.get_text() for text in diff.texts]  # ... but written at the line


def test_legend_names_every_line_once_and_covers_no_axes(curves):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    axes, fig = curves
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    (legend,) = fig.legends
    labels = [text.get_text() for text in legend.get_texts()]
    assert set(DEFAULT_PRESETS) <= set(labels) and len(labels) == len(set(labels))
    assert ZERO_LABEL not in labels  # "bf16" once, not also "= bf16"
    box = legend.get_window_extent(canvas.get_renderer())
    for name, ax in axes.items():
        assert not box.overlaps(ax.get_window_extent(canvas.get_renderer())), name


def test_the_table_is_whole_in_a_log(summary, monkeypatch):
    """Output that is not a terminal (rich assumes 80 columns there) still gets every number whole."""
    from minifloat.cli import common

    _, result = summary
    log = io.StringIO()
    monkeypatch.setattr(common, "console", Console(file=log, width=80))
    common.print_table(summary_table(result))
    common.print_table(speed_table(result))
    text = log.getvalue()
    assert "…" not in text and all(f"{m['tokens_per_s']:,.0f}" in text and f"{m['final_val_loss']:.4f}" in text
                                   for m in result["presets"].values())
    assert common.console.width == 80  # restored


# --- the command line: train's own flags, the device's defaults ---------------------------------------------------

def compare_args(argv: list[str]):
    from minifloat.cli import build_parser

    return build_parser(["compare"]).parse_args(["compare", *argv])


def test_compare_flags_are_trains_settings():
    """Every setting compare takes is a TrainConfig setting with train's flag, help and type (one source of truth)."""
    from minifloat.cli.compare import settings
    from minifloat.cli.train import _flagged

    assert set(settings()) <= set(_flagged()) and "device" in settings()
    args = compare_args(["--tokenizer", "tok.json", "--attention", "sdpa", "--lr", "3e-3", "--grad-accum", "2",
                         "--compile", "--compile-mode", "max-autotune", "--device", "cpu"])
    from minifloat.cli.compare import base_config

    base = base_config(args)
    assert (base.tokenizer, base.attention, base.lr, base.min_lr, base.grad_accum, base.compile, base.compile_mode) \
        == ("tok.json", "sdpa", 3e-3, 3e-3 / 10, 2, True, "max-autotune")
    assert base.steps == DEFAULT_CONFIG.steps and base.model == DEFAULT_CONFIG.model  # the CPU's defaults


@pytest.mark.parametrize("value, expected", [("on", True), ("off", False)])
def test_on_off_flags_are_read_as_train_reads_them(value, expected):
    """`--tf32 on|off` failed whatever the value ("--tf32 must be a bool, got 'off'"): compare passed the word."""
    from minifloat.cli.compare import base_config

    assert base_config(compare_args(["--tf32", value])).tf32 is expected
    assert f"--tf32 {value}" in _command(["bf16"], base_config(compare_args(["--tf32", value])), pathlib.Path("x")) \
        or expected  # on is the default, which the command line leaves out


def test_on_cuda_the_defaults_are_the_gpu_experiment(monkeypatch):
    """--device cuda (faked: this machine may have no GPU) gives GPU_SETTINGS; a model with a shorter context gets
    its own max_seq_len, not an invalid --seq-len."""
    import torch

    from minifloat.cli.compare import base_config
    from minifloat.training import compare as compare_module
    from minifloat.training.model import SIZES

    monkeypatch.setattr(compare_module, "resolve_device", lambda name: torch.device("cuda"))
    base = base_config(compare_args(["--device", "cuda"]))
    assert {k: getattr(base, k) for k in GPU_SETTINGS} == GPU_SETTINGS and base.device == "cuda"
    assert base.seq_len <= SIZES[base.model].max_seq_len
    small = base_config(compare_args(["--device", "cuda", "--model", "100m"]))
    assert small.seq_len == SIZES["100m"].max_seq_len == 1024 and small.steps == GPU_SETTINGS["steps"]
    assert "--model 1b" in _command(["bf16"], base, pathlib.Path("runs/x"))
    assert "--max-bytes" not in _command(["bf16"], base, pathlib.Path("runs/x"))  # the GPU default: no cap


def test_reuse_reads_back_what_the_run_measured(summary, monkeypatch):
    """A reused run keeps the device, MFU and peak memory its training call recorded in run.json (a GPU's speed
    table would otherwise lose them); a run.json from before they were recorded leaves them out."""
    out, _ = summary
    import minifloat.training.compare as compare_module

    monkeypatch.setattr(compare_module, "train", lambda *a, **k: pytest.fail("reuse trained a finished run"))
    run_file = out / "bf16" / "run.json"
    original = run_file.read_text()
    info = json.loads(original)
    assert info["measured"] == {"device": "cpu", "mfu": None, "peak_memory": None, "last_step": TINY["steps"]}
    try:
        info["measured"].update(mfu=0.41, peak_memory=3 * 2**30)
        run_file.write_text(json.dumps(info))
        again = compare(["fp8-current"], base=TrainConfig(**TINY, seed=0), out=out, progress=False, reuse=True)
        assert again["presets"]["bf16"]["mfu"] == 0.41 and again["presets"]["bf16"]["peak_memory_gib"] == 3.0
        assert again["device"] == "cpu"
        del info["measured"]
        run_file.write_text(json.dumps(info))
        older = compare(["fp8-current"], base=TrainConfig(**TINY, seed=0), out=out, progress=False, reuse=True)
        assert older["presets"]["bf16"]["mfu"] is None and older["presets"]["bf16"]["peak_memory_gib"] is None
    finally:
        run_file.write_text(original)


@pytest.mark.parametrize("flag", [[], ["--reuse"]], ids=["plain", "reuse"])
def test_cli_reuse_flag_reaches_compare(tmp_path, monkeypatch, flag):
    import minifloat.training.compare as compare_module

    seen = {}

    def fake(presets, *, base, out, reuse=False, progress=True):
        seen["reuse"] = reuse
        raise RunExistsError("stop here")

    monkeypatch.setattr(compare_module, "compare", fake)
    assert main(["compare", "--presets", "fp8-current", "--out", str(tmp_path), *flag]) == 2
    assert seen == {"reuse": bool(flag)}


def test_reuse_takes_runs_whatever_how_the_call_ran(summary, monkeypatch):
    """Settings of how and where a call runs (device, TF32, compile, overwrite: never inherited by a resume) do not
    make another run: a comparison made with their defaults is reused under other values."""
    out, s = summary
    import minifloat.training.compare as compare_module

    monkeypatch.setattr(compare_module, "train", lambda *a, **k: pytest.fail("reuse trained a finished run"))
    again = compare(["fp8-current"], base=TrainConfig(**TINY, seed=0, device="cpu", tf32=False, compile_mode="default"),
                    out=out, progress=False, reuse=True)
    assert again["presets"]["bf16"]["final_val_loss"] == s["presets"]["bf16"]["final_val_loss"]


def test_reuse_compares_the_data_by_content_not_by_path(tmp_path, monkeypatch):
    import minifloat.training.compare as compare_module

    data = tmp_path / "data"
    data.mkdir()
    for i, name in enumerate(["abc.py", "bisect.py", "heapq.py", "glob.py"]):
        (data / name).write_text((pathlib.Path(json.__file__).parent.parent / name).read_text())
    base = dict(TINY, max_bytes=None, data=str(data))
    compare(["bf16"], base=TrainConfig(**base), out=tmp_path / "c", progress=False)
    moved = tmp_path / "moved"
    data.rename(moved)
    monkeypatch.setattr(compare_module, "train", lambda *a, **k: pytest.fail("reuse trained a finished run"))
    compare(["bf16"], base=TrainConfig(**dict(base, data=str(moved))), out=tmp_path / "c", progress=False, reuse=True)
    (moved / "glob.py").write_text("changed = True\n" * 200)
    with pytest.raises(RunExistsError, match=r"bf16: trained on other data \(changed: glob.py\)"):
        compare(["bf16"], base=TrainConfig(**dict(base, data=str(moved))), out=tmp_path / "c", progress=False,
                reuse=True)


def test_a_train_run_folder_is_not_a_comparison_folder(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), "--steps", "1", "--batch-size", "2", "--seq-len", "16",
                 "--max-bytes", "100000", "--eval-every", "1", "--eval-batches", "1"]) == 0
    for extra in ([], ["--overwrite"]):
        assert main(["compare", "--out", str(run), "--presets", "bf16", "--steps", "1", *extra]) == 2
        assert "holds a training run (run.json); compare trains each preset into OUT/<preset>" in \
            capsys.readouterr().err
    assert not (run / "bf16").exists()


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130)])
def test_a_signal_stops_the_comparison_and_reuse_resumes_it(tmp_path, sig, status):
    """Ctrl-C used to stop only the preset training: the comparison went on, summarised a cut-short baseline against
    a finished run and exited 0. Now it stops with the preset (after its checkpoint), writes no summary, exits with
    128 + the signal, and --reuse resumes the stopped preset from its checkpoint."""
    out = tmp_path / "c"
    # the signal comes after the third logged step: 57 more steps of ~35 ms each (bf16, 2-core AMD EPYC) leave it time
    # to land mid-run
    flags = ["--presets", "bf16,fp8-current", "--steps", "60", "--batch-size", "2", "--seq-len", "16",
             "--max-bytes", "100000", "--eval-every", "60", "--eval-batches", "1", "--out", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "minifloat.cli", "compare", *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"})
    deadline = time.monotonic() + 120
    while not ((out / "bf16" / "log.csv").is_file() and
               len((out / "bf16" / "log.csv").read_text().splitlines()) > 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == status, (stdout, stderr)
    assert "Traceback" not in stderr
    assert f"stopped by {sig.name} while training bf16" in stdout and "--reuse" in stdout
    assert not (out / "summary.json").exists() and not (out / "fp8-current").exists()
    assert main(["compare", *flags, "--reuse"]) == 0
    rows = (out / "bf16" / "log.csv").read_text().splitlines()
    assert len(rows) == 1 + 60  # the header, then every step once: resumed, not trained again
    assert json.loads((out / "summary.json").read_text())["presets"]["fp8-current"]["final_val_loss"] > 0


def test_the_heatmap_puts_every_preset_on_one_layer_axis(tmp_path, monkeypatch):
    # a preset that keeps layers in high precision (nvfp4's last block, --fp8-layers) drew its own rows from the top,
    # under the first panel's layer names: blocks.0.attn.o_proj's numbers in the row labelled blocks.0.attn.q_proj
    import numpy as np
    import torch
    from matplotlib.figure import Figure

    import minifloat as mf
    from minifloat.fp8 import telemetry
    from minifloat.training.plots import plot_numerics

    def record(kept: int) -> telemetry.Recorder:
        """A 3-layer MLP in FP8 with its first `kept` layers left in high precision, one batch recorded."""
        torch.manual_seed(0)
        model = mf.convert(torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(3))), keep_first_last=False)
        for i in range(kept):
            model[i] = torch.nn.Linear(32, 32)
        with telemetry.capture() as tel:
            model(torch.randn(4, 32)).sum().backward()
        return tel

    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    plot_numerics({"all": record(0), "last two": record(1)}, tmp_path / "h.png")
    first, second = (ax for ax in figures[0].axes[:2])
    names = [t.get_text() for t in first.get_yticklabels()]
    assert names == ["0", "1", "2"]
    grid = np.ma.filled(second.images[0].get_array().astype(float), np.nan)  # NaN cells come back masked
    # layer 0 (kept) stays empty; layer 1 in its own row (the last layer's gradient, all ones, casts exactly: its
    # infinite SQNR is drawn blank in both panels)
    assert grid.shape[0] == 3 and np.isnan(grid[0]).all() and np.isfinite(grid[1]).all()
