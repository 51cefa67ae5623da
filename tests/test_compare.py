"""compare(): one tiny run per preset, summary.json and the two figures; the `minifloat compare` command."""

import json
import math

import pytest

from minifloat.cli import main
from minifloat.training.compare import _command, _summarize, compare
from minifloat.training.loop import TrainConfig, TrainResult

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MIN_PNG_BYTES = 10_000  # a readable figure with text and curves is well above this; a blank one is ~5 kB
METRICS = ("final_train_loss", "final_val_loss", "rel_diff_vs_bf16", "tokens_per_s", "skipped_steps", "fallbacks")
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
        assert set(metrics) == set(METRICS), preset
        for key in METRICS:
            assert math.isfinite(metrics[key]), (preset, key)
        assert (out / preset / "log.csv").is_file()


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
        for key in ("final_train_loss", "final_val_loss", "rel_diff_vs_bf16", "skipped_steps", "fallbacks"):
            assert again["presets"][name][key] == m[key], (name, key)
        # tokens/s comes back from the per-step timings of log.csv: the same up to their rounding in the file
        assert again["presets"][name]["tokens_per_s"] == pytest.approx(m["tokens_per_s"], rel=1e-6)


def test_reuse_trains_again_when_the_config_differs(summary, monkeypatch):
    out, _ = summary
    import minifloat.training.compare as compare_module

    trained = []
    monkeypatch.setattr(compare_module, "train", lambda config, **kw: trained.append(config.preset) or
                        (_ for _ in ()).throw(RuntimeError("stop")))
    with pytest.raises(RuntimeError, match="stop"):
        compare(["fp8-current"], base=TrainConfig(**TINY, seed=1), out=out, progress=False, reuse=True)
    assert trained == ["bf16"]  # seed 1 was never run here: nothing to reuse


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
