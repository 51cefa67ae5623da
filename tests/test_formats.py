"""Tests for minifloat.numerics.formats: every limit derived from the format table against golden values.

The golden numbers come from the specifications, not from the table under test:
  * E4M3 / E5M2: OCP 8-bit Floating Point Specification (OFP8) rev 1.0, Table 1;
  * E2M1 / E8M0: OCP Microscaling Formats (MX) v1.0, §5.3.3 and §5.4.1;
  * BF16 / FP16 / FP32: IEEE 754 binary16 / binary32 (and bfloat16), read from torch.finfo.
ml_dtypes (an independent implementation of the same formats) cross-checks them once more.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import torch

from minifloat.numerics.formats import BF16, E2M1, E4M3, E5M2, E8M0, FORMATS, FP16, FP32, NumberFormat, Special, get_format

# ---------------------------------------------------------------------------------------------------- golden limits

# (name, format, max, min_normal, min_subnormal, has_inf, has_nan, bits)
GOLDEN_LIMITS = [
    ("e4m3", E4M3, 448.0, 2.0**-6, 2.0**-9, False, True, 8),
    ("e5m2", E5M2, 57344.0, 2.0**-14, 2.0**-16, True, True, 8),
    ("e2m1", E2M1, 6.0, 1.0, 0.5, False, False, 4),
    # E8M0 has no subnormals and no zero: its smallest value 2^-127 is both its min normal and min "subnormal"
    ("e8m0", E8M0, 2.0**127, 2.0**-127, 2.0**-127, False, True, 8),
    ("bf16", BF16, 2.0**127 * (2 - 2.0**-7), 2.0**-126, 2.0**-133, True, True, 16),
    ("fp16", FP16, 65504.0, 2.0**-14, 2.0**-24, True, True, 16),
    ("fp32", FP32, 2.0**127 * (2 - 2.0**-23), 2.0**-126, 2.0**-149, True, True, 32),
]


@pytest.mark.parametrize(
    "fmt, max_, min_normal, min_subnormal, has_inf, has_nan, bits",
    [case[1:] for case in GOLDEN_LIMITS],
    ids=[case[0] for case in GOLDEN_LIMITS],
)
def test_limits_match_golden_values(fmt, max_, min_normal, min_subnormal, has_inf, has_nan, bits):
    assert fmt.max == max_
    assert fmt.min_normal == min_normal
    assert fmt.min_subnormal == min_subnormal
    assert fmt.has_inf is has_inf
    assert fmt.has_nan is has_nan
    assert fmt.bits == bits


# (name, format, emax, emin)
GOLDEN_EXPONENTS = [
    ("e4m3", E4M3, 8, -6),
    ("e5m2", E5M2, 15, -14),
    ("e2m1", E2M1, 2, 0),
    ("e8m0", E8M0, 127, -127),
    ("bf16", BF16, 127, -126),
    ("fp16", FP16, 15, -14),
    ("fp32", FP32, 127, -126),
]


@pytest.mark.parametrize("fmt, emax, emin", [c[1:] for c in GOLDEN_EXPONENTS], ids=[c[0] for c in GOLDEN_EXPONENTS])
def test_exponent_range_matches_golden_values(fmt, emax, emin):
    assert fmt.emax == emax
    assert fmt.emin == emin


# (name, format, ml_dtypes type): the OCP formats as ml_dtypes implements them
ML_DTYPES = [
    ("e4m3", E4M3, ml_dtypes.float8_e4m3fn),
    ("e5m2", E5M2, ml_dtypes.float8_e5m2),
    ("e2m1", E2M1, ml_dtypes.float4_e2m1fn),
    ("e8m0", E8M0, ml_dtypes.float8_e8m0fnu),
    ("bf16", BF16, ml_dtypes.bfloat16),
]


@pytest.mark.parametrize("fmt, mltype", [c[1:] for c in ML_DTYPES], ids=[c[0] for c in ML_DTYPES])
def test_limits_match_ml_dtypes_finfo(fmt, mltype):
    info = ml_dtypes.finfo(mltype)
    assert fmt.max == float(info.max)
    assert fmt.min_normal == float(info.smallest_normal)
    assert fmt.min_subnormal == float(info.smallest_subnormal)


@pytest.mark.parametrize("fmt, mltype", [c[1:] for c in ML_DTYPES if c[0] != "e8m0"],
                         ids=[c[0] for c in ML_DTYPES if c[0] != "e8m0"])
def test_inf_and_nan_flags_match_ml_dtypes(fmt, mltype):
    # ml_dtypes saturates nothing on its own: casting inf shows whether the format has an inf code, NaN whether a NaN
    with np.errstate(invalid="ignore", over="ignore"):
        inf = np.array([np.inf], dtype=np.float32).astype(mltype).astype(np.float32)[0]
        nan = np.array([np.nan], dtype=np.float32).astype(mltype).astype(np.float32)[0]
    assert bool(np.isinf(inf)) is fmt.has_inf
    if fmt.has_nan:
        assert np.isnan(nan)


# (name, format): the formats torch has a dtype for
TORCH_DTYPES = [
    ("e4m3", E4M3),
    ("e5m2", E5M2),
    ("e8m0", E8M0),
    ("bf16", BF16),
    ("fp16", FP16),
    ("fp32", FP32),
]


@pytest.mark.parametrize("fmt", [c[1] for c in TORCH_DTYPES], ids=[c[0] for c in TORCH_DTYPES])
def test_limits_match_torch_finfo(fmt):
    if fmt.torch_dtype is None:
        pytest.skip(f"this torch has no dtype for {fmt.name}")
    info = torch.finfo(fmt.torch_dtype)
    assert fmt.max == info.max
    assert fmt.min_normal == info.tiny == info.smallest_normal
    if fmt.special != Special.SCALE:
        # smallest subnormal = 2^emin · 2^-mbits = smallest_normal · eps
        assert fmt.min_subnormal == info.smallest_normal * info.eps


@pytest.mark.parametrize("fmt, nptype", [(FP16, np.float16), (FP32, np.float32)], ids=["fp16", "fp32"])
def test_min_subnormal_is_the_next_value_above_zero(fmt, nptype):
    assert fmt.min_subnormal == float(np.nextafter(nptype(0), nptype(1)))


@pytest.mark.parametrize("fmt, mltype", [c[1:] for c in ML_DTYPES if c[0] in ("e4m3", "e5m2")],
                         ids=[c[0] for c in ML_DTYPES if c[0] in ("e4m3", "e5m2")])
def test_fp8_max_and_min_are_the_extreme_codes(fmt, mltype):
    """Decode all 256 codes with ml_dtypes: max and min subnormal are the largest and smallest positive values."""
    values = np.arange(256, dtype=np.uint8).view(mltype).astype(np.float64)
    finite = values[np.isfinite(values)]
    assert finite.max() == fmt.max
    assert finite[finite > 0].min() == fmt.min_subnormal


def test_torch_dtypes():
    assert E4M3.torch_dtype == torch.float8_e4m3fn
    assert E5M2.torch_dtype == torch.float8_e5m2
    assert E2M1.torch_dtype is None  # no unpacked 4-bit dtype in torch
    assert BF16.torch_dtype == torch.bfloat16
    assert FP16.torch_dtype == torch.float16
    assert FP32.torch_dtype == torch.float32


def test_fp8_flags():
    assert E4M3.is_fp8 and E5M2.is_fp8
    assert not E8M0.is_fp8  # unsigned scale format
    assert not any(f.is_fp8 for f in (E2M1, BF16, FP16, FP32))
    assert not E8M0.signed


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_describe_reports_the_derived_limits(fmt):
    d = fmt.describe()
    assert d["name"] == fmt.name
    assert d["bits"] == fmt.bits
    assert d["exponent_bits"] == fmt.ebits
    assert d["mantissa_bits"] == fmt.mbits
    # E8M0 has no subnormals: its JSON says none, as `minifloat formats`' table shows "-" (it said 2^-127)
    subnormal = None if fmt is E8M0 else fmt.min_subnormal
    assert (d["max"], d["min_normal"], d["min_subnormal"]) == (fmt.max, fmt.min_normal, subnormal)
    assert (d["has_inf"], d["has_nan"]) == (fmt.has_inf, fmt.has_nan)
    expected_dtype = None if fmt.torch_dtype is None else str(fmt.torch_dtype).removeprefix("torch.")
    assert d["torch_dtype"] == expected_dtype


def test_formats_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        E4M3.mbits = 4  # type: ignore[misc]


def test_variants_derive_with_replace():
    # a hypothetical E4M3 with IEEE specials loses the top binade: max 240 (OFP8 §3 discusses this variant)
    ieee = dataclasses.replace(E4M3, name="e4m3-ieee", special=Special.IEEE)
    assert ieee.max == 240.0
    assert ieee.has_inf


# ---------------------------------------------------------------------------------------------------- lookup

def test_registry_is_keyed_by_name():
    assert set(FORMATS) == {"e4m3", "e5m2", "e8m0", "e2m1", "bf16", "fp16", "fp32"}
    assert all(FORMATS[name].name == name for name in FORMATS)


# (name, lookup key, expected format)
LOOKUPS = [
    ("lowercase", "e4m3", E4M3),
    ("uppercase", "E5M2", E5M2),
    ("mixed-case", "Bf16", BF16),
    ("e2m1", "e2m1", E2M1),
    ("e8m0", "e8m0", E8M0),
    ("fp32", "fp32", FP32),
    ("passthrough", FP16, FP16),
]


@pytest.mark.parametrize("key, expected", [c[1:] for c in LOOKUPS], ids=[c[0] for c in LOOKUPS])
def test_get_format(key, expected):
    assert get_format(key) is expected


def test_get_format_passes_custom_formats_through():
    custom = NumberFormat("e3m4", ebits=3, mbits=4, bias=3, special=Special.FN)
    assert get_format(custom) is custom


@pytest.mark.parametrize("key", ["e9m9", "float8", ""], ids=["unknown", "torch-like", "empty"])
def test_get_format_unknown_name_raises_naming_it(key):
    with pytest.raises(ValueError, match=f"unknown number format {key!r}"):
        get_format(key)
