"""What torch._scaled_mm computes for MXFP8 and NVFP4 operands on a Blackwell GPU, written from cuBLASLt's
documentation of its 1-D block-scaling layout and torch's of float4_e2m1fn_x2, independently of minifloat's code: a
stand-in for the kernels on machines without one.

`unswizzle` reads a scale back at its documented byte offset; `scaled_mm_mx` and `scaled_mm_nvfp4` check the
arguments as torch does (ScaledBlas.cpp: FP8 data with float8_e8m0fnu scales of round_up(rows, 128)·round_up(K/32, 4)
elements, or packed E2M1 data with float8_e4m3fn scales of round_up(rows, 128)·round_up(K/16, 4) elements;
contiguous scales, a row-major, b column-major) and multiply the dequantized operands in float64, rounding once to
the output dtype. `scaled_mm_block_scaled` takes either, by the data's dtype.
"""

from __future__ import annotations

import torch


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def unswizzle(flat: torch.Tensor, rows: int, cols: int, layout: str = "documented") -> torch.Tensor:
    """The (rows, cols) E8M0 bytes (as int64) of a flat swizzled scale tensor: scale (r, c) lies in tile
    (r div 128, c div 4), tiles in row-tile-major order of 512 bytes, at 16·(r mod 32) + 4·((r mod 128) div 32) +
    c mod 4 within its tile. layout="row-major" reads them as a plain padded matrix instead (a kernel's mistake)."""
    r = torch.arange(rows)[:, None]
    c = torch.arange(cols)[None, :]
    col_tiles = _round_up(cols, 4) // 4
    if layout == "row-major":
        offset = r * (4 * col_tiles) + c
    else:
        offset = ((r // 128) * col_tiles + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    return flat.reshape(-1).view(torch.uint8).long()[offset]


def _dequantized(data: torch.Tensor, scale: torch.Tensor, layout: str, block: int = 32) -> torch.Tensor:
    rows, k = data.shape
    assert scale.dtype == torch.float8_e8m0fnu and scale.is_contiguous(), (scale.dtype, scale.stride())
    assert scale.numel() == _round_up(rows, 128) * _round_up(-(-k // block), 4), (scale.numel(), rows, k)
    exponents = unswizzle(scale, rows, -(-k // block), layout) - 127
    return data.double() * torch.pow(2.0, exponents.double()).repeat_interleave(block, dim=1)[:, :k]


def scaled_mm_mx(a, b, scale_a, scale_b, bias=None, out_dtype=None, scale_result=None, use_fast_accum=False,
                 layout: str = "documented"):
    """torch._scaled_mm(a, b, ...) for MXFP8 operands: a (M, K) row-major, b (K, N) column-major."""
    assert a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and b.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    assert a.is_contiguous() and b.t().is_contiguous(), "cuBLASLt takes a row-major and b column-major"
    assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0
    out = _dequantized(a, scale_a, layout) @ _dequantized(b.t(), scale_b, layout).t()
    if bias is not None:
        out = out + bias.double()
    return out.to(out_dtype)


E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # OCP MX v1.0 §5.3.3: codes 0-7, bit 3 the sign


def unpack_e2m1(packed: torch.Tensor, nibbles: str = "low-first") -> torch.Tensor:
    """float64 values of a (rows, K/2) float4_e2m1fn_x2 tensor: element 2i in each byte's low nibble, 2i+1 in its
    high one (nibbles="high-first": the other way round, a kernel's mistake)."""
    raw = packed.view(torch.uint8).long()
    low, high = raw & 0xF, raw >> 4
    first, second = (low, high) if nibbles == "low-first" else (high, low)
    codes = torch.stack((first, second), dim=-1).reshape(raw.shape[0], -1)
    magnitude = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)[codes & 7]
    return torch.where(codes >= 8, -magnitude, magnitude)


def _nvfp4_dequantized(packed: torch.Tensor, scale: torch.Tensor, layout: str, nibbles: str) -> torch.Tensor:
    rows, k = packed.shape[0], 2 * packed.shape[1]
    assert scale.dtype == torch.float8_e4m3fn and scale.is_contiguous(), (scale.dtype, scale.stride())
    assert scale.numel() == _round_up(rows, 128) * _round_up(k // 16, 4), (scale.numel(), rows, k)
    codes = unswizzle(scale, rows, k // 16, layout).to(torch.uint8)
    return unpack_e2m1(packed, nibbles) * codes.view(torch.float8_e4m3fn).double().repeat_interleave(16, dim=1)


def scaled_mm_nvfp4(a, b, scale_a, scale_b, bias=None, out_dtype=None, scale_result=None, use_fast_accum=False,
                    layout: str = "documented", nibbles: str = "low-first"):
    """torch._scaled_mm(a, b, ...) for NVFP4 operands: a (M, K/2) row-major, b (K/2, N) column-major, packed E2M1."""
    assert a.dtype == b.dtype == torch.float4_e2m1fn_x2 and not use_fast_accum
    assert a.is_contiguous() and b.t().is_contiguous(), "cuBLASLt takes a row-major and b column-major"
    assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0
    out = _nvfp4_dequantized(a, scale_a, layout, nibbles) @ _nvfp4_dequantized(b.t(), scale_b, layout, nibbles).t()
    if bias is not None:
        out = out + bias.double()
    return out.to(out_dtype)


def scaled_mm_block_scaled(a, b, *args, **kwargs):
    """scaled_mm_nvfp4 for packed E2M1 data, scaled_mm_mx for FP8."""
    return (scaled_mm_nvfp4 if a.dtype == torch.float4_e2m1fn_x2 else scaled_mm_mx)(a, b, *args, **kwargs)


def layer_step(model, x: torch.Tensor, dy: torch.Tensor):
    """One forward and backward of `model` under bfloat16 autocast: (y, dx, the parameters' gradients), the
    quantities the native-path layer tests compare with the emulated layer's."""
    xi = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(xi)
    y.float().backward(dy)
    return y.float(), xi.grad, [p.grad for p in model.parameters()]
