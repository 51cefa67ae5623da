"""GPU tier: the `minifloat` command on the device, as a user runs it (a subprocess). `minifloat train --device DEV`
trains every precision preset for a few steps (the runs go concurrently, one process each), `minifloat compare
--device DEV` compares presets, and `minifloat export` and `minifloat generate` work from a run trained on the
device.

The device and the switch: tests/gpu_device.py (MINIFLOAT_GPU_TESTS_DEVICE=cpu runs the tier without a GPU).
"""

from __future__ import annotations

import csv
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import minifloat as mf
from gpu_device import device  # noqa: F401  (the module's device fixture)
from gpu_device import assert_same_bits
from minifloat.amp.policy import PRESETS
from minifloat.inference.generate import load_run_model
from minifloat.inference.hf import load_hf_export
from minifloat.inference.layers import inference_layers
from minifloat.numerics.quantize import quantize

pytestmark = pytest.mark.gpu

STEPS = 3
# a tiny run: the tiny Llama, short sequences, a 100 kB corpus, one validation batch, a checkpoint at the end
TRAIN = ["--model", "tiny", "--steps", str(STEPS), "--batch-size", "4", "--seq-len", "32", "--max-bytes", "100000",
         "--eval-every", str(STEPS), "--eval-batches", "1", "--checkpoint-every", str(STEPS), "--warmup", "1"]
TIMEOUT_S = 600
FP8_PRESETS = [name for name, policy in PRESETS.items() if policy.recipe is not None]
EXPORT_RUN = "fp8-delayed"  # the run export and generate start from


def minifloat(*args: str, threads: int | None = None) -> subprocess.Popen:
    """`minifloat ARGS` as a user runs it (the console script's module, in this interpreter)."""
    env = {**os.environ, "COLUMNS": "200"}
    if threads is not None:  # concurrent CPU runs share the cores
        env["OMP_NUM_THREADS"] = str(threads)
    return subprocess.Popen([sys.executable, "-m", "minifloat.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=TIMEOUT_S)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run(*args: str) -> subprocess.CompletedProcess:
    result = finish(minifloat(*args))
    assert result.returncode == 0, f"minifloat {' '.join(args)} exited {result.returncode}:\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def runs(device, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, pathlib.Path]]:
    """`minifloat train --device DEV` for every preset, all at once (one process each): preset -> (result, out)."""
    root = tmp_path_factory.mktemp("train")
    threads = 1 if device == "cpu" else None
    procs = {preset: minifloat("train", *TRAIN, "--preset", preset, "--device", device, "--out", str(root / preset),
                               threads=threads) for preset in PRESETS}
    return {preset: (finish(proc), root / preset) for preset, proc in procs.items()}


def log_rows(out: pathlib.Path) -> list[dict]:
    with open(out / "log.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("preset", list(PRESETS))
def test_train_runs_every_preset_on_the_device(runs, device, preset):
    result, out = runs[preset]
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads((out / "run.json").read_text())
    assert info["device"] == device and info["config"]["preset"] == preset
    rows = log_rows(out)
    assert [int(r["step"]) for r in rows] == list(range(STEPS))
    assert all(math.isfinite(float(r["loss"])) and r["skipped"] == "0" for r in rows), rows
    assert {r["mode"] for r in rows} == ({"fp8"} if preset in FP8_PRESETS else {rows[0]["mode"]})
    assert (out / "ckpt" / "manifest.json").is_file() and (out / "val.csv").is_file()
    assert f"· {device}" in result.stdout  # the summary table's title names the device


def test_compare_on_the_device(device, tmp_path):
    out = tmp_path / "compare"
    run("compare", "--presets", "fp8-delayed,mxfp8,nvfp4", "--model", "tiny", "--steps", str(STEPS),
        "--batch-size", "4", "--seq-len", "32", "--max-bytes", "100000", "--device", device, "--out", str(out))
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["presets"]) == ["bf16", "fp8-delayed", "mxfp8", "nvfp4"]
    for preset, metrics in summary["presets"].items():
        assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), (preset, metrics)
        assert json.loads((out / preset / "run.json").read_text())["device"] == device
    for figure in ("loss_curves.png", "numerics_heatmap.png"):
        assert (out / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# the block export took 74 s on an H100 machine (10 s per-tensor): slow
@pytest.mark.parametrize("fmt, granularity", [("hf-fp8", "tensor"),
                                              pytest.param("hf-fp8-block", "block", marks=pytest.mark.slow)])
def test_export_of_a_device_run(runs, device, tmp_path, fmt, granularity):
    """The exported FP8 weights are the device's E4M3 cast of the run's weights, bit for bit (one rounding path)."""
    _, run_dir = runs[EXPORT_RUN]
    out = tmp_path / fmt
    run("export", "--run", str(run_dir), "--format", fmt, "--out", str(out))
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert config["quantization_config"]["weight_block_size"] == ([128, 128] if granularity == "block" else None)
    assert any(t.dtype == torch.float8_e4m3fn for t in load_file(str(out / "model.safetensors")).values())
    trained = load_run_model(run_dir, device=device)  # the run's fp32 weights, on its device
    layers = inference_layers(load_hf_export(out))
    assert layers
    for name, layer in layers:
        weight = trained.get_submodule(name).weight.detach()
        assert weight.device.type == torch.device(device).type
        assert_same_bits(layer.weight, quantize(weight, mf.E4M3, granularity=granularity).data, name)


@pytest.mark.parametrize("flags", [("--fp8", "row", "--kv-cache", "fp8"), ("--fp8", "mx", "--kv-cache", "bf16")],
                         ids=["row-fp8-cache", "mx"])
def test_generate_from_a_device_run(runs, device, flags):
    """Without --device the run's own device (run.json); the continuation on stdout, one stats line on stderr."""
    _, run_dir = runs[EXPORT_RUN]
    result = run("generate", "--run", str(run_dir), "--prompt", "def ", "--max-new-tokens", "8", *flags)
    assert len(result.stdout.rstrip("\n")) >= 1
    stats = result.stderr.strip().splitlines()
    assert len(stats) == 1 and "tok/s" in stats[0] and f"KV cache {flags[-1]}" in stats[0], result.stderr
    source = "cuda.max_memory_allocated" if device == "cuda" else "weights + KV cache"
    assert source in stats[0]
