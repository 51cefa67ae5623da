"""The `minifloat` command line: each subcommand runs through main() and returns its documented exit status."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import pytest
from rich.console import Console

from minifloat.cli import common
from minifloat.cli import main
from minifloat.numerics.formats import FORMATS

WIDE = 200  # console columns, so that table cells are not wrapped
# a small train run: tiny Llama, short sequences, a 100 kB corpus; a few seconds on 2 CPU cores
TRAIN = ["train", "--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--max-bytes", "100000",
         "--eval-batches", "1", "--checkpoint-every", "0", "--warmup", "2"]


@pytest.fixture
def console(monkeypatch) -> Console:
    """The CLI's rich console, recording and wide."""
    wide = Console(width=WIDE, record=True)
    monkeypatch.setattr(common, "console", wide)
    return wide


def _rows(out) -> list[dict]:
    with open(f"{out}/log.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_formats_json_lists_every_format(capsys):
    assert main(["formats", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == list(FORMATS)
    assert {r["name"]: r["max"] for r in rows}["e4m3"] == FORMATS["e4m3"].max


def test_demo_writes_results(tmp_path):
    assert main(["demo", "--steps", "6", "--batch", "16", "--variants", "bf16,fp8-current",
                 "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "demo.json").read_text())
    assert [r["variant"] for r in out["results"]] == ["bf16", "fp8-current"]
    assert all(len(c) == 6 for c in out["curves"].values())


def test_demo_never_overwrites_a_results_file_unasked(tmp_path, capsys):
    """An existing demo.json is refused in one line before any training, left as it was; --overwrite replaces it, and
    fp32's NaN comparisons (no FP8 cast) are written as null, which strict JSON readers accept."""
    (tmp_path / "demo.json").write_text('{"mine": 1}')
    argv = ["demo", "--steps", "3", "--batch", "8", "--variants", "fp32", "--out", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds demo.json" in err and "--overwrite" in err
    assert (tmp_path / "demo.json").read_text() == '{"mine": 1}'
    assert main([*argv, "--overwrite"]) == 0
    text = (tmp_path / "demo.json").read_text()
    result = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))["results"][0]
    assert result["variant"] == "fp32" and result["min_sqnr_db"] is None


def test_demo_rejects_unknown_variant():
    assert main(["demo", "--variants", "fp7"]) == 2


@pytest.mark.parametrize("preset", ["bf16", "fp8-delayed"])
def test_audit_passes_policy_presets(preset, tmp_path):
    path = tmp_path / "audit.json"
    assert main(["audit", "--preset", preset, "--batch", "4", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["violations"] == []
    assert report["records"], "the audit recorded no ops"


def test_audit_json_holds_the_preflight_findings(tmp_path):
    # --preflight --json wrote the audit alone: the FP16-range findings were only on the terminal
    path = tmp_path / "audit.json"
    status = main(["audit", "--model", "tiny", "--preset", "fp8-delayed", "--batch", "2", "--preflight",
                   "--json", str(path)])
    report = json.loads(path.read_text())
    assert report["violations"] == [] and report["records"]
    pre = report["preflight"]
    assert pre["tensors"] and status == (0 if pre["fp16_safe"] else 1)
    assert not any("fp8_state" in t["name"] for t in pre["tensors"])


def test_audit_rejects_unknown_preset():
    assert main(["audit", "--preset", "fp9"]) == 2


def test_audit_llama_passes_and_lists_its_modules(tmp_path, console):
    path = tmp_path / "audit.json"
    assert main(["audit", "--model", "tiny", "--preset", "fp8-delayed", "--batch", "2", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["violations"] == []
    modules = {r["module"] for r in report["records"]}
    assert {"wte", "lm_head", "blocks.0.attn", "blocks.1.mlp.down_proj"} <= modules
    text = console.export_text()
    assert "audit passed" in text and "lm_head" in text and "blocks.0.attn.k_proj" in text


def test_train_with_nan_steps_skips_them(tmp_path, console):
    out = tmp_path / "nan"
    assert main([*TRAIN, "--preset", "fp8-delayed", "--steps", "12", "--eval-every", "6", "--nan-steps", "3,7",
                 "--out", str(out)]) == 0
    text = console.export_text()
    assert "3 (nonfinite_loss), 7 (nonfinite_loss)" in text
    rows = _rows(out)
    assert [int(r["step"]) for r in rows if r["skipped"] == "1"] == [3, 7]
    assert {r["reason"] for r in rows if r["skipped"] == "1"} == {"nonfinite_loss"}
    assert math.isnan(float(rows[3]["loss"])) and math.isfinite(float(rows[-1]["loss"]))
    final = next(line for line in text.splitlines() if "final train loss" in line)
    assert math.isfinite(float(final.split()[-2]))  # "│ final train loss │ 4.1234 │"


def test_train_with_shadow_and_rollback_reports_them(tmp_path, console):
    out = tmp_path / "safety"
    assert main([*TRAIN, "--preset", "fp8-delayed", "--steps", "8", "--eval-every", "8", "--nan-steps", "4,5",
                 "--rollback-after", "2", "--snapshot-every", "3", "--shadow-every", "1", "--shadow-threshold",
                 "1e-9", "--embedding-grad-alpha", "0.1", "--out", str(out)]) == 0
    text = console.export_text()
    assert "5 (back to 3, 3 batches skipped)" in text  # snapshots at 0 and 3; batches 3..5 dropped
    assert "2 (to bf16)" in text  # three unhealthy checks in a row, at steps 0, 1, 2
    assert [r["mode"] for r in _rows(out)][:4] == ["fp8", "fp8", "bf16", "bf16"]


@pytest.mark.parametrize("argv, field", [
    (["--nan-steps", "3,x"], "nan_steps"),
    (["--nan-steps", "3,-1"], "nan_steps"),
    (["--nan-steps", ""], "nan_steps"),
    (["--shadow-every", "5"], "shadow_every"),  # bf16 has no FP8 recipe
    (["--embedding-grad-alpha", "2"], "embedding_grad_alpha"),
    (["--rollback-after", "-1"], "rollback_after"),
    (["--eval-batches", "0"], "eval_batches"),
    (["--max-bytes", "1"], "max_bytes"),
    (["--nan-steps", "99", "--steps", "5"], "nan_steps"),  # never reached: was accepted and did nothing
    (["--compile-mode", "reduce-overhead"], "compile_mode"),  # without --compile: was accepted and did nothing
    (["--compile-scope", "blocks"], "compile_scope"),
    (["--parallel", "fsdp"], "parallel"),  # one process: was accepted and did nothing
    (["--nproc", "2", "--parallel", "ddp", "--tp-size", "4"], "tp_size"),  # without fsdp+tp: ignored before
    # every block kept in high precision: trained an FP8 preset with no FP8 layer, after a warning
    (["--preset", "fp8-delayed", "--model", "tiny", "--keep-blocks", "5,5", "--max-bytes", "100000"], "keep_blocks"),
])
def test_train_rejects_bad_flags(argv, field, tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    # the field as its flag: "--eval-batches must be ..."
    assert err.startswith("minifloat: error:") and err.count("\n") == 1 and "--" + field.replace("_", "-") in err


def test_train_runs_as_a_command(tmp_path):
    out = tmp_path / "cmd"
    env = {**os.environ, "COLUMNS": str(WIDE), "MINIFLOAT_COMPILE": "0"}  # eager kernels: seconds, not compile time
    proc = subprocess.run([sys.executable, "-m", "minifloat.cli", *TRAIN, "--preset", "fp8-delayed", "--steps", "6",
                           "--eval-every", "6", "--nan-steps", "2", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "2 (nonfinite_loss)" in proc.stdout
    assert "step 2 skipped (nonfinite_loss)" in proc.stderr  # the guard's warning, through logging
    assert len(_rows(out)) == 6


def test_python_dash_m_minifloat_runs_the_cli():
    """`python -m minifloat` is the same command line as the `minifloat` script (DESIGN.md)."""
    done = subprocess.run([sys.executable, "-m", "minifloat", "formats"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "e4m3" in done.stdout.lower() and "448" in done.stdout
    e8m0 = next(line for line in done.stdout.splitlines() if "e8m0" in line).split("│")
    assert [cell.strip() for cell in e8m0][8] == "-"  # no subnormals (it printed 2^-127, docs/fp8.md says "—")
