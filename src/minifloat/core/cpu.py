"""What this CPU computes bfloat16 with: its BF16 instructions, read once from the CPU's flags."""

from __future__ import annotations

import dataclasses
import functools
import os
import platform

import torch

_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 flags and the aarch64 feature name
_X86 = ("x86_64", "amd64", "i686", "i386")


@dataclasses.dataclass
class Bf16Support:
    native: bool  # the CPU has BF16 arithmetic instructions (AVX512-BF16, AMX-BF16, Arm BF16)
    mkldnn_bf16: bool | None  # oneDNN's own check (True also where it emulates BF16 with AVX-512)
    cpu_flags: list[str]  # the BF16 flags found in /proc/cpuinfo (Linux only)


def bf16_support(cpuinfo: str = "/proc/cpuinfo") -> Bf16Support:
    """Whether this CPU computes in BF16 natively (Linux: /proc/cpuinfo flags), and oneDNN's verdict."""
    flags: set[str] = set()
    if os.path.exists(cpuinfo):
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    flags.update(value.split())
    found = [f for f in _BF16_FLAGS if f in flags]
    check_fn = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    mkldnn = bool(check_fn()) if check_fn is not None else None
    return Bf16Support(native=bool(found), mkldnn_bf16=mkldnn, cpu_flags=found)


@functools.cache
def bf16_units() -> bool:
    """Whether torch's bfloat16 GEMMs on this CPU run on BF16 instructions: the flags of /proc/cpuinfo where Linux
    has it; elsewhere torch's probes on x86 (AVX512-BF16, AMX) and, on other architectures, taken to be there."""
    if os.path.exists("/proc/cpuinfo"):
        return bf16_support().native
    if platform.machine().lower() not in _X86:
        return True
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(probe() for probe in probes if probe is not None) or all(probe is None for probe in probes)
