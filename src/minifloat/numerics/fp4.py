"""NVFP4: E2M1 elements with two levels of scale, an E4M3 scale per 16-element block and an fp32 scale per tensor.

A block of 16 consecutive elements along the last dim (or, for weights, a 16×16 tile of the last two dims) shares
one E4M3 scale; the whole tensor shares one fp32 scale, chosen so that the largest block scale lands on E4M3's max
(NVIDIA, "Pretraining Large Language Models with NVFP4", arXiv 2509.25149, §2 and Appendix B; Transformer Engine's
NVFP4 recipe). With A the tensor's amax and a_b a block's, in float32 arithmetic (each operation rounded to nearest):

    s_enc = (E4M3.max · E2M1.max) / A = 2688 / A        global encode scale (1 when A is 0, inf or NaN)
    g     = 1 / s_enc                                   global decode scale, stored (≈ A / 2688)
    s_b   = e4m3((a_b / E2M1.max) · s_enc)              block decode scale, stored in E4M3 (saturating RNE)
    r_b   = 1 / (s_b · g)                               the block's encode multiplier (0 for s_b = 0)
    q     = e2m1(x · r_b)                               elements (saturating; RNE or stochastic)
    x̂     = (q · s_b) · g                               decoded: q · s_b is exact in float32 (2 + 4 significant
                                                        bits), so x̂ is the exact product rounded once

Divisions are correctly rounded on every device and compiler (`minifloat.numerics.rounding.div_rn`).
(a_b / 6) · s_enc is the paper's order; Transformer Engine's kernel computes a_b · (s_enc / 6), which can differ by
one float32 ulp before the E4M3 rounding.

Non-finite input follows `quantize` (docs/fp8.md, "Non-finite values"): a NaN or ±inf anywhere makes the global
scale fall back to 1 (as a per-tensor cast's scale does), its block's scale falls back to 1, NaN stays NaN in the
elements and in `dequantize()` (so guards see it) and ±inf saturates to ±6.

Rounding goes through `minifloat.numerics.quantize.cast`, the one rounding path.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from minifloat.core.validate import check_bool, check_choice, check_int
from minifloat.numerics.formats import E2M1, E4M3, FP32, NumberFormat
from minifloat.numerics.compiling import maybe_compile
from minifloat.numerics.granularity import Granularity, pad_to_multiple
from minifloat.numerics.hadamard import rht
from minifloat.numerics.intquant import pack_nibbles, unpack_nibbles
from minifloat.numerics.quantize import Quantized, abs_max, cast
from minifloat.numerics.rounding import ROUNDINGS, counter_uniform, counter_uniform_at, div_rn

NVFP4_BLOCK = 16  # arXiv 2509.25149 §2: 16 elements (1×16, or a 16×16 weight tile) share one E4M3 scale
GLOBAL_RANGE = E4M3.max * E2M1.max  # 448 · 6 = 2688: the largest block scale times the largest element


# ---------------------------------------------------------------------------------------------------- E2M1 codes


@functools.lru_cache(maxsize=None)
def _magnitudes(fmt: NumberFormat) -> tuple[float, ...]:
    """The 2^(ebits+mbits) non-negative values of a format without specials, in code order (ascending)."""
    values = []
    for code in range(2 ** (fmt.ebits + fmt.mbits)):
        e, m = code >> fmt.mbits, code & (2**fmt.mbits - 1)
        if e == 0:  # subnormal: m · 2^(emin - mbits)
            values.append(m * fmt.min_subnormal)
        else:
            values.append((1 + m / 2**fmt.mbits) * 2.0 ** (e - fmt.bias))
    return tuple(values)


def e2m1_values(device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 E2M1 values in code order (sign bit 3, exponent bits 2-1, mantissa bit 0), float32: 0, 0.5, ... 6,
    -0, -0.5, ... -6 (OCP MX v1.0 §5.3.3)."""
    half = torch.tensor(_magnitudes(E2M1), dtype=torch.float32, device=device)
    return torch.cat([half, -half])


def encode_e2m1(values: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (0..15) of float values that lie on the E2M1 grid; -0.0 gets the code 8.

    Raises:
        ValueError for NaN, which E2M1 has no code for (a data-dependent check: it synchronises with the device).
    """
    v = values.float()
    if bool(torch.isnan(v).any()):
        raise ValueError("E2M1 has no NaN code: NaN cannot be encoded")
    magnitudes = torch.tensor(_magnitudes(E2M1), dtype=torch.float32, device=v.device)
    code = torch.bucketize(v.abs(), magnitudes).clamp(max=len(magnitudes) - 1)  # |v|'s index among the magnitudes
    if bool((magnitudes[code] != v.abs()).any()):
        raise ValueError("encode_e2m1 needs values on the E2M1 grid; cast them first")
    return (code | (torch.signbit(v).to(torch.int64) << 3)).to(torch.uint8)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 E2M1 codes (the inverse of `encode_e2m1`)."""
    return e2m1_values(codes.device)[codes.long()]


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """E2M1 grid values packed two per byte along the last dim (element 2i in the low nibble), uint8.

    An odd last dim is padded with one +0 code; `unpack_e2m1(packed, n)` trims it.
    """
    if values.dim() == 0:
        raise ValueError("pack_e2m1 packs pairs along the last dim, which a 0-d tensor does not have: pass x[None]")
    codes = pad_to_multiple(encode_e2m1(values), 2)
    if codes.numel() == 0:  # no pairs to form: reshape(..., -1, 2) is ambiguous for zero elements
        return codes[..., : codes.shape[-1] // 2]
    return pack_nibbles(codes)


def unpack_e2m1(packed: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """float32 values of `pack_e2m1`'s bytes; `n` keeps the first n elements of the last dim (all when None)."""
    if packed.numel() == 0:
        return torch.zeros(*packed.shape[:-1], 2 * packed.shape[-1], device=packed.device)[..., :n]
    values = decode_e2m1(unpack_nibbles(packed))
    return values if n is None else values[..., :n]


# ---------------------------------------------------------------------------------------------------- scales


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """s_enc = 2688 / amax in float32 (at most float32's max); 1 for a zero, infinite or NaN amax."""
    amax = amax.float()
    s = div_rn(GLOBAL_RANGE, amax).clamp(max=FP32.max)
    return torch.where(torch.isfinite(amax) & (amax > 0), s, torch.ones_like(s))


def block_scales(block_amax: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """E4M3 block decode scales s_b = e4m3((a_b / 6) · s_enc) as float32 values; 1 for a non-finite block amax."""
    s_b = cast(div_rn(block_amax.float(), E2M1.max) * s_enc, E4M3)  # saturates at 448: a given global amax may be small
    return torch.where(torch.isfinite(block_amax), s_b, torch.ones_like(s_b))


def encode_multipliers(s_b: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """r_b = 1 / (s_b · g), at most float32's max; 0 where s_b · g is 0 (the block then encodes to zeros)."""
    d = s_b * g
    r = div_rn(1.0, d).clamp(max=FP32.max)
    return torch.where(d > 0, r, torch.zeros_like(r))


# ---------------------------------------------------------------------------------------------------- layout


def _blocked(x: torch.Tensor, block_2d: bool) -> torch.Tensor:
    """x zero-padded and viewed as (..., K/16, 16), or (..., M/16, 16, K/16, 16) for 16×16 tiles."""
    xp = pad_to_multiple(x, NVFP4_BLOCK, -1)
    if not block_2d:
        return xp.reshape(*xp.shape[:-1], xp.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    xp = pad_to_multiple(xp, NVFP4_BLOCK, -2)
    *lead, m, k = xp.shape
    return xp.reshape(*lead, m // NVFP4_BLOCK, NVFP4_BLOCK, k // NVFP4_BLOCK, NVFP4_BLOCK)


def _unblocked(y: torch.Tensor, shape: torch.Size, block_2d: bool) -> torch.Tensor:
    """Inverse of `_blocked`: back to `shape`, padding trimmed."""
    if not block_2d:
        return y.reshape(*shape[:-1], y.shape[-2] * NVFP4_BLOCK)[..., : shape[-1]]
    *lead, mb, _, kb, _ = y.shape
    return y.reshape(*lead, mb * NVFP4_BLOCK, kb * NVFP4_BLOCK)[..., : shape[-2], : shape[-1]]


def expand_block_scale(scale: torch.Tensor, shape: torch.Size, block_2d: bool) -> torch.Tensor:
    """Block scales repeated over their blocks and trimmed to `shape`."""
    s = scale.repeat_interleave(NVFP4_BLOCK, dim=-1)[..., : shape[-1]]
    if block_2d:
        s = s.repeat_interleave(NVFP4_BLOCK, dim=-2)[..., : shape[-2], :]
    return s


# ---------------------------------------------------------------------------------------------------- NVFP4Quantized


@dataclasses.dataclass
class NVFP4Quantized:
    """A tensor in NVFP4: x ≈ (data · scale) · global_scale, the scale broadcast over its block.

    Attributes:
        data: the E2M1 element values, float32, of x's shape (NaN where x was NaN); `codes()` / `packed()` give
            their 4-bit encodings. None for a cast made for its GEMM operand only (quantize_nvfp4's keep_data).
        scale: E4M3 block decode scales, torch.float8_e4m3fn: (..., ceil(K/16)) for 1×16 blocks along the last
            dim, (..., ceil(M/16), ceil(K/16)) for 16×16 tiles (block_2d).
        global_scale: float32 0-d decode scale g = 1 / s_enc, s_enc = 2688 / amax (see the module docstring).
        amax: float32 0-d amax the global scale was computed from (measured, or the one given).
        block_2d: 16×16 tiles over the last two dims instead of 1×16 blocks along the last.
    """

    data: torch.Tensor | None
    scale: torch.Tensor
    global_scale: torch.Tensor
    amax: torch.Tensor
    block_2d: bool = False
    operand: torch.Tensor | None = None  # data · scale, made with the cast (quantize_nvfp4's operand_dtype)

    @property
    def shape(self) -> torch.Size:
        return (self.data if self.data is not None else self.operand).shape

    @property
    def block(self) -> tuple[int, int]:
        """(rows, cols) of one scale block along the last two dims."""
        return (NVFP4_BLOCK, NVFP4_BLOCK) if self.block_2d else (1, NVFP4_BLOCK)

    def expanded_scale(self) -> torch.Tensor:
        """The E4M3 block scales as float32, broadcast to data's shape."""
        return expand_block_scale(self.scale.float(), self.shape, self.block_2d)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(data · scale) · global_scale in float32 (the first product exact, the second rounded once), in `dtype`."""
        if self.data is None:  # the operand holds data · scale exactly
            return (self.operand.float() * self.global_scale).to(dtype)
        return ((self.data * self.expanded_scale()) * self.global_scale).to(dtype)

    def gemm_operand(self, dtype: torch.dtype = torch.bfloat16) -> Quantized:
        """This tensor as an operand of minifloat.fp8.gemm.scaled_mm: the values data · scale in `dtype` (exact in
        bfloat16: an E2M1 value times an E4M3 one has at most 6 significant bits and lies in [2^-10, 2688]) under
        the per-tensor scale g, which factors out of the K-sum as on NVFP4 tensor cores:
        scaled_mm(a, b) = g_a · g_b · Σ_k (a_k · s_a)(b_k · s_b), accumulated in fp32."""
        if self.operand is not None and self.operand.dtype == dtype:
            operand = self.operand
        else:
            operand = (self.data * self.expanded_scale()).to(dtype)
        return Quantized(None, self.global_scale, E2M1, Granularity.TENSOR, self.amax, operand)

    def codes(self) -> torch.Tensor:
        """uint8 E2M1 codes of data (ValueError if data holds NaN, which E2M1 cannot encode)."""
        return encode_e2m1(self._elements())

    def packed(self) -> torch.Tensor:
        """data as E2M1 codes packed two per byte along the last dim (see `pack_e2m1`)."""
        return pack_e2m1(self._elements())

    def _elements(self) -> torch.Tensor:
        if self.data is None:
            raise ValueError("this NVFP4 cast kept only its GEMM operand (keep_data=False); quantize with "
                             "keep_data=True for the E2M1 elements")
        return self.data

    def t(self) -> NVFP4Quantized:
        """Transpose of a 2-D tensor with 16×16 tiles: bitwise quantize_nvfp4(x.t(), block_2d=True)."""
        if not self.block_2d or len(self.shape) != 2:
            raise ValueError(f"only 2-D tensors with 16×16 blocks (block_2d=True) transpose exactly; 1×16 blocks "
                             f"run along K, so xᵀ must be quantized from x (got block_2d={self.block_2d}, "
                             f"shape {tuple(self.shape)})")
        return NVFP4Quantized(None if self.data is None else self.data.t(), self.scale.t(), self.global_scale,
                              self.amax, True,
                              None if self.operand is None else self.operand.t())

    def nbytes(self) -> int:
        """Bytes of packed elements, E4M3 block scales and the fp32 global scale."""
        k = self.shape[-1]
        rows = math.prod(self.shape) // k if k else 0
        return rows * -(-k // 2) + self.scale.numel() + 4


def quantize_nvfp4(x: torch.Tensor, *, block_2d: bool = False, rounding: str = "nearest",
                   generator: torch.Generator | None = None, global_amax: torch.Tensor | None = None,
                   operand_dtype: torch.dtype | None = None, keep_data: bool = True,
                   seed: torch.Tensor | None = None) -> NVFP4Quantized:
    """Quantize `x` to NVFP4 with the two-level scales of the module docstring.

    Args:
        x: floating tensor; blocks of 16 run along the last dim, or tile the last two dims with `block_2d`. Ragged
            edges are zero-padded for the block amax and trimmed from the result.
        block_2d: 16×16 tiles (weights), so that x and xᵀ share their blocks: quantize_nvfp4(x, block_2d=True).t()
            is bitwise quantize_nvfp4(x.t(), block_2d=True) (arXiv 2509.25149 §4.2).
        rounding: "nearest" (ties to even) or "stochastic" (unbiased; gradients, §4.4) for the elements. Block
            scales are always rounded to nearest.
        generator: the torch.Generator stochastic rounding draws its seed from (None: torch's default one); the
            draws themselves are `numerics.rounding.counter_uniform(seed, ...)`, made inside the cast's kernel.
        seed: stochastic rounding's seed itself, a 0-d int64 tensor in [0, 2^62) (instead of one drawn from
            `generator`): no host-side generator, so a compiled graph can pass one (a layer's counter_seed).
        global_amax: a per-tensor amax the caller has (e.g. the whole tensor's, for one shard of it); None measures
            x's own.
        operand_dtype: also make the GEMM operand (`gemm_operand(operand_dtype)`) in the same pass.
        keep_data: False (with operand_dtype) makes only the operand and the scales: data is None. A GEMM needs no
            more, and the kernel then skips a float32 write per element.
    Returns:
        NVFP4Quantized with data of x's shape.
    """
    check_bool("block_2d", block_2d)
    check_choice("rounding", rounding, ROUNDINGS)
    _check_keep_data(keep_data, operand_dtype)
    if not x.is_floating_point():
        raise TypeError(f"quantize_nvfp4 expects a floating tensor, got {x.dtype}")
    if x.dim() < (2 if block_2d else 1):
        raise ValueError(f"quantize_nvfp4 needs a tensor of at least {2 if block_2d else 1} dims "
                         f"(block_2d={block_2d}), got shape {tuple(x.shape)}")
    x = x.detach()
    amax = abs_max(x, None) if global_amax is None else global_amax.detach().float().reshape(())
    s_enc = global_encode_scale(amax)
    g = div_rn(1.0, s_enc)

    # contiguous: a strided view would block into one the kernel reads 10× slower (quantize_nvfp4_t quantizes a
    # transpose without the copy); float32 inside the kernel, which fuses the conversion
    xb = _blocked(x.contiguous(), block_2d)  # (..., KB, 16) or (..., MB, 16, KB, 16)
    data, s_b, operand = _nvfp4_cast(xb, s_enc, g, _sr_seed(rounding, generator, seed, xb.device),
                                     (-3, -1) if block_2d else (-1,), operand_dtype, keep_data)

    scale = s_b.squeeze(-1).squeeze(-2) if block_2d else s_b.squeeze(-1)

    def unblocked(y: torch.Tensor | None) -> torch.Tensor | None:
        return None if y is None else _unblocked(y, x.shape, block_2d)

    return NVFP4Quantized(unblocked(data), scale.to(E4M3.torch_dtype), g, amax, block_2d, unblocked(operand))


def quantize_nvfp4_t(x: torch.Tensor, *, rounding: str = "nearest", generator: torch.Generator | None = None,
                     global_amax: torch.Tensor | None = None, operand_dtype: torch.dtype | None = None,
                     rht_signs: torch.Tensor | None = None, keep_data: bool = True,
                     seed: torch.Tensor | None = None) -> NVFP4Quantized:
    """quantize_nvfp4(xᵀ) of a 2-D x (M, K), 1×16 blocks along M, without materializing xᵀ.

    The wgrad GEMM quantizes dyᵀ and xᵀ along the token axis M. Transposing first costs a strided copy larger than
    the cast itself; here the blocks run down x's columns (x viewed as (M/16, 16, K)) and the result's data, scale
    and operand are transposed views. The values are bitwise those of quantize_nvfp4(x.t(), ...), stochastic
    rounding included: its draws are indexed by position in xᵀ (tested). `rht_signs`
    first rotates each column's blocks of 16 (hadamard.rht along dim -2, = rht(xᵀ, signs)ᵀ), as the wgrad operands
    of NVFP4 training are (arXiv 2509.25149 §4.3). M is zero-padded to a multiple of 16; the rotated result keeps
    the padded length (rotation fills the padding, and the product over M needs it), the plain one is trimmed to M.
    Other arguments as in quantize_nvfp4.
    """
    check_choice("rounding", rounding, ROUNDINGS)
    _check_keep_data(keep_data, operand_dtype)
    if not x.is_floating_point() or x.dim() != 2:
        raise ValueError(f"quantize_nvfp4_t expects a 2-D floating tensor, got {x.dtype} of shape {tuple(x.shape)}")
    m, k = x.shape
    xp = pad_to_multiple(x.detach(), NVFP4_BLOCK, 0).contiguous()
    if rht_signs is not None:  # in float32; zero rows add nothing to the rotated blocks or to a product over M
        xp = rht(xp.float(), rht_signs, dim=-2)
    amax = abs_max(xp, None) if global_amax is None else global_amax.detach().float().reshape(())
    s_enc = global_encode_scale(amax)
    g = div_rn(1.0, s_enc)
    xb = xp.reshape(xp.shape[0] // NVFP4_BLOCK, NVFP4_BLOCK, k)  # (M/16, 16, K): a block is 16 rows of a column
    data, s_b, operand = _nvfp4_cast(xb, s_enc, g, _sr_seed(rounding, generator, seed, xb.device), (-2,),
                                     operand_dtype, keep_data)

    # rotated, the padding rows are no longer zero and the product over M needs them: keep M padded then
    keep = xp.shape[0] if rht_signs is not None else m

    def t(y: torch.Tensor | None) -> torch.Tensor | None:  # (M/16, 16, K) → the (K, M) view
        return None if y is None else y.reshape(-1, k)[:keep].t()

    return NVFP4Quantized(t(data), s_b.squeeze(-2).t().to(E4M3.torch_dtype), g, amax, False, t(operand))


def _check_keep_data(keep_data: bool, operand_dtype: torch.dtype | None) -> None:
    check_bool("keep_data", keep_data)
    if not keep_data and operand_dtype is None:
        raise ValueError("keep_data=False keeps only the GEMM operand, so it needs operand_dtype (e.g. torch.bfloat16)")


def _sr_seed(rounding: str, generator: torch.Generator | None, seed: torch.Tensor | None,
             device: torch.device) -> torch.Tensor | None:
    """Stochastic rounding's one 62-bit seed: `seed`, or one from `generator` (the draws are made from it inside the
    kernel: counter_uniform); None for rounding to nearest."""
    if rounding != "stochastic":
        return None
    if seed is not None:
        if isinstance(seed, int) and not isinstance(seed, bool):
            check_int("seed", seed, low=0, high=2**62 - 1)
            seed = torch.tensor(seed)
        if not isinstance(seed, torch.Tensor) or seed.numel() != 1 or seed.is_floating_point():
            raise ValueError(f"seed must be an int in [0, 2^62) or a 0-d integer tensor holding one, got {seed!r}")
        return seed.to(device=device, dtype=torch.int64).reshape(())
    return torch.randint(0, 2**62, (), generator=generator, device=device)


def _nvfp4_cast_kernel(xb: torch.Tensor, s_enc: torch.Tensor, g: torch.Tensor, seed: torch.Tensor | None,
                       dims: tuple[int, ...], operand_dtype: torch.dtype | None, keep_data: bool = True
                       ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """The elementwise part of quantize_nvfp4 on blocked x (any floating dtype), in one pass when compiled: (E2M1
    data, the E4M3 block scales as float32, and with `operand_dtype` the GEMM operand data · s_b in it). A block
    is the elements along `dims`: (-1,) for 1×16 blocks, (-3, -1) for 16×16 tiles, (-2,) for blocks down columns.
    A `seed` rounds the elements stochastically with the draws counter_uniform(seed, xb.shape); None rounds to
    nearest. Without `keep_data` the data is not returned (a compiled kernel then never writes it)."""
    xb = xb.float()
    block_amax = xb.abs().amax(dim=dims, keepdim=True)  # NaN propagates through amax
    s_b = block_scales(block_amax, s_enc)
    u = None if seed is None else _draws(seed, xb, dims)
    data = cast(xb * encode_multipliers(s_b, g), E2M1, rounding="nearest" if u is None else "stochastic", uniform=u)
    operand = None if operand_dtype is None else (data * s_b).to(operand_dtype)  # exact: see gemm_operand
    return data if keep_data else None, s_b, operand


_nvfp4_cast = maybe_compile(_nvfp4_cast_kernel)


def _draws(seed: torch.Tensor, xb: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Stochastic rounding's draws for blocked x: counter_uniform(seed, ·) at each element's row-major index in the
    tensor that is quantized. For column blocks (M/16, 16, K) that tensor is xᵀ (K, M), so element (g, i, k) takes
    index k·M + 16·g + i: quantize_nvfp4_t(x) rounds exactly as quantize_nvfp4(x.t()) does."""
    if dims != (-2,):
        return counter_uniform(seed, xb.shape)
    groups, block, k = xb.shape
    dtype = torch.int64 if xb.numel() > 2**31 else torch.int32

    def arange(n: int) -> torch.Tensor:
        return torch.arange(n, dtype=dtype, device=xb.device)

    rows = groups * block  # M, padded
    index = arange(groups)[:, None, None] * block + arange(block)[None, :, None] + arange(k)[None, None, :] * rows
    return counter_uniform_at(seed, index)
