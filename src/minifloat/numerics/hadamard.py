"""The random Hadamard transform (RHT): an orthogonal 16×16 mix of each block of 16 elements along the last dim.

NVFP4 training applies it to both operands of the weight-gradient GEMM along their shared (token) dimension, where
it spreads a block's outliers over the block so that they no longer dictate its scale (arXiv 2509.25149 §4.3;
Tseng et al., "QuIP#", arXiv 2402.04396, for the random-sign Hadamard). With H the n×n Sylvester Hadamard matrix
(entries ±1, H·H = n·I) and S = diag(signs), signs a fixed random ±1 vector:

    T = H·S / √n        orthogonal: Tᵀ·T = S·H·H·S / n = I
    rht(x)   = x·Tᵀ     each block of n elements along the last dim, as a row vector: y_b = T·x_b
    inverse  = y·T      x_b = Tᵀ·y_b

For a GEMM contracting the transformed dimension, (A·Tᵀ)·(B·Tᵀ)ᵀ = A·Tᵀ·T·Bᵀ = A·Bᵀ: the transform changes what is
quantized, not the product (up to rounding). For n = 16, 1/√n = 1/4 is a power of two, so the scaling is exact and
inputs whose block sums are exact in the compute dtype (e.g. small integers) round-trip bitwise.

The signs come from `rht_signs(seed)`: one seeded draw, to be stored with the scaling state.
"""

from __future__ import annotations

import functools
import math

import torch

from minifloat.core.validate import check_int, check_seed
from minifloat.numerics.compiling import maybe_compile

RHT_BLOCK = 16  # arXiv 2509.25149 §4.3: 16×16 transforms, matching NVFP4's 16-element blocks


@functools.lru_cache(maxsize=None)
def _sylvester(n: int) -> tuple[tuple[float, ...], ...]:
    h = [[1.0]]
    while len(h) < n:  # H_2k = [[H, H], [H, -H]]
        h = [row + row for row in h] + [row + [-v for v in row] for row in h]
    return tuple(tuple(row) for row in h)


def hadamard_matrix(n: int = RHT_BLOCK, *, dtype: torch.dtype = torch.float32,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The n×n Sylvester Hadamard matrix (entries ±1, symmetric, H·H = n·I); n a power of two."""
    check_int("n", n, low=1)
    if n & (n - 1):
        raise ValueError(f"n must be a power of two, got {n}")
    return _hadamard_tensor(n, dtype, torch.device(device) if device is not None else None).clone()


@functools.lru_cache(maxsize=None)
def _hadamard_tensor(n: int, dtype: torch.dtype, device: torch.device | None) -> torch.Tensor:
    # built once per (n, dtype, device): torch.tensor of nested tuples copies element by element (~1,600 small copies
    # per 16×16 matrix), which cost more than the transform itself
    return torch.tensor(_sylvester(n), dtype=dtype, device=device)


def rht_signs(seed: int, n: int = RHT_BLOCK) -> torch.Tensor:
    """n random signs (±1.0, float32) drawn from a CPU generator seeded with `seed`: the same on every machine."""
    check_seed("seed", seed)
    check_int("n", n, low=1)
    generator = torch.Generator().manual_seed(seed)
    # device="cpu": the signs are real numbers also under a `torch.device("meta")` default
    return torch.randint(0, 2, (n,), generator=generator, device="cpu").float() * 2 - 1


def _transform(x: torch.Tensor, signs: torch.Tensor, block: int, inverse: bool, dim: int = -1) -> torch.Tensor:
    check_int("block", block, low=1)
    if block & (block - 1):
        raise ValueError(f"block must be a power of two (a Hadamard matrix of Sylvester's construction), got {block}")
    if x.dim() == 1 and dim == -1:  # one row
        return _transform(x[None], signs, block, inverse, dim)[0]
    if signs.shape != (block,):
        raise ValueError(f"signs must have shape ({block},), got {tuple(signs.shape)}")
    if dim not in (-1, -2):
        raise ValueError(f"dim must be -1 (along rows) or -2 (down columns), got {dim!r}")
    if x.dim() < -dim or x.shape[dim] % block:
        raise ValueError(f"{'the last dim' if dim == -1 else 'dim -2'} must be a multiple of the block {block}, "
                         f"got shape {tuple(x.shape)}")
    dtype = torch.promote_types(x.dtype, torch.float32)  # float32, or float64 for float64 input
    s = signs.to(dtype=dtype, device=x.device)
    return _butterfly_kernel(x, s, block, inverse, dim).to(x.dtype)


def _butterfly(x: torch.Tensor, signs: torch.Tensor, block: int, inverse: bool, dim: int) -> torch.Tensor:
    """The transform as a fast Walsh-Hadamard butterfly in a fixed order of additions.

    y = H·(S·x)/√n forward, x = S·(H·y)/√n inverse, per block. log2(n) stages each replace pairs (a, b) at distance h
    by (a + b, a - b), which yields the Sylvester matrix H_2k = [[H, H], [H, -H]]. The sign flips and the 1/√n = 1/4
    are exact, and every rounding is one addition in an order fixed here: the same bits on every device and under
    every compiler setting (a GEMM sums in the order its BLAS picks, which differs between devices; an FMA cannot reorder additions
    of exact products). torch.autocast plays no part: no GEMM runs.
    """
    norm = 1.0 / math.sqrt(block)  # 1/4 for n = 16: exact
    *lead, rows, cols = x.shape
    # the block's n elements as n tensors (views along the block axis): the stages below are then plain elementwise
    # arithmetic, which the compiler fuses into one pass (a stacked-pairs form compiled to a kernel 20× slower)
    if dim == -2:  # blocks of `block` rows down each column: (..., rows/block, block, cols)
        parts = list(x.to(signs.dtype).reshape(*lead, rows // block, block, cols).unbind(-2))
    else:
        parts = list(x.to(signs.dtype).reshape(*lead, rows, cols // block, block).unbind(-1))
    if not inverse:
        parts = [p * signs[j] for j, p in enumerate(parts)]
    h = 1
    while h < block:  # pairs at distance h inside groups of 2h: (a, b) -> (a + b, a - b)
        new = list(parts)
        for start in range(0, block, 2 * h):
            for i in range(start, start + h):
                new[i], new[i + h] = parts[i] + parts[i + h], parts[i] - parts[i + h]
        parts = new
        h *= 2
    parts = [p * norm for p in parts]
    if inverse:
        parts = [p * signs[j] for j, p in enumerate(parts)]
    return torch.stack(parts, dim=-2 if dim == -2 else -1).reshape(x.shape)


_butterfly_kernel = maybe_compile(_butterfly)


def rht(x: torch.Tensor, signs: torch.Tensor, *, block: int = RHT_BLOCK, dim: int = -1) -> torch.Tensor:
    """H·diag(signs)/√block applied to each block of `block` elements along `dim`.

    Args:
        x: floating tensor whose `dim` is a multiple of `block`.
        signs: (block,) tensor of ±1 (see `rht_signs`).
        block: transform size, a power of two (16 in NVFP4 training).
        dim: -1 (blocks along rows) or -2 (blocks down columns: rht(x, s, dim=-2) = rht(xᵀ, s)ᵀ for 2-D x, with
            no transposed copy: a batched 16×16 product on x's layout).
    Returns:
        A tensor of x's shape and dtype, computed in float32 (float64 for float64 input).
    """
    return _transform(x, signs, block, inverse=False, dim=dim)


def rht_inverse(y: torch.Tensor, signs: torch.Tensor, *, block: int = RHT_BLOCK, dim: int = -1) -> torch.Tensor:
    """The inverse (= transpose) of `rht` with the same signs: rht_inverse(rht(x, s), s) = x up to rounding."""
    return _transform(y, signs, block, inverse=True, dim=dim)
