"""Which FP8 products run on the GPU's tensor cores, and how torch._scaled_mm is called for them.

`NATIVE_RULES` is the one table: per pair of scalings (a × b), the GPU generations that have the kernel, whether the
torch build must expose blockwise scaling, and the K multiple the kernel needs. `native_granularity` (at cast time:
keep FP8 data or make a bfloat16 operand?) and `native_support` (at GEMM time, with both operands' shapes) read it;
`minifloat.fp8.gemm.gemm_path` makes the decision from them. docs/fp8.md has the table recipe × GPU generation.

A rule minifloat has not yet run on a GPU of its generation (`verified=False`: MXFP8 and NVFP4 on Blackwell) is used
on a device only after `minifloat.fp8.native_check` has multiplied a test product there natively and found it equal
to the exact emulation; otherwise those products run emulated, and one warning says why.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch._subclasses.fake_tensor import FakeTensor

from minifloat.numerics.granularity import Granularity, granularity_info
from minifloat.numerics.quantize import Quantized

BACKENDS = ("auto", "native", "emulated")
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def backend_from_env(backend: str | None = None) -> str:
    """`backend`, or $MINIFLOAT_GEMM_BACKEND (default "auto") when it is None; ValueError for an unknown one."""
    if backend is None:
        backend = os.environ.get("MINIFLOAT_GEMM_BACKEND", "auto")
        if backend not in BACKENDS:
            raise ValueError(f"MINIFLOAT_GEMM_BACKEND must be one of {BACKENDS}, got {backend!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


@dataclasses.dataclass(frozen=True)
class NativeRule:
    """Where torch._scaled_mm runs a pair of scalings.

    Attributes:
        min_capability: the oldest GPU generation (compute capability) with the kernel.
        below_capability: the first generation without it (None: every newer one has it).
        needs_blockwise_torch: the torch build must expose blockwise scaling (torch.nn.functional.ScalingType).
        k_multiple: K must be a multiple of this.
        fuses_bias: the kernel adds a bias (bfloat16/float16 outputs only); otherwise the bias is added after.
        fast_accum: the kernel offers fast accumulation (use_fast_accum: Hopper's FP8 tensor cores keep fewer
            accumulator bits and skip the periodic promotion to fp32; faster, less precise at large K).
        verified: minifloat has run the rule on a GPU of its generation against the emulation; False: each device
            checks it once before use (minifloat.fp8.native_check).
    """

    min_capability: tuple[int, int]
    below_capability: tuple[int, int] | None
    needs_blockwise_torch: bool
    k_multiple: int
    fuses_bias: bool
    fast_accum: bool
    verified: bool = True


_TENSOR_CORES = NativeRule((8, 9), None, False, 16, True, True)
# cuBLAS 12.9's VEC128 / BLK128x128 scaling, on Hopper. The 128×128 scales' K blocks must fill whole 16-byte rows:
# torch 2.11 does not check it, and on an H100 K = 128·{1, 2, 3, 5, 6} returned errors of 10% to 1e34 (scratch probe,
# docs/fp8.md); 1×128 × 1×128 was right for every K that is a multiple of 128 and every M tried (8 to 4096).
_DEEPSEEK_BLOCK = NativeRule((9, 0), (10, 0), True, 512, False, False)
_DEEPSEEK_TILE = NativeRule((9, 0), (10, 0), True, 128, False, False)
# MXFP8: 1×32 blocks with E8M0 scales in cuBLASLt's swizzled layout (VEC32_UE8M0), on Blackwell's tensor cores. Not
# yet run on such a GPU by minifloat: checked on each device before use. The bias is added after the GEMM.
_MX_BLOCKS = NativeRule((10, 0), None, False, 32, False, False, verified=False)
NATIVE_RULES: dict[tuple[Granularity, Granularity], NativeRule] = {
    (Granularity.TENSOR, Granularity.TENSOR): _TENSOR_CORES,
    (Granularity.ROW, Granularity.ROW): _TENSOR_CORES,
    (Granularity.TILE, Granularity.BLOCK): _DEEPSEEK_BLOCK,
    (Granularity.BLOCK, Granularity.TILE): _DEEPSEEK_BLOCK,
    (Granularity.TILE, Granularity.TILE): _DEEPSEEK_TILE,
    (Granularity.MX, Granularity.MX): _MX_BLOCKS,
}
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# NVFP4: E2M1 elements packed two per byte, E4M3 scales of 1×16 blocks in the swizzled layout; the per-tensor scales
# are applied to the product afterwards, as the emulation applies them. Blackwell; not yet run there by minifloat.
NVFP4_RULE = NativeRule((10, 0), None, False, 32, False, False, verified=False)
NVFP4_PAIR = "nvfp4 × nvfp4"
_FP4_TORCH = hasattr(torch, "float4_e2m1fn_x2")


_BLOCKWISE_TORCH = hasattr(torch.nn.functional, "ScalingType")
# per CUDA device index, read once in eager code. A compiled region never reads it: dynamo guards on a dict's keys,
# so a graph traced before the entry existed (a compiled model's first step on a fresh process) was recompiled once
# an eager call filled it (a fullgraph compile with error_on_recompile failed at its second step on a GPU)
_CAPABILITY: dict[int, tuple[int, int] | None] = {}
# A ROCm build reports AMD GPUs through torch.cuda, with gfx numbers as "capabilities" (MI300X: 9.4) that the rules
# above would read as NVIDIA generations. Its FP8 GEMMs take other formats (MI300's e4m3fnuz) and minifloat has not
# run them, so on ROCm every product runs emulated, exactly, and says why.
ROCM_BUILD = torch.version.hip is not None


def no_capability_reason() -> str:
    """Why a CUDA device of this torch build has no native FP8 GEMMs (device_capability is None)."""
    if ROCM_BUILD:
        return ("this torch is a ROCm build: minifloat's native FP8 GEMMs are NVIDIA's (SM 8.9+); on AMD GPUs the "
                "products run emulated, exactly")
    return "this torch has no CUDA GPU or no torch._scaled_mm"


def blockwise_torch() -> bool:
    """Whether this torch's _scaled_mm takes DeepSeek-style blockwise scales (torch 2.9+: F.ScalingType)."""
    return _BLOCKWISE_TORCH


def device_capability(device_index: int = 0) -> tuple[int, int] | None:
    """The CUDA device's compute capability, or None without CUDA or torch._scaled_mm, and on ROCm builds."""
    if torch.compiler.is_compiling():  # constants to dynamo (it evaluates both while tracing); no dict, no guard
        return _read_capability(device_index)
    if device_index not in _CAPABILITY:
        _CAPABILITY[device_index] = _read_capability(device_index)
    return _CAPABILITY[device_index]


def _read_capability(device_index: int) -> tuple[int, int] | None:
    if ROCM_BUILD or not (torch.cuda.is_available() and hasattr(torch, "_scaled_mm")):
        return None
    props = torch.cuda.get_device_properties(device_index)
    return props.major, props.minor


def native_fp8_available(device_index: int = 0) -> bool:
    """Whether this machine has a CUDA GPU with FP8 tensor cores (SM 8.9+) and torch._scaled_mm."""
    capability = device_capability(device_index)
    return capability is not None and capability >= _TENSOR_CORES.min_capability


def _rule_runs_on(rule: NativeRule, capability: tuple[int, int] | None, blockwise: bool) -> bool:
    return (capability is not None and capability >= rule.min_capability
            and (rule.below_capability is None or capability < rule.below_capability)
            and (blockwise or not rule.needs_blockwise_torch))


def generations(rule: NativeRule) -> str:
    """The GPU generations a rule runs on, as messages say it ("SM 9.0+ below SM 10.0")."""
    low = f"SM {rule.min_capability[0]}.{rule.min_capability[1]}+"
    return low if rule.below_capability is None else f"{low} below SM {rule.below_capability[0]}.0"


def check_failed(name: str, device_index: int) -> str:
    """Why a rule not yet run on its GPU generation is off on a device (its check there failed)."""
    return (f"{name} did not pass its check against the emulation on cuda:{device_index} (minifloat has not run it "
            f"on such a GPU before; the warning says why)")


def _checked_on(pair: tuple[Granularity, Granularity] | str, rule: NativeRule, device_index: int) -> bool:
    """A rule the device may use: verified by minifloat, or found equal to the emulation there (checked once)."""
    if rule.verified:
        return True
    from minifloat.fp8 import native_check  # (it imports this module)

    return native_check.passes(pair if isinstance(pair, str) else f"{pair[0]} × {pair[1]}", device_index)


def native_granularity(device: torch.device, granularity: Granularity | str, backend: str | None = None) -> bool:
    """Whether a tensor of `granularity` on `device` should be cast for the native backend (FP8 data and scales
    rather than a bfloat16 operand): some native pairing of it runs on this GPU and torch. The cast-time half of
    the one decision; `native_support` makes the rest with both operands and their shapes in hand."""
    backend = backend_from_env(backend)
    if backend == "emulated" or device.type != "cuda":
        return False
    granularity = Granularity.parse(granularity)
    index = device.index or 0
    capability, blockwise = device_capability(index), blockwise_torch()
    return any(granularity in pair and _rule_runs_on(rule, capability, blockwise) and _checked_on(pair, rule, index)
               for pair, rule in NATIVE_RULES.items())


def _operands_gpu(data: torch.Tensor, capability: tuple[int, int] | None
                  ) -> tuple[int | None, tuple[int, int] | None, str | None]:
    """(device index, capability, None) of the operands' GPU, or a reason they have none. A capability given (tests
    describing a GPU they do not have) is taken as is, with no device index (so no device check)."""
    if capability is not None:
        return None, capability, None
    if not data.is_cuda:
        return None, None, "the operands are not on a CUDA device"
    index = data.device.index or 0
    capability = device_capability(index)
    return index, capability, None if capability is not None else no_capability_reason()


# torch._scaled_mm's row-wise scaling writes float32 and float16 only through cuBLAS's kernel, which it takes on Hopper
# (SM 9.x) with CUDA 12.9+; elsewhere (Ada, Blackwell, older CUDA builds) it runs a kernel of its own that writes
# bfloat16 only ("Only bf16 high precision output types are supported for row-wise scaling").
ROW_WISE_ANY_OUT = ((9, 0), (10, 0), (12, 9))  # capability from, capability below, CUDA from
_CUDA = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])


def row_wise_writes(out_dtype: torch.dtype, capability: tuple[int, int], cuda: tuple[int, int] | None = None) -> bool:
    """Whether torch._scaled_mm's row-wise scaling writes `out_dtype` on a GPU of `capability` (CUDA `cuda`, default
    this torch's build)."""
    low, high, cuda_from = ROW_WISE_ANY_OUT
    return out_dtype == torch.bfloat16 or (low <= capability < high and (cuda or _CUDA) >= cuda_from)


def native_writes(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> bool:
    """Whether a product `native_support` admits (in some output dtype) also writes `out_dtype` natively on the
    operands' GPU: what a backward GEMM checks before asking for its gradient's own dtype."""
    if out_dtype not in OUT_DTYPES:
        return False
    if (a.granularity, b.granularity) != (Granularity.ROW, Granularity.ROW) or a.data is None:
        return True
    capability = device_capability(a.data.device.index or 0) if a.data.is_cuda else None
    return capability is not None and row_wise_writes(out_dtype, capability)


def native_support(a: Quantized, b: Quantized, out_dtype: torch.dtype = torch.bfloat16, *,
                   capability: tuple[int, int] | None = None, blockwise: bool | None = None,
                   cuda: tuple[int, int] | None = None) -> str | None:
    """None when torch._scaled_mm can run a @ bᵀ, else the reason it cannot (one line, for errors and logs).

    `capability`, `blockwise` and `cuda` describe the GPU and torch build (default: the operands' device and this
    torch); tests pass them to check the table on machines without such a GPU (a rule not yet verified is then taken
    as checked; on the operands' own device it must have passed `native_check`).
    """
    if a.data is None or b.data is None:
        return "an operand was cast for the emulated backend (no FP8 data kept)"
    device_index, capability, reason = _operands_gpu(a.data, capability)
    if reason is not None:
        return reason
    blockwise = blockwise_torch() if blockwise is None else blockwise
    rule = NATIVE_RULES.get((a.granularity, b.granularity))
    if rule is None:
        return f"torch._scaled_mm has no {a.granularity} × {b.granularity} scaling"
    if not _rule_runs_on(rule, capability, blockwise):
        gpus = generations(rule)
        torch_note = " and a torch with blockwise _scaled_mm" if rule.needs_blockwise_torch and not blockwise else ""
        return (f"{a.granularity} × {b.granularity} scaling needs {gpus}{torch_note}; "
                f"this GPU is SM {capability[0]}.{capability[1]}")
    pair = (a.granularity, b.granularity)
    if device_index is not None and not _checked_on(pair, rule, device_index):
        return check_failed(f"{a.granularity} × {b.granularity}", device_index)
    if a.data.dtype not in _FP8_DTYPES or b.data.dtype not in _FP8_DTYPES:
        return f"torch._scaled_mm takes FP8 data, not {a.data.dtype} × {b.data.dtype}"
    if a.data.dtype == torch.float8_e5m2 and b.data.dtype == torch.float8_e5m2:
        return "cuBLASLt has no E5M2 × E5M2 kernel"
    if out_dtype not in OUT_DTYPES:
        return f"torch._scaled_mm outputs {[str(d) for d in OUT_DTYPES]}, not {out_dtype}"
    if pair == (Granularity.ROW, Granularity.ROW) and not row_wise_writes(out_dtype, capability, cuda):
        return (f"row-wise scaling writes only bfloat16 on SM {capability[0]}.{capability[1]} with CUDA "
                f"{'.'.join(map(str, cuda or _CUDA))} ({out_dtype} needs SM 9.x and CUDA 12.9+)")
    if len(a.shape) != 2 or len(b.shape) != 2:
        return "torch._scaled_mm multiplies 2-D operands"
    (m, k), n = a.shape, b.shape[0]
    if k % rule.k_multiple or n % 16:
        return (f"{a.granularity} × {b.granularity} needs K a multiple of {rule.k_multiple} and N of 16, "
                f"got M={m}, K={k}, N={n}")
    return None



def native_scale(q: Quantized, side: str) -> torch.Tensor:
    """q's dequantization scales in the shape and memory layout torch._scaled_mm checks for q's scaling on `side`
    ("a": the (M, K) operand; "b": the (N, K) operand, passed as its transpose)."""
    s = q.scale.float()
    info = granularity_info(q.granularity)
    if info.per_tensor:
        return s.reshape(())
    if info.per_row:  # (M, 1) and (1, N), dense: an expanded (stride-0) view is refused
        return s.reshape(-1, 1).contiguous() if side == "a" else s.reshape(1, -1).contiguous()
    if q.granularity == Granularity.TILE:  # (rows, K/128) laid out K-block-major (the row index runs fastest)
        return s.t().contiguous().t() if side == "a" else s.t().contiguous()
    if q.granularity == Granularity.MX:  # E8M0 bytes, swizzled; the same for a and b (both scaled along K)
        return swizzle_block_scales(e8m0_bytes(s.reshape(-1, s.shape[-1]))).view(torch.float8_e8m0fnu)
    # 128×128 blocks: (rows/128, K/128) row-major for a; b's transpose is that layout
    return s.contiguous() if side == "a" else s.contiguous().t()


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales 2^e (e in [-127, 127]) as E8M0 bytes e + 127 (uint8): the float's exponent field,
    exact, 2^-127 (a float32 subnormal, exponent field 0) included."""
    return (scale.float().contiguous().view(torch.int32) >> 23).to(torch.uint8)


SWIZZLE_ROWS, SWIZZLE_COLS = 128, 4  # cuBLASLt's tile of block scales: 128 rows × 4 scales along K


def swizzle_block_scales(s: torch.Tensor) -> torch.Tensor:
    """(R, C) block scales (one per row and 32 or 16 elements along K) in cuBLASLt's 1-D block-scaling layout.

    The matrix is padded with zeros to whole tiles of 128 rows × 4 columns. Tiles follow each other row-tile by
    row-tile (the column tiles of one row tile contiguous); within a tile, scale (r, c) sits at byte
    16·(r mod 32) + 4·(r div 32) + c. Returns a flat contiguous tensor of round_up(R, 128)·round_up(C, 4) elements,
    what torch._scaled_mm checks for MXFP8 (and NVFP4) scales.
    """
    rows, cols = s.shape
    padded_rows, padded_cols = -(-rows // SWIZZLE_ROWS) * SWIZZLE_ROWS, -(-cols // SWIZZLE_COLS) * SWIZZLE_COLS
    if (rows, cols) != (padded_rows, padded_cols):
        s = torch.nn.functional.pad(s, (0, padded_cols - cols, 0, padded_rows - rows))
    # rows r = 128·rt + 32·r4 + r32, columns c = 4·ct + c4 → order (rt, ct, r32, r4, c4)
    tiles = s.reshape(padded_rows // SWIZZLE_ROWS, 4, 32, padded_cols // SWIZZLE_COLS, SWIZZLE_COLS)
    return tiles.permute(0, 3, 2, 1, 4).contiguous().reshape(-1)


def fuses_bias(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> bool:
    """Whether the native kernel for a × b adds a bias itself (tensor and row scaling, 16-bit outputs)."""
    return NATIVE_RULES[(a.granularity, b.granularity)].fuses_bias and out_dtype != torch.float32


def native_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
              fast_accum: bool = False) -> torch.Tensor:
    """torch._scaled_mm(a, bᵀ) for a pair `native_support` admits (a bias only where `fuses_bias`; fast accumulation
    only where the rule offers it, else ignored)."""
    # torch._scaled_mm wants A row-major (M, K), B column-major (K, N) and dequantization scales. Operands cast with
    # their transposed copy (Quantized.data_t) arrive row-major, and .contiguous() is then free.
    fast = fast_accum and NATIVE_RULES[(a.granularity, b.granularity)].fast_accum
    return torch._scaled_mm(aligned(a.data.contiguous()), aligned(b.data.contiguous()).t(),
                            scale_a=aligned(native_scale(a, "a")), scale_b=aligned(native_scale(b, "b")),
                            bias=None if bias is None else aligned(bias.to(out_dtype)), out_dtype=out_dtype,
                            use_fast_accum=fast)


ALIGNMENT = 16  # bytes: cuBLASLt's FP8 kernels refuse any pointer (data, scale, bias) not 16-byte aligned


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t itself where its data starts on a 16-byte boundary, else a copy that does (a view at an odd offset into a
    larger tensor, e.g. one role's 0-d scale in a layer's (roles,) buffer, is refused by cuBLASLt with
    CUBLAS_STATUS_NOT_SUPPORTED). Under torch.compile (and on fake tensors, which have no memory) the compiler
    allocates the operands and this is the identity."""
    if torch.compiler.is_compiling() or isinstance(t, FakeTensor) or t.data_ptr() % ALIGNMENT == 0:
        return t
    return t.clone()


# ---------------------------------------------------------------------------------------------------- NVFP4


def native_nvfp4(device: torch.device, backend: str | None = None) -> bool:
    """Whether NVFP4 casts on `device` should keep their E2M1 elements for the native GEMM (the cast-time half of
    `nvfp4_support`)."""
    backend = backend_from_env(backend)
    if backend == "emulated" or device.type != "cuda" or not _FP4_TORCH:
        return False
    index = device.index or 0
    return _rule_runs_on(NVFP4_RULE, device_capability(index), True) and _checked_on(NVFP4_PAIR, NVFP4_RULE, index)


def nvfp4_support(a, b, out_dtype: torch.dtype = torch.bfloat16, *,
                  capability: tuple[int, int] | None = None) -> str | None:
    """None when torch._scaled_mm can multiply two NVFP4 casts (`NVFP4Quantized`, a (M, K) and b (N, K), their
    elements kept), else the reason it cannot (one line)."""
    if a.data is None or b.data is None:
        return "an operand was cast for the emulated backend (no E2M1 elements kept)"
    if not _FP4_TORCH:
        return "this torch has no float4_e2m1fn_x2"
    device_index, capability, reason = _operands_gpu(a.data, capability)
    if reason is not None:
        return reason
    if not _rule_runs_on(NVFP4_RULE, capability, True):
        return f"{NVFP4_PAIR} needs {generations(NVFP4_RULE)}; this GPU is SM {capability[0]}.{capability[1]}"
    if device_index is not None and not _checked_on(NVFP4_PAIR, NVFP4_RULE, device_index):
        return check_failed(NVFP4_PAIR, device_index)
    if out_dtype not in OUT_DTYPES:
        return f"torch._scaled_mm outputs {[str(d) for d in OUT_DTYPES]}, not {out_dtype}"
    if a.data.dim() != 2 or b.data.dim() != 2:
        return "torch._scaled_mm multiplies 2-D operands"
    (m, k), n = a.shape, b.shape[0]
    if k % NVFP4_RULE.k_multiple or n % 16:
        return f"{NVFP4_PAIR} needs K a multiple of {NVFP4_RULE.k_multiple} and N of 16, got M={m}, K={k}, N={n}"
    return None


def e2m1_packed(values: torch.Tensor) -> torch.Tensor:
    """E2M1 grid values (float) as torch.float4_e2m1fn_x2, element 2i in the low nibble, without reading anything
    on the host. NaN (which E2M1 cannot hold) is written as +0: `nvfp4_block_scales` makes its block's scale NaN."""
    v = torch.nan_to_num(values.float(), nan=0.0).contiguous()  # row-major, as the kernel reads it
    a = v.abs()  # magnitudes 0, 0.5, 1, 1.5 → codes 2a; 2, 3 → a + 2; 4, 6 → a/2 + 4 (exact on the grid)
    magnitude_code = torch.where(a < 2, 2 * a, torch.where(a < 4, a + 2, a * 0.5 + 4)).to(torch.uint8)
    codes = magnitude_code | (torch.signbit(v).to(torch.uint8) << 3)
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous().view(torch.float4_e2m1fn_x2)


def nvfp4_block_scales(q) -> torch.Tensor:
    """q's E4M3 block scales as torch._scaled_mm takes them: one per row and 16 elements along K (16×16 tiles
    repeated down their rows), swizzled; a block holding NaN gets a NaN scale, so that the product is NaN where
    the emulation's is."""
    rows, k = q.shape
    codes = q.scale.view(torch.uint8)
    if q.block_2d:
        codes = codes.repeat_interleave(16, dim=0)[:rows]
    nan_block = q.data.reshape(rows, k // 16, 16).isnan().any(-1)
    codes = torch.where(nan_block, torch.full_like(codes, 0x7F), codes)  # E4M3's NaN
    return swizzle_block_scales(codes).view(torch.float8_e4m3fn)


def nvfp4_mm(a, b, out_dtype: torch.dtype) -> torch.Tensor:
    """Σ_k (a_k · s_a)(b_k · s_b) of two NVFP4 casts `nvfp4_support` admits, on the tensor cores, without their
    per-tensor scales (the caller applies them)."""
    return torch._scaled_mm(e2m1_packed(a.data), e2m1_packed(b.data).t(), scale_a=aligned(nvfp4_block_scales(a)),
                            scale_b=aligned(nvfp4_block_scales(b)), out_dtype=out_dtype)
