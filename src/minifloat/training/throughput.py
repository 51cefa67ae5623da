"""Where a run trains and how fast: the device "auto" resolves to, the model FLOPs per token and the MFU.

MFU (model FLOPs utilisation, PaLM appendix B) = achieved model FLOP/s / the accelerator's peak. Model FLOPs per
token are 6·N for the N weights of the model's matrix multiplications, its nn.Linear layers, the output head included
even when tied to the embedding (forward 2·N, backward 4·N), plus 12·L·T·d for attention's two T×T matmuls (L
layers, T tokens of context, d model width): recomputation is not counted. The peak is the GPU's dense
BF16 tensor-core rate (PEAK_BF16_TFLOPS), also for FP8 runs, so FP8 presets compare with BF16 on one scale. On a CPU
there is no meaningful peak and MFU is None.
"""

from __future__ import annotations

import re

import torch
from torch import nn

# dense (no sparsity) BF16 tensor-core peak, TFLOP/s, by a substring of torch.cuda.get_device_name(); first match
# wins, so longer names come first. From the vendors' data sheets.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),  # SXM
    ("H200", 989.4),
    ("H800", 989.4),
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("B100", 1750.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("RTX 4090", 165.2),
    ("A10G", 70.0),
    ("A10", 125.0),
)


def resolve_device(name: str) -> torch.device:
    """"auto" -> cuda when torch sees a GPU, else cpu; any other name as torch.device.

    Raises:
        ValueError: a CUDA device was asked for and torch has none, or its index is out of range.
    """
    if not isinstance(name, str) or not re.fullmatch(r"auto|cpu|meta|cuda(:\d+)?", name):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: this torch build sees no CUDA GPU (torch {torch.__version__}); "
                             f"use --device cpu, or install a CUDA build of torch on a machine with a GPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices (cuda:0 .. "
                             f"cuda:{torch.cuda.device_count() - 1})")
    return device


def compute_device(name: str, what: str) -> torch.device:
    """resolve_device for work that computes (`what`, e.g. "generate"): the meta device, which holds shapes and no
    numbers, is refused in one line."""
    device = resolve_device(name)
    if device.type == "meta":
        raise ValueError(f"--device meta holds shapes only and cannot {what}; use --device cpu, cuda or auto")
    return device


def peak_bf16_flops(device: torch.device) -> float | None:
    """The device's dense BF16 peak in FLOP/s, or None (a CPU, or a GPU not in PEAK_BF16_TFLOPS)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


def flops_per_token(model: nn.Module, *, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token: 6·(weights of every nn.Linear, each use counted) + 12·n_layers·seq_len·d_model."""
    gemm_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return 6.0 * gemm_weights + 12.0 * n_layers * seq_len * d_model


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1] (None without a peak)."""
    if not peak_flops:
        return None
    return tokens_per_s * flops_per_tok / peak_flops
