"""The device of the GPU test tier (tests/test_gpu_*.py) and the helpers its files share.

    python -m pytest -m gpu                      # the tier, on CUDA; skipped with the reason on a machine without
    MINIFLOAT_GPU_TESTS_DEVICE=cpu python -m pytest -m gpu tests/test_gpu_*.py

Every test of the tier is marked `gpu` and takes the module fixture `device`: "cuda" where torch sees a GPU, else the
test is skipped ("needs a CUDA GPU (torch.cuda.is_available() is False)"). The development switch
MINIFLOAT_GPU_TESTS_DEVICE=cpu makes `device` "cpu" instead, so the tier's logic runs, and can be debugged, on a
machine without a GPU; there the native FP8 GEMM is unavailable (`native_fp8_available()` is False), so what only
the native path does is asserted only where it is available. The CPU side of every cross-device comparison runs
minifloat's kernels eagerly (`eager_kernels`; tests/test_quantize.py holds compiled and eager to the same bits on
the CPU), the device side as the product runs them: compiled (Triton on a GPU) above `EAGER_BELOW` elements.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import pytest
import torch

import minifloat as mf

DEVICE_ENV = "MINIFLOAT_GPU_TESTS_DEVICE"
DEVICES = ("cpu", "cuda")

# the recipes the tier runs: one per kind of cast (per-tensor delayed and current, per-row, DeepSeek-V3 blocks with
# and without power-of-two scales, MXFP8, MXFP4, NVFP4)
RECIPES = [
    ("delayed", mf.DelayedScaling()),
    ("current", mf.CurrentScaling()),
    ("current-row", mf.CurrentScaling(granularity="row")),
    ("block", mf.BlockScaling()),
    ("block-no-pow2", mf.BlockScaling(power_of_two=False)),
    ("mx", mf.MXScaling()),
    ("mxfp4", mf.MXScaling(format="e2m1")),
    ("nvfp4", mf.NVFP4Scaling()),
]
RECIPE_BY_NAME = dict(RECIPES)
RECIPE_NAMES = [name for name, _ in RECIPES]


def resolve_device() -> str:
    """"cuda", the switch's device, or a skip with the reason."""
    override = os.environ.get(DEVICE_ENV)
    if override:
        if override not in DEVICES:
            raise ValueError(f"{DEVICE_ENV} must be one of {DEVICES}, got {override!r}")
        return override
    if not torch.cuda.is_available():
        pytest.skip(f"needs a CUDA GPU (torch.cuda.is_available() is False); {DEVICE_ENV}=cpu runs this tier's "
                    f"logic on the CPU")
    return "cuda"


@pytest.fixture(scope="module")
def device() -> str:
    """The device the tier tests: "cuda", or "cpu" under MINIFLOAT_GPU_TESTS_DEVICE=cpu; skips otherwise."""
    return resolve_device()


def autocast(device: str) -> torch.autocast:
    """bfloat16 autocast on `device`'s type (the product's mixed precision around FP8 layers)."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------------------- bits


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bit patterns on the CPU as int64, every NaN as -1 (devices write different NaN payloads)."""
    t = t.detach().cpu().contiguous()
    if not t.is_floating_point():
        return t.to(torch.int64)
    pattern = t.view(_INTS[t.element_size()]).to(torch.int64)
    return torch.where(torch.isnan(t.float()), torch.full_like(pattern, -1), pattern)


def assert_same_bits(actual: torch.Tensor | None, expected: torch.Tensor | None, what: str) -> None:
    """actual and expected hold the same dtype, shape and bits (NaN payloads aside), on whatever devices."""
    if expected is None or actual is None:
        assert actual is None and expected is None, f"{what}: one side is None"
        return
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    differ = int((bits(actual) != bits(expected)).sum())
    assert differ == 0, f"{what}: {differ} of {actual.numel()} elements differ in their bits"


def assert_same_state(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str = "") -> None:
    assert actual.keys() == expected.keys(), what
    for key in expected:
        assert_same_bits(actual[key], expected[key], f"{what}{key}")


def fp8_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The FP8 scaling state (amax histories, scales, seeds and counters) of `model`'s state dict, on the CPU."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if "fp8_state" in k}


# ---------------------------------------------------------------------------------------------------- GEMM path


@contextlib.contextmanager
def native_gemm_calls() -> Iterator[list[tuple[torch.dtype, torch.dtype]]]:
    """The products torch._scaled_mm (the native FP8 GEMM) computed inside the block: one (a dtype, b dtype) entry
    per call that returned. minifloat.fp8.gemm calls it by attribute, so a counting stand-in sees every call."""
    calls: list[tuple[torch.dtype, torch.dtype]] = []
    real = torch._scaled_mm

    def counting(a, b, *args, **kwargs):
        out = real(a, b, *args, **kwargs)
        calls.append((a.dtype, b.dtype))
        return out

    torch._scaled_mm = counting
    try:
        yield calls
    finally:
        torch._scaled_mm = real
