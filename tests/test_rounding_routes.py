"""The two exact ways `minifloat.numerics.rounding.grid_spacing` finds a value's binade give the same bits.

On a CPU the spacing comes from float arithmetic alone (inductor's C++ code runs bit casts element by element, which
made a compiled cast about 4× slower); everywhere else from the float32 exponent field. Both are exact by construction
(the module docstring has the argument); these tests hold them to the same bits, eager and compiled, over every
bfloat16 value, dense float32 neighbourhoods of every power of two a format can round at, a strided sweep of all
float32 values up to the format's largest one (every value: the slow tier), ±0, ±inf and NaN.
"""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import pytest
import torch

import minifloat as mf
from minifloat.numerics import compiling, rounding
from minifloat.numerics import quantize as kernels
from minifloat.numerics.compiling import maybe_compile
from minifloat.numerics.formats import Special
from minifloat.numerics.quantize import FORMATS, cast
from minifloat.numerics.rounding import float_binade_power, round_stochastic, round_to_grid

# every format round_to_grid rounds with a grid spacing (not bf16/fp16, which torch converts, nor E8M0 scales)
GRID_FORMATS = [f for f in FORMATS.values() if f.mbits < 23 and f.torch_dtype not in (torch.bfloat16, torch.float16)
                and f.special != Special.SCALE]
NEIGHBOURHOOD = 1 << 12  # float32 values each side of a power of two, swept whole
SWEEP_STRIDE = 251  # a prime: the strided sweep lands on every mantissa pattern's residues
FULL_CHUNK = 1 << 24


def test_grid_formats_cover_the_fp8_and_fp4_element_formats():
    assert {f.name for f in GRID_FORMATS} >= {"e4m3", "e5m2", "e2m1"}


def integer_route():
    """A context in which grid_spacing reads the exponent field on the CPU too."""
    return mock.patch.object(rounding, "UNSAFE_MATH", True)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def assert_same_values(a: torch.Tensor, b: torch.Tensor, y: torch.Tensor) -> None:
    """Bitwise equal, -0 included; NaN where and only where the other has NaN (its sign is canonicalised later)."""
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    same = bits(a) == bits(b)
    bad = ~(same | nan)
    assert not bool(bad.any()), f"{int(bad.sum())} values differ, first inputs {y[bad][:8].tolist()}"


def all_bfloat16() -> torch.Tensor:
    return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()


def neighbourhoods(fmt) -> torch.Tensor:
    """Every float32 value within NEIGHBOURHOOD of ±2^e for every e from float32's subnormals to the format's top."""
    powers = torch.arange(-149, int(torch.tensor(fmt.max).log2().floor()) + 2, dtype=torch.float64).exp2().float()
    offsets = torch.arange(-NEIGHBOURHOOD, NEIGHBOURHOOD + 1, dtype=torch.int32)
    y = (bits(powers)[:, None] + offsets[None, :]).clamp(min=0).flatten().view(torch.float32)
    return torch.cat([y, -y])


def strided_sweep(fmt, stride: int) -> torch.Tensor:
    top = int(bits(torch.tensor(fmt.max, dtype=torch.float32)))
    y = torch.arange(0, top + 1, stride, dtype=torch.int32).view(torch.float32)
    return torch.cat([y, -y])


def specials() -> torch.Tensor:
    return torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 2.0**-149, 2.0**-126])


def inputs(fmt) -> torch.Tensor:
    """Values round_to_grid is specified for: |y| <= fmt.max, ±inf and NaN."""
    scaled = torch.cat([all_bfloat16() * s for s in (1.0, 2.0**-20, 3.0 / 7.0, 448.0 / 7.3)])
    y = torch.cat([scaled.clamp(-fmt.max, fmt.max), neighbourhoods(fmt), strided_sweep(fmt, SWEEP_STRIDE)])
    return torch.cat([y[(y.abs() <= fmt.max) | y.isnan()], specials()])


@pytest.mark.parametrize("fmt", GRID_FORMATS, ids=lambda f: f.name)
def test_round_to_grid_float_route_is_the_integer_route(fmt, monkeypatch):
    y = inputs(fmt)
    assert rounding._float_route(y, fmt)
    floated = round_to_grid(y, fmt)
    with integer_route():
        assert not rounding._float_route(y, fmt)
        want = round_to_grid(y, fmt)
    assert_same_values(floated, want, y)
    assert torch.equal(floated.isinf(), y.isinf())  # ±inf pass through (callers saturate them first)


@pytest.mark.parametrize("fmt", GRID_FORMATS, ids=lambda f: f.name)
def test_compiled_float_route_is_the_eager_integer_route(fmt, monkeypatch):
    """The route the CPU's compiled casts take, against the bit-pattern rule run eagerly."""
    y = inputs(fmt)
    with integer_route():
        want = round_to_grid(y, fmt)
    monkeypatch.setattr(compiling, "EAGER_BELOW", 0)
    assert_same_values(maybe_compile(lambda v: round_to_grid(v, fmt))(y), want, y)


@pytest.mark.parametrize("fmt", GRID_FORMATS, ids=lambda f: f.name)
def test_stochastic_rounding_routes_agree(fmt, monkeypatch):
    y = inputs(fmt)
    u = torch.rand(y.shape, generator=torch.Generator().manual_seed(5))
    floated = round_stochastic(y, fmt, u)
    with integer_route():
        want = round_stochastic(y, fmt, u)
    assert_same_values(floated, want, y)


def test_float_binade_power_is_the_exponent_field():
    """2^floor(log2 a) for every positive float32 in a strided sweep, subnormals and the domain's end included."""
    a = torch.cat([torch.arange(1, 0x74000001, 4093, dtype=torch.int32).view(torch.float32),
                   torch.tensor([2.0**-149, 2.0**104, 2.0**104 * (1 - 2.0**-24), 1.5, 1.75, 2.0 - 2.0**-23])])
    want = (bits(a) & 0x7F800000).view(torch.float32)  # the exponent field alone: 2^e for normal a
    subnormal = a < 2.0**-126
    want[subnormal] = torch.exp2(torch.floor(torch.log2(a[subnormal].double()))).float()
    assert torch.equal(float_binade_power(a), want)


def test_unsafe_math_sends_the_cpu_to_the_bit_pattern(monkeypatch):
    y = torch.ones(4)
    assert rounding._float_route(y, mf.E4M3)
    monkeypatch.setattr(rounding, "UNSAFE_MATH", True)
    assert not rounding._float_route(y, mf.E4M3)


def test_cast_saturates_and_rounds_alike_on_both_routes(monkeypatch):
    y = torch.tensor([1e30, -1e30, float("inf"), 464.0, 465.0, 0.0009765625 * 1.5, -3.3e-3])
    floated = cast(y, mf.E4M3)
    with integer_route():
        want = cast(y, mf.E4M3)
    assert torch.equal(bits(floated), bits(want))
    assert floated.tolist()[:4] == [448.0, -448.0, 448.0, 448.0]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [mf.E4M3, mf.E5M2, mf.E2M1], ids=lambda f: f.name)
def test_every_float32_up_to_the_format_top_rounds_alike(fmt, monkeypatch):
    """Every float32 value in [0, fmt.max] and its negative (about 2.3·10^9 for E5M2), compiled float route against
    the eager bit pattern, chunk by chunk."""
    monkeypatch.setattr(compiling, "EAGER_BELOW", 0)
    floated_fn = maybe_compile(lambda v: round_to_grid(v, fmt))
    top = int(bits(torch.tensor(fmt.max, dtype=torch.float32)))
    for start in range(0, top + 1, FULL_CHUNK):
        y = torch.arange(start, min(start + FULL_CHUNK, top + 1), dtype=torch.int32).view(torch.float32)
        y = torch.cat([y, -y])
        floated = floated_fn(y)
        with integer_route():
            want = round_to_grid(y, fmt)
        assert_same_values(floated, want, y)


# ---------------------------------------------------------------------------------------------------- conversion route

def saturated_inputs(fmt) -> torch.Tensor:
    """inputs(fmt) in round_saturated's domain: |y| <= fmt.max and NaN of either sign."""
    y = inputs(fmt)
    return y[~y.isinf()]


def test_the_conversion_route_is_e4m3_on_the_cpu_only(monkeypatch):
    y = torch.ones(4)
    assert rounding.converts_exactly(y, mf.E4M3)
    assert not any(rounding.converts_exactly(y, f) for f in GRID_FORMATS if f is not mf.E4M3)
    assert not rounding.converts_exactly(y.to("meta"), mf.E4M3)  # every other device keeps its own arithmetic
    monkeypatch.setattr(rounding, "UNSAFE_MATH", True)
    assert not rounding.converts_exactly(y, mf.E4M3)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_conversion_route_is_the_integer_route(compiled, monkeypatch):
    """torch's float8 conversion (vectorized by inductor's C++ code when compiled) against the bit-pattern rule:
    the same values, and its bytes hold exactly those values."""
    y = saturated_inputs(mf.E4M3)
    with integer_route():
        want = round_to_grid(y, mf.E4M3)
    monkeypatch.setattr(compiling, "EAGER_BELOW", 0)
    run = maybe_compile(lambda v: rounding.round_saturated(v, mf.E4M3)) if compiled else (
        lambda v: rounding.round_saturated(v, mf.E4M3))
    values, stored = run(y)
    assert stored is not None and stored.dtype == torch.float8_e4m3fn
    assert_same_values(values, want, y)
    assert_same_values(stored.float(), want, y)


def _cast_outputs(x: torch.Tensor, scale: torch.Tensor, fold: torch.Tensor) -> list[torch.Tensor]:
    data, operand, amax = kernels._cast_kernel_compiled(x, scale, "e4m3", torch.float8_e4m3fn, torch.bfloat16,
                                                        fold, True)
    return [data.view(torch.uint8), operand.view(torch.int16), amax.view(torch.int32)]


def test_cast_kernel_gives_the_arithmetic_routes_bytes(monkeypatch):
    """The compiled cast with the conversion route writes the bytes, operand and amax it wrote before (arithmetic
    rounding), NaN of either sign and values that saturate included: one canonical NaN byte (0x7F)."""
    monkeypatch.setattr(compiling, "EAGER_BELOW", 0)
    x = torch.cat([all_bfloat16(), torch.tensor([float("nan"), -float("nan"), 1e30, -1e30])]).to(torch.bfloat16)
    assert rounding.converts_exactly(x.float(), mf.E4M3)
    scale, fold = torch.tensor(2.0**-3 * 3), torch.tensor(1 / (2.0**-3 * 3))
    converted = _cast_outputs(x, scale, fold)
    with integer_route():
        torch._dynamo.reset()  # the route is a trace-time choice: retrace with the arithmetic one
        want = _cast_outputs(x, scale, fold)
    torch._dynamo.reset()
    for got, ref in zip(converted, want):
        assert torch.equal(got, ref)
    assert set(converted[0][x.isnan()].tolist()) == {0x7F}


@pytest.mark.slow
def test_every_float32_up_to_e4m3s_top_converts_alike(monkeypatch):
    """Every float32 value in [-448, 448] (about 2.2·10^9), compiled conversion route against the eager bit pattern,
    chunk by chunk (~3 minutes on 2 cores)."""
    monkeypatch.setattr(compiling, "EAGER_BELOW", 0)
    converted = maybe_compile(lambda v: rounding.round_saturated(v, mf.E4M3)[0])
    top = int(bits(torch.tensor(mf.E4M3.max, dtype=torch.float32)))
    for start in range(0, top + 1, FULL_CHUNK):
        y = torch.arange(start, min(start + FULL_CHUNK, top + 1), dtype=torch.int32).view(torch.float32)
        y = torch.cat([y, -y])
        with integer_route():
            want = round_to_grid(y, mf.E4M3)
        assert_same_values(converted(y), want, y)


ISA_PROBE = """
import sys, torch
from minifloat.numerics import compiling, rounding
from minifloat.numerics import quantize as kernels
import minifloat as mf
compiling.EAGER_BELOW = 0
y = torch.load(sys.argv[1])
values, stored = compiling.maybe_compile(lambda v: rounding.round_saturated(v, mf.E4M3))(y)
from torch._inductor.cpu_vec_isa import pick_vec_isa
torch.save({"values": values, "bytes": stored.view(torch.uint8), "isa": str(pick_vec_isa())}, sys.argv[2])
"""
# ATEN_CPU_CAPABILITY -> the vector ISA inductor then writes code for ("default": none)
VECTOR_UNITS = {"avx2": "avx2", "default": "INVALID_VEC_ISA"}


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "default"])
def test_conversion_route_is_exact_on_other_vector_units(isa, tmp_path):
    """inductor writes the conversion for the machine's vector unit (AVX-512 here, AVX2 or none elsewhere): each,
    forced with ATEN_CPU_CAPABILITY in a fresh process and inductor cache, gives the bit-pattern rule's values."""
    y = saturated_inputs(mf.E4M3)
    torch.save(y, tmp_path / "y.pt")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=isa, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"),
               MINIFLOAT_COMPILE="1")
    done = subprocess.run([sys.executable, "-c", ISA_PROBE, str(tmp_path / "y.pt"), str(tmp_path / "out.pt")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    assert out["isa"] == VECTOR_UNITS[isa]
    with integer_route():
        want = round_to_grid(y, mf.E4M3)
    assert_same_values(out["values"], want, y)
    assert_same_values(out["bytes"].view(torch.float8_e4m3fn).float(), want, y)
