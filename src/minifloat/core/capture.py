"""Whether the current work is being recorded into a CUDA graph: one home for the question every host-side cache
asks.

A CUDA graph replays the kernels captured once; the Python that chose them does not run again. So what a capture
takes from a Python-side cache (an FP8 layer's weight cast of this step, a delayed scale's reciprocals made once per
change of the scales) would be frozen into the graph, and a replay after the scales or weights changed would read
the values of the step it was captured in. Under capture those caches are bypassed, as under torch.compile: the work
is recorded from the device buffers themselves, and every replay reads them afresh.
"""

from __future__ import annotations

import torch

from minifloat.core.switch import ThreadSwitch

_PRETEND = ThreadSwitch()  # on inside `pretend_capture()`: every device answers as if capturing (this thread)


def pretend_capture():
    """Inside the block (this thread only) `capturing` is True for every device: the CPU twin of a CUDA graph's
    capture, so that what minifloat does differently there runs, and is tested, without a GPU."""
    return _PRETEND.on()


def capturing(device: torch.device | str) -> bool:
    """Whether the current CUDA stream is capturing a graph, for work on `device` (never for a device that is not
    CUDA, except under `pretend_capture`; a CPU-only build of torch has no CUDA to ask)."""
    if _PRETEND:
        return True
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


def host_caches_usable(device: torch.device | str) -> bool:
    """Whether a cast may take its inputs from a Python-side cache: not inside a compiled graph (dynamo would guard
    on the cache) and not while a CUDA graph is captured (the replay would freeze the cached values)."""
    return not torch.compiler.is_compiling() and not capturing(device)


def refuse_host_read(device: torch.device | str, who: str) -> None:
    """A RuntimeError naming `who` (an FP8 layer) and the fix where a CUDA graph is being captured on `device`, before
    a host read of its delayed scaling state that a capture cannot make (torch's own error names neither)."""
    if capturing(device):
        raise RuntimeError(f"minifloat: {who} reads its delayed scaling state on the host before its scales are "
                           f"seeded (its first training step, or the first after a load), which a CUDA graph capture "
                           f"cannot do; run one training step eagerly before capturing")
