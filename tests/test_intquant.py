"""Integer codes (minifloat.numerics.intquant): linear int8 / int4, nibble packing, the dynamic map."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minifloat.numerics.intquant import (
    dynamic_decode,
    dynamic_encode,
    dynamic_map,
    linear_decode,
    linear_encode,
    linear_qmax,
    pack_nibbles,
    unpack_nibbles,
)

# relative slack for the float32 divide / multiply around the integer rounding, in proportion to the values rounded:
# x / s may round onto the other side of a half-integer (an error of ulp(x) beyond half a step), and (c + 1) · s rounds
# once more (ulp(back)); a bound scaled only by the step misses that where x is many steps from 0 (x = 6324.08 with
# s = 37.5 came out 3e-4 past s / 2, once in a hypothesis run)
FP32_SLACK = 1e-6
# a block whose scale amax/qmax is subnormal in float32 holds it to within half a subnormal ulp (2^-150) absolutely,
# not relatively, so qmax codes can decode up to qmax·2^-150 above amax (amax 1.18e-38 at int8: 1.7e-43 above)
SUBNORMAL_SCALE_ERROR = 2.0**-150


def reference_dynamic_map(signed: bool, total_bits: int = 8, max_exponent_bits: int = 7) -> list[float]:
    """bitsandbytes' create_dynamic_map(signed, max_exponent_bits, total_bits), transcribed loop for loop (without
    its zero padding to 256 entries)."""
    data = []
    non_sign_bits = total_bits - 1
    e = max_exponent_bits
    for i in range(e):
        fraction_items = int(2 ** (i + non_sign_bits - e) + 1 if signed else 2 ** (i + non_sign_bits - e + 1) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float64)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(e - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(e - 1) + i)) * means).tolist()
    data += [0, 1.0]
    return sorted(data)


blocks = st.integers(1, 4).flatmap(lambda n: st.integers(1, 16).flatmap(lambda b: st.lists(
    st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=n * 2 * b, max_size=n * 2 * b).map(
    lambda v: torch.tensor(v).reshape(n, 2 * b))))


@settings(max_examples=60, deadline=None)
@given(xb=blocks, bits=st.sampled_from([8, 4]), signed=st.booleans())
@example(xb=torch.tensor([[0.0, 1.1754943508222875e-38]]), bits=8, signed=False)  # a subnormal scale (found in CI)
def test_linear_round_trip_within_half_a_step(xb, bits, signed):
    if not signed:
        xb = xb.abs()
    codes, scale = linear_encode(xb, bits, signed=signed)
    back = linear_decode(codes, scale, bits, signed=signed)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    step = amax / linear_qmax(bits, signed=signed)  # the code spacing: amax/127 (int8), amax/7 (int4)
    assert ((back - xb).abs() <= step / 2 + FP32_SLACK * (xb.abs() + back.abs()) + 1e-30).all()
    qmax = linear_qmax(bits, signed=signed)
    assert (back.abs().amax(dim=-1, keepdim=True) <= amax * (1 + FP32_SLACK) + qmax * SUBNORMAL_SCALE_ERROR).all()


@pytest.mark.parametrize("name, bits, signed, dtype, lo, hi", [
    ("int8 signed", 8, True, torch.int8, -127, 127),
    ("int8 unsigned", 8, False, torch.uint8, 0, 255),
    ("int4 signed (offset 8)", 4, True, torch.uint8, 1, 15),
    ("int4 unsigned", 4, False, torch.uint8, 0, 15),
])
def test_linear_code_ranges(name, bits, signed, dtype, lo, hi):
    x = torch.linspace(-1 if signed else 0, 1, 64).reshape(2, 32)
    codes, _ = linear_encode(x, bits, signed=signed)
    assert codes.dtype == dtype and codes.min().item() == lo and codes.max().item() == hi


def test_nibbles_round_trip():
    codes = torch.randint(0, 16, (3, 10), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_nibbles(codes)
    assert packed.shape == (3, 5) and torch.equal(unpack_nibbles(packed), codes)
    assert pack_nibbles(torch.tensor([[1, 2]], dtype=torch.uint8)).item() == 0x21  # low nibble first
    with pytest.raises(ValueError, match="even"):
        pack_nibbles(torch.zeros(1, 3, dtype=torch.uint8))
    empty = torch.zeros(0, 8, dtype=torch.uint8)  # no blocks: an empty shard of a parameter
    assert pack_nibbles(empty).shape == (0, 4) and unpack_nibbles(pack_nibbles(empty)).shape == (0, 8)


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_matches_reference(signed):
    code = dynamic_map(signed=signed)
    reference = torch.tensor(reference_dynamic_map(signed), dtype=torch.float32)
    assert code.shape == (256,) and torch.equal(code, reference)
    assert code[-1].item() == 1.0 and (code == 0).sum().item() == 1
    assert (code >= 0).all() if not signed else (code < 0).sum().item() == 127


@pytest.mark.parametrize("signed", [True, False])
def test_4bit_dynamic_map_matches_reference(signed):
    code = dynamic_map(signed=signed, bits=4)
    reference = torch.tensor(reference_dynamic_map(signed, total_bits=4, max_exponent_bits=3), dtype=torch.float32)
    assert code.shape == (16,) and torch.equal(code, reference)


def test_zero_free_dynamic_map_drops_only_zero():
    full, zero_free = dynamic_map(signed=False, bits=4), dynamic_map(signed=False, bits=4, zero=False)
    assert torch.equal(zero_free, full[1:]) and full[0].item() == 0 and (zero_free > 0).all()
    with pytest.raises(ValueError, match="unsigned"):
        dynamic_map(signed=True, zero=False)
    with pytest.raises(ValueError, match="bits"):
        dynamic_map(signed=True, bits=6)


@pytest.mark.parametrize("bits, signed", [(8, True), (4, True), (8, False), (4, False)])
def test_a_subnormal_block_keeps_its_values(bits, signed):
    # amax / qmax underflowed to a 0 scale: codes divided by it and every value decoded to 0
    xb = torch.tensor([[0.0, 2.0**-149, 3 * 2.0**-149]])
    codes, scale = linear_encode(xb, bits, signed=signed)
    assert torch.equal(linear_decode(codes, scale, bits, signed=signed), xb)  # exact: multiples of the smallest step


@settings(max_examples=60, deadline=None)
@given(xb=blocks, bits=st.sampled_from([8, 4]))
@example(xb=torch.tensor([[0.0, 2.0**-149]]), bits=8)  # a subnormal amax: amax / 256 underflowed to a 0 scale
@example(xb=torch.tensor([[6324.0845, 9608.1045]]), bits=8)  # x / s rounded across a half-integer (FP32_SLACK)
def test_zero_free_linear_codes_never_decode_to_zero(xb, bits):
    # codes stand for (c + 1)·s, s = amax / 2^bits: half a step for x >= s / 2, else rounded up to s; never 0
    xb = xb.abs()
    codes, scale = linear_encode(xb, bits, signed=False, zero_free=True)
    back = linear_decode(codes, scale, bits, signed=False, zero_free=True)
    s = scale[:, None]
    bound = torch.where(xb >= s / 2, s / 2, s - xb)
    assert ((back - xb).abs() <= bound + FP32_SLACK * (xb.abs() + back.abs()) + 1e-30).all()
    nonzero_block = xb.amax(dim=-1) > 0
    assert (back[nonzero_block] > 0).all() and (back[~nonzero_block] == 0).all()
    assert codes.max().item() < 2**bits
    with pytest.raises(ValueError, match="unsigned"):
        linear_encode(xb, bits, signed=True, zero_free=True)


@settings(max_examples=40, deadline=None)
@given(xb=blocks, signed=st.booleans())
def test_dynamic_encode_picks_the_nearest_code(xb, signed):
    if not signed:
        xb = xb.abs()
    code = dynamic_map(signed=signed)
    idx, scale = dynamic_encode(xb, code)
    back = dynamic_decode(idx, scale, code)
    xn = xb / scale[:, None]
    best = (xn[..., None] - code).abs().amin(dim=-1)  # distance to the nearest code value
    assert ((back / scale[:, None] - xn).abs() <= best + 1e-6).all()
