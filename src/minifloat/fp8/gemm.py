"""Scaled FP8 matrix multiply: out = (a · sa) @ (b · sb)ᵀ with FP8 operands and fp32 accumulation.

Two backends compute the same thing; `gemm_path` decides which of three paths a product takes:
  * "native": torch._scaled_mm on FP8 tensor cores, where `native_support` says the hardware, the torch build, the
    pair of scalings and the shapes allow it (the table below);
  * "emulated-factored": everywhere else when every scale either factors out of the K-sum (per-tensor, per-row)
    or is folded into its operand (power-of-two block scales: MX, BlockScaling's default). Every FP8 value (times a
    power of two) is exactly a bfloat16 value, so one bfloat16 GEMM with fp32 accumulation multiplies the operands
    exactly and the factored scales are applied to its output;
  * "emulated-k-blocks": other block scales vary along K, so they are applied per K block to fp32 partial sums
    (DeepSeek-V3's promotion).
Which granularity goes where is read from `minifloat.numerics.granularity`'s table.

Native scalings (cuBLASLt through torch._scaled_mm; `NATIVE_RULES`):
    a × b                        GPU                      torch           shapes
    tensor × tensor              SM 8.9+ (Ada, Hopper, …)  any             K, N multiples of 16
    row × row                    SM 8.9+                   any             K, N multiples of 16
    tile × block, block × tile   SM 9.x (Hopper)           ScalingType     K a multiple of 512 (the 128² scales' K
      (1×128 and 128×128)                                                  blocks fill 16-byte rows), N of 16
    tile × tile                  SM 9.x                    ScalingType     K a multiple of 128, N of 16
    mx × mx (1×32, E8M0)         SM 10.0+ (Blackwell)      any             K a multiple of 32, N of 16
Not E5M2 × E5M2 (cuBLASLt has no such kernel). MXFP8's scales go to cuBLASLt as E8M0 bytes in its swizzled layout;
minifloat has not run it on a Blackwell GPU yet, so each device first checks it against the emulation
(minifloat.fp8.native_check). NVFP4 (1×16) has its own rule and GEMM (minifloat.fp8.fourbit.gemm); MXFP4 runs
emulated on every GPU (docs/fp8.md).
Where a rule does not hold the product runs emulated (exactly), or with backend="native" forced, `gemm_path` raises
a ValueError that names the reason.

Output rounding of the emulated backend (its GEMM kernels: minifloat.fp8.emulated_mm): for a bfloat16 output the
accumulator is rounded to bfloat16 by the GEMM and the per-tensor/row scales are applied to that (at most one extra
bfloat16 rounding, 2^-8 relative, against the one a tensor core makes); for float32 (and float16) outputs the GEMM
runs with fp32 output and no extra rounding. The native backend accumulates in the tensor core's own order and
precision (docs/fp8.md gives the measured gap).
"""

from __future__ import annotations

import enum
import logging

import torch

from minifloat.fp8.emulated_mm import addmm_bf16, k_block_mm, mm_bf16, mm_fp32
from minifloat.numerics import compiling
from minifloat.numerics.compiling import maybe_compile
from minifloat.fp8.native import (  # noqa: F401 - native_fp8_available, native_granularity: re-exported
    BACKENDS,
    OUT_DTYPES,
    backend_from_env,
    fuses_bias,
    native_fp8_available,
    native_granularity,
    native_mm,
    native_support,
    native_writes,
)
from minifloat.numerics.granularity import granularity_info
from minifloat.numerics.quantize import Quantized, decode

log = logging.getLogger("minifloat")


class GemmPath(str, enum.Enum):
    """How `scaled_mm` computes a product (see the module docstring)."""

    NATIVE = "native"  # torch._scaled_mm on FP8 tensor cores
    FACTORED = "emulated-factored"  # one bfloat16 GEMM; tensor/row scales on the output, block scales folded in
    K_BLOCKS = "emulated-k-blocks"  # one fp32 GEMM per K block, scaled per block and summed in fp32

    def __str__(self) -> str:
        return self.value


def gemm_path(a: Quantized, b: Quantized, out_dtype: torch.dtype = torch.bfloat16,
              backend: str | None = None) -> GemmPath:
    """The one decision of how `scaled_mm(a, b, out_dtype=out_dtype, backend=backend)` computes its product.

    Args:
        a, b: the operands, (M, K) and (N, K).
        out_dtype: the output dtype.
        backend: "auto" (None: $MINIFLOAT_GEMM_BACKEND, default "auto"), "native" or "emulated".
    Returns:
        GemmPath.NATIVE where requested or (for "auto") where `native_support` allows; else FACTORED when both
        operands' scales factor out of the K-sum or are folded in, else K_BLOCKS.
    Raises:
        ValueError for an unknown backend, or "native" for a product the native backend cannot run (the reason).
    """
    backend = backend_from_env(backend)
    if backend != "emulated":
        reason = native_support(a, b, out_dtype)
        if reason is None:
            return GemmPath.NATIVE
        if backend == "native":
            raise ValueError(f"the native backend cannot run this {a.granularity} × {b.granularity} product of "
                             f"shapes {tuple(a.shape)} × {tuple(b.shape)}: {reason}")
    return GemmPath.FACTORED if _factors_or_folds(a) and _factors_or_folds(b) else GemmPath.K_BLOCKS


def _factors_or_folds(q: Quantized) -> bool:
    """q's scales leave the K-sum intact: they factor out onto the output, or are folded into the operand."""
    return granularity_info(q.granularity).factors_out or q.scale_folded


def resolve_backend(backend: str | None, a: Quantized, b: Quantized,
                    out_dtype: torch.dtype = torch.bfloat16) -> str:
    """The backend `gemm_path` picks for this product: "native" or "emulated"."""
    return "native" if gemm_path(a, b, out_dtype, backend) == GemmPath.NATIVE else "emulated"


def scaled_mm(a: Quantized, b: Quantized, *, out_dtype: torch.dtype = torch.float32,
              bias: torch.Tensor | None = None, backend: str | None = None, fast_accum: bool = False,
              native_out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """(a.data · a.scale) @ (b.data · b.scale)ᵀ (+ bias) with fp32 accumulation.

    Args:
        a: (M, K), scaled along K ("tensor", "row", "tile", "mx") or in 128×128 blocks.
        b: (N, K), same conventions.
        out_dtype: output dtype.
        bias: optional (N,) added to the fp32-scaled accumulator.
        backend: "auto" (default, or $MINIFLOAT_GEMM_BACKEND), "native" or "emulated".
        fast_accum: let a native tensor-wise or row-wise kernel accumulate fast (Transformer Engine does for fprop;
            the emulated backend always accumulates in fp32 and ignores it).
        native_out_dtype: the dtype the native path writes instead of out_dtype (bfloat16, float16 or float32;
            None: out_dtype). A backward GEMM asks for its gradient's own dtype here: the tensor core's epilogue rounds
            the fp32 accumulator once into it, where the emulation rounds to out_dtype and the caller widens.
    Returns:
        (M, N) tensor of out_dtype, or of native_out_dtype where the product ran natively.
    """
    if not isinstance(a, Quantized) or not isinstance(b, Quantized):
        raise TypeError(f"scaled_mm multiplies quantized operands, mf.quantize(x, fmt, ...) of a (M, K) and b (N, K), "
                        f"got {type(a).__name__} and {type(b).__name__}")
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"scaled_mm needs a (M, K) and b (N, K), got {tuple(a.shape)} and {tuple(b.shape)}")
    for field, dtype in (("out_dtype", out_dtype), ("native_out_dtype", native_out_dtype)):
        if dtype is not None and dtype not in OUT_DTYPES:  # an integer or FP8 output would truncate the product
            raise ValueError(f"{field} must be one of {[str(d) for d in OUT_DTYPES]}, got {dtype}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (b.shape[0],)):
        raise ValueError(f"bias must be a ({b.shape[0]},) tensor, one value per output column, got "
                         f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
    path = gemm_path(a, b, out_dtype, backend)
    if path == GemmPath.NATIVE:
        return _native(a, b, out_dtype, bias, fast_accum, native_out_dtype)
    return _emulated(a, b, out_dtype, bias, path)


def _emulated(a: Quantized, b: Quantized, out_dtype: torch.dtype, bias: torch.Tensor | None,
              path: GemmPath) -> torch.Tensor:
    if path == GemmPath.FACTORED:
        return _emulated_factored(a, b, out_dtype, bias)
    return _emulated_k_blocks(a, b, out_dtype, bias)


def _native(a: Quantized, b: Quantized, out_dtype: torch.dtype, bias: torch.Tensor | None,
            fast_accum: bool, native_out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch._scaled_mm writing native_out_dtype (None: out_dtype); a product it refuses runs emulated in out_dtype.

    Where the GPU cannot write native_out_dtype (row-wise scaling off Hopper writes only bfloat16: `native_writes`),
    or torch refused it before, the product runs natively in out_dtype instead and the caller widens it, as before
    native_out_dtype existed."""
    compiling = torch.compiler.is_compiling()
    if native_out_dtype in (None, out_dtype) or not native_writes(a, b, native_out_dtype) or (
            not compiling and _REFUSED and _refusal_key(a, b, native_out_dtype, bias) in _REFUSED):
        native_out_dtype = out_dtype
    own_dtype = native_out_dtype != out_dtype  # a gradient's own dtype: refused, the compute dtype runs natively
    fuse = bias is not None and fuses_bias(a, b, native_out_dtype)
    # refused before: straight to the emulation, without asking cuBLAS again each step. A compiled region never
    # reads the set (dynamo would guard on its contents: a refusal in eager code would recompile every graph)
    # (host time: the key is built only once something was refused)
    key = None if compiling or not _REFUSED else _refusal_key(a, b, native_out_dtype, bias)
    if key is not None and key in _REFUSED:
        return _emulated(a, b, out_dtype, bias, _emulated_path(a, b))
    try:  # a bias the kernel cannot add goes on the fp32 result, rounded once to out_dtype
        out = native_mm(a, b, native_out_dtype if fuse or bias is None else torch.float32, bias if fuse else None,
                        fast_accum)
    except (RuntimeError, ValueError) as exc:  # torch raises either (TORCH_CHECK / TORCH_CHECK_VALUE)
        if compiling:
            raise
        # a configuration the rules admit but this cuBLAS refuses: said once per shape, then the product in the
        # compute dtype where a gradient's own dtype was asked for, else the exact emulation
        _REFUSED.add(_refusal_key(a, b, native_out_dtype, bias))
        _warn_native_refused(a, b, exc, native_out_dtype if own_dtype else None)
        if own_dtype:
            return _native(a, b, out_dtype, bias, fast_accum)
        return _emulated(a, b, out_dtype, bias, _emulated_path(a, b))
    return out if bias is None or fuse else _epilogue(out, None, None, bias, native_out_dtype)


# products torch._scaled_mm refused in this process (by scalings, shapes, dtypes, output and bias): they run emulated
_REFUSED: set[tuple] = set()


def _warn_native_refused(a: Quantized, b: Quantized, exc: Exception, written: torch.dtype | None = None) -> None:
    """One warning per refused product; `written`: the output dtype refused, where the compute dtype is tried next."""
    log.warning("minifloat: torch._scaled_mm refused a %s × %s product of shapes %s × %s%s (%s); %s",
                a.granularity, b.granularity, tuple(a.shape), tuple(b.shape),
                "" if written is None else f" written in {written}",
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                "it runs emulated" if written is None else "it runs natively in the compute dtype")


def _refusal_key(a: Quantized, b: Quantized, out_dtype: torch.dtype, bias: torch.Tensor | None) -> tuple:
    return (str(a.granularity), str(b.granularity), tuple(a.shape), tuple(b.shape),
            *(None if q.data is None else (q.data.dtype, q.data.device) for q in (a, b)), out_dtype, bias is not None)


def _emulated_path(a: Quantized, b: Quantized) -> GemmPath:
    return GemmPath.FACTORED if _factors_or_folds(a) and _factors_or_folds(b) else GemmPath.K_BLOCKS


# ---------------------------------------------------------------------------------------------------- emulated


def _epilogue_kernel(acc: torch.Tensor, sa: torch.Tensor | None, sb: torch.Tensor | None,
                     bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """acc · sa · sb + bias in fp32, rounded once to out_dtype (one pass over the output)."""
    out = acc.float()
    if sa is not None:
        out = out * sa
    if sb is not None:
        out = out * sb
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


_epilogue_compiled = maybe_compile(_epilogue_kernel)


def _epilogue(acc: torch.Tensor, sa: torch.Tensor | None, sb: torch.Tensor | None, bias: torch.Tensor | None,
              out_dtype: torch.dtype) -> torch.Tensor:
    """acc · sa · sb + bias rounded once to out_dtype. With a scale and a bias, the fp32 product is rounded before
    the add on every device: a fused kernel would contract them into an FMA (one rounding) on a GPU, so there (and
    on a CPU whose compiler is allowed to contract) they are added by `scale_then_add`, a custom op that no compiler
    fuses. A CPU kernel compiled as inductor compiles by default rounds each op, so it runs the one fused pass."""
    cpu_exact = acc.device.type == "cpu" and compiling.CPU_KERNELS_ROUND_EACH_OP
    if bias is not None and (sa is not None or sb is not None) and not cpu_exact:
        one = acc.new_ones(())
        return scale_then_add(acc, one if sa is None else sa, one if sb is None else sb, bias, out_dtype)
    return _epilogue_compiled(acc, sa, sb, bias, out_dtype)


epilogue = _epilogue  # the 4-bit GEMM (minifloat.fp8.fourbit.gemm) applies its per-tensor scales the same way


@torch.library.custom_op("minifloat::scale_then_add", mutates_args=(),
                         schema="(Tensor acc, Tensor sa, Tensor sb, Tensor bias, ScalarType out_dtype) -> Tensor")
def scale_then_add(acc: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, bias: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """(acc · sa · sb) + bias in fp32, each operation rounded on its own (eager ops: no FMA contraction), then
    rounded once to out_dtype."""
    out = acc.float() * sa  # one fp32 temporary, then in place
    out.mul_(sb)
    return out.add_(bias).to(out_dtype)


@scale_then_add.register_fake
def _scale_then_add_shape(acc, sa, sb, bias, out_dtype):
    return acc.new_empty(acc.shape, dtype=out_dtype)


def operand(q: Quantized, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """q's grid values in `dtype`, with its scales folded in when `q.scale_folded` (exact)."""
    if q.operand is not None and q.operand.dtype == dtype:
        return q.operand
    if q.data is None:
        return q.operand.to(dtype)
    if q.scale_folded:
        return q.dequantize(dtype)  # data · power-of-two scales: exact in bfloat16
    return decode(q.data.detach(), None, dtype)


def _outer_scale(q: Quantized, side: str) -> torch.Tensor | None:
    """The scale that factors out of the K-sum, shaped to broadcast over (M, N); None when there is none to apply
    (folded into the operand, or varying along K: applied per K block)."""
    info = granularity_info(q.granularity)
    if q.scale_folded or not info.factors_out:
        return None
    if info.per_row:
        return q.scale.float().reshape(-1, 1) if side == "a" else q.scale.float().reshape(1, -1)
    return q.scale.float()


def _k_block_scales(q: Quantized) -> tuple[torch.Tensor | None, int]:
    """((rows, K blocks) scales, K-block width) of an operand whose scales vary along K and are not folded in;
    (None, 0) for any other operand."""
    info = granularity_info(q.granularity)
    if q.scale_folded or info.factors_out:
        return None, 0
    rows, cols = info.block
    s = q.scale.float()
    return (s.reshape(q.shape[0], -1) if rows == 1 else s.repeat_interleave(rows, dim=0)[: q.shape[0]]), cols


def _emulated_factored(a: Quantized, b: Quantized, out_dtype: torch.dtype,
                       bias: torch.Tensor | None) -> torch.Tensor:
    A, B = compiling.graph_operand(operand(a)), compiling.graph_operand(operand(b))
    sa, sb = _outer_scale(a, "a"), _outer_scale(b, "b")
    scalar = (sa is None or sa.dim() == 0) and (sb is None or sb.dim() == 0)
    if out_dtype == torch.bfloat16 and scalar and A.device.type == "cpu":
        # one GEMM: alpha scales the fp32 accumulator, the bias is added before its one rounding
        one = torch.ones((), dtype=torch.float32, device=A.device)
        alpha = (one if sa is None else sa) * (one if sb is None else sb)
        return addmm_bf16(A, B.t(), alpha, bias)
    if sa is None and sb is None and bias is None:  # the fp32 sum rounded once
        return mm_bf16(A, B.t()) if out_dtype == torch.bfloat16 else mm_fp32(A, B.t()).to(out_dtype)
    # scales (per row, per column) and the bias apply to the fp32 accumulator, rounded once after them, as the
    # tensor cores' epilogue does: a bfloat16 product rounded before them would be rounded twice, and a bias that
    # cancels most of the product would leave only that first rounding's error
    return _epilogue(mm_fp32(A, B.t()), sa, sb, bias, out_dtype)


def _emulated_k_blocks(a: Quantized, b: Quantized, out_dtype: torch.dtype, bias: torch.Tensor | None):
    A, B = operand(a, torch.float32), operand(b, torch.float32)
    (sa, wa), (sb, wb) = _k_block_scales(a), _k_block_scales(b)
    out = k_block_mm(A, B, sa, wa, sb, wb)
    return _epilogue(out, _outer_scale(a, "a"), _outer_scale(b, "b"), bias, out_dtype)
