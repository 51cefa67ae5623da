"""`minifloat formats --gemms` / minifloat.fp8.paths: the path each recipe's GEMMs take on a device, read from the
one decision (the native rules, the device's capability, the per-device check of rules not yet run on their GPU)."""

from __future__ import annotations

import json

import pytest

from minifloat.cli import main
from minifloat.fp8 import native, native_check
from minifloat.fp8.paths import RECIPE_GEMMS, gemm_paths


def paths_on(monkeypatch, capability, checks=None, backend=None):
    monkeypatch.setattr(native, "device_capability", lambda index=0: capability)
    monkeypatch.setattr(native_check, "_RESULTS", dict(checks or {}))
    monkeypatch.setattr(native_check, "check", lambda pair, device: pytest.fail(f"ran the check of {pair}"))
    return {(r.recipe, r.gemms): r for r in gemm_paths("cuda:0", backend)}


def test_on_a_cpu_every_gemm_is_emulated():
    rows = gemm_paths("cpu")
    assert len(rows) == len(RECIPE_GEMMS) and {r.path for r in rows} == {"emulated"}
    assert all("not a CUDA device" in r.why for r in rows if r.recipe != "MXScaling(format='e2m1')")


def test_on_hopper_tensor_row_and_block_scaling_run_natively(monkeypatch):
    rows = paths_on(monkeypatch, (9, 0))
    native_rows = {key for key, r in rows.items() if r.path == "native"}
    assert native_rows == {("DelayedScaling, CurrentScaling", "fprop, dgrad, wgrad"),
                           ("CurrentScaling(granularity='row')", "fprop, dgrad, wgrad"),
                           ("BlockScaling", "fprop, dgrad"), ("BlockScaling", "wgrad")}
    assert "K a multiple of 512" in rows[("BlockScaling", "fprop, dgrad")].why
    assert "needs SM 10.0+" in rows[("MXScaling", "fprop, dgrad, wgrad")].why
    assert "needs SM 10.0+" in rows[("NVFP4Scaling", "fprop, dgrad, wgrad")].why


def test_on_blackwell_mx_and_nvfp4_follow_their_device_check(monkeypatch):
    rows = paths_on(monkeypatch, (10, 0), {("mx × mx", 0): True, ("nvfp4 × nvfp4", 0): False})
    mx, nvfp4 = rows[("MXScaling", "fprop, dgrad, wgrad")], rows[("NVFP4Scaling", "fprop, dgrad, wgrad")]
    assert mx.path == "native" and "checked against the emulation" in mx.why
    assert nvfp4.path == "emulated" and "did not pass its check" in nvfp4.why
    assert rows[("BlockScaling", "wgrad")].path == "emulated"  # the DeepSeek rules are Hopper's
    assert rows[("DelayedScaling, CurrentScaling", "fprop, dgrad, wgrad")].path == "native"


def test_the_emulated_backend_runs_everything_emulated(monkeypatch):
    rows = paths_on(monkeypatch, (9, 0), backend="emulated")
    assert {r.path for r in rows.values()} == {"emulated"}


def test_the_cli_prints_the_table_as_json_and_refuses_a_bad_device_in_one_line(capsys):
    assert main(["formats", "--gemms", "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "cpu" and len(out["gemms"]) == len(RECIPE_GEMMS)
    assert main(["formats", "--gemms", "--device", "tpu9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device tpu9" in err[0], err
    assert main(["formats", "--device", "cpu"]) == 2  # --device alone would be ignored: said instead
    assert "add --gemms" in capsys.readouterr().err


def test_a_rocm_build_runs_every_product_emulated_and_says_why(monkeypatch):
    """torch's ROCm build reports AMD GPUs through torch.cuda with gfx numbers for capabilities (MI300X: 9.4), which
    the rules would read as Hopper; its FP8 GEMMs take other formats, so nothing may go native there."""
    class MI300X:
        major, minor = 9, 4
    monkeypatch.setattr(native.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(native.torch.cuda, "get_device_properties", lambda index: MI300X)
    assert native._read_capability(0) == (9, 4)  # what the rules would have read
    monkeypatch.setattr(native, "ROCM_BUILD", True)
    monkeypatch.setattr(native, "_CAPABILITY", {})
    assert native._read_capability(0) is None and native.device_capability(0) is None
    rows = gemm_paths("cuda:0")
    assert {r.path for r in rows} == {"emulated"}
    assert all("ROCm build" in r.why for r in rows if r.recipe != "MXScaling(format='e2m1')")
