"""What torch._scaled_mm computes for MXFP8 operands on a Blackwell GPU, written from cuBLASLt's documentation of
its 1-D block-scaling layout, independently of minifloat's code: a stand-in for the kernel on machines without one.

`unswizzle` reads a scale back at its documented byte offset; `scaled_mm_mx` checks the arguments as torch does
(ScaledBlas.cpp: FP8 data, float8_e8m0fnu scales of round_up(rows, 128)·round_up(K/32, 4) elements, contiguous; a
row-major, b column-major) and multiplies the dequantized operands in float64, rounding once to the output dtype.
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
