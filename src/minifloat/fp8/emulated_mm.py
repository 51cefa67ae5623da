"""The GEMM kernels of the emulated FP8 backend (minifloat.fp8.gemm): exact products of FP8 values, fp32 sums.

Every FP8 value times a power of two is a bfloat16 value, so a GEMM of the operands as bfloat16 (or as float32)
multiplies them exactly and accumulates in fp32. The kernels are custom ops: opaque to torch.compile, so a compiled
model calls the very kernels eager mode calls (and gets the same bits) instead of re-deriving them, which would need
host reads (`alpha`) and process-global flags (oneDNN's fp32 precision) inside the graph.

A bfloat16 output is the fp32 sum rounded once to bfloat16. On a CPU with BF16 instructions (x86 with AVX512-BF16
or AMX, Arm with BF16) torch's bfloat16 GEMM computes it. On a CPU without them that GEMM is 30-60x slower than the
fp32 one (a 2-core AMD EPYC with AVX2 only: 1024×64×256 in 19.9 ms against 0.64 ms), so there an fp32 GEMM of the
same values and one rounding to bfloat16 compute it: the same products and fp32 sum, added in the fp32 kernel's
order (`CPU_BF16_GEMM`, from minifloat.core.cpu).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.utils.flop_counter import register_flop_formula

from minifloat.core.autocast import autocast_off
from minifloat.core.cpu import bf16_units

CPU_BF16_GEMM = bf16_units()  # decided once per process from the CPU's flags: the same choice every run


def _bf16_gemm_here(device: torch.device) -> bool:
    return device.type != "cpu" or CPU_BF16_GEMM


@contextlib.contextmanager
def _fp32_matmul_via_bf16():
    """Let oneDNN run fp32 GEMMs on bfloat16 units. Exact here: every operand value is a bfloat16 value."""
    knob = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    if knob is None or not hasattr(knob, "fp32_precision"):
        yield
        return
    old = knob.fp32_precision
    knob.fp32_precision = "bf16"
    try:
        yield
    finally:
        knob.fp32_precision = old


@torch.library.custom_op("minifloat::mm_fp32", mutates_args=(), schema="(Tensor x, Tensor y_t) -> Tensor")
def mm_fp32(x: torch.Tensor, y_t: torch.Tensor) -> torch.Tensor:
    """x @ y_t in float32 with exact products (operands are bfloat16 values) and fp32 accumulation.

    On CPUs oneDNN may run it on bfloat16 units; on GPUs TF32, if enabled, holds bfloat16 values exactly too.
    """
    # autocast off: a custom op's body runs its ops through the dispatcher afresh, where autocast would make this
    # an fp16/bf16 GEMM
    with autocast_off(x.device.type):
        if x.device.type == "cpu":
            with _fp32_matmul_via_bf16():
                return x.float() @ y_t.float()
        return x.float() @ y_t.float()


@mm_fp32.register_fake
def _mm_fp32_shape(x, y_t):
    return x.new_empty((x.shape[0], y_t.shape[1]), dtype=torch.float32)


def mm_bf16(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """a @ b_t of bfloat16 operands, the fp32 sum rounded once to bfloat16."""
    if _bf16_gemm_here(a.device):
        return torch.mm(a, b_t)
    return mm_fp32(a, b_t).to(torch.bfloat16)


@torch.library.custom_op("minifloat::addmm_bf16", mutates_args=(),
                         schema="(Tensor a, Tensor b_t, Tensor alpha, Tensor? bias) -> Tensor")
def addmm_bf16(a: torch.Tensor, b_t: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """bfloat16 alpha · (a @ b_t) + bias: one GEMM whose fp32 result (the bias rounded to bfloat16 first) is rounded
    once to bfloat16 (by oneDNN's bfloat16 GEMM, or after an fp32 one where the CPU has no bfloat16 units).

    `alpha` is a 0-dim tensor read on the host: the CPU holds it already, so the read costs no device sync.
    """
    bf16 = _bf16_gemm_here(a.device)
    dtype = torch.bfloat16 if bf16 else torch.float32
    base = (bias.to(torch.bfloat16).to(dtype) if bias is not None
            else torch.zeros((), dtype=dtype, device=a.device).expand(a.shape[0], b_t.shape[1]))
    # beta=0 ignores the zero-stride placeholder when there is no bias
    with autocast_off(a.device.type):
        out = torch.addmm(base, a.to(dtype), b_t.to(dtype), beta=1.0 if bias is not None else 0.0,
                          alpha=float(alpha))
    return out if bf16 else out.to(torch.bfloat16)


@addmm_bf16.register_fake
def _addmm_bf16_shape(a, b_t, alpha, bias):
    return a.new_empty((a.shape[0], b_t.shape[1]), dtype=torch.bfloat16)


@torch.library.custom_op("minifloat::k_block_mm", mutates_args=(),
                         schema="(Tensor a, Tensor b, Tensor? sa, int wa, Tensor? sb, int wb) -> Tensor")
def k_block_mm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor | None, wa: int, sb: torch.Tensor | None,
               wb: int) -> torch.Tensor:
    """Σ over K blocks of (a_blk @ b_blkᵀ) · sa_blk · sb_blk in fp32: DeepSeek-V3 §3.3.2's promotion.

    Products of each K block are summed in fp32, scaled by that block's scales (`sa`: (M, K/wa), `sb`: (N, K/wb);
    None where the operand's scales are folded in or factor out) and accumulated into an fp32 result ("promotion to
    CUDA cores"). A custom op, so compiled graphs run this very loop (the same bits) rather than refusing it.
    """
    width = math.gcd(wa, wb)  # K blocks this wide lie within one scale block of each operand (gcd(w, 0) = w)
    m, k = a.shape
    out = torch.zeros(m, b.shape[0], dtype=torch.float32, device=a.device)
    for start in range(0, k, width):  # (mm_fp32 switches autocast off; the rest is elementwise)
        part = mm_fp32(a[:, start:start + width], b[:, start:start + width].t())
        if sa is not None:
            part = part * sa[:, start // wa : start // wa + 1]
        if sb is not None:
            part = part * sb[:, start // wb].reshape(1, -1)
        out += part
    return out


@k_block_mm.register_fake
def _k_block_mm_shape(a, b, sa, wa, sb, wb):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.float32)


# FLOPs of the custom-op GEMMs for torch.utils.flop_counter.FlopCounterMode (MFU tools count with it): 2·M·K·N each,
# as torch counts mm. A dispatch mode sees each custom op as one op and not the GEMMs inside it, which would count 0.
@register_flop_formula([torch.ops.minifloat.mm_fp32, torch.ops.minifloat.addmm_bf16])
def _mk_kn_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    (m, k), (_, n) = a_shape, b_shape
    return 2 * m * k * n


@register_flop_formula(torch.ops.minifloat.k_block_mm)
def _mk_nk_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    (m, k), (n, _) = a_shape, b_shape
    return 2 * m * k * n
