"""Host syncs in a training step, counted on any device: the instrument of tests/test_host_syncs.py (CPU) and of
tests/test_gpu_training.py's check on a GPU.

A host sync is Python reading a tensor's value (`.item()`, `bool(t)`, `int(t)`, `nonzero`, ...): on a GPU it waits
for every queued kernel, so the host cannot run ahead, and a CUDA graph cannot capture the step. Such a read reaches
the dispatcher as one of the ops in SYNC_OPS, so a TorchDispatchMode sees it on any device (a device tensor's
`.tolist()` or `.cpu()` as a copy to the CPU, counted too; a CPU tensor's `.tolist()` reaches no op). Each one is
attributed to the innermost frame of minifloat's own source that made it.
"""

from __future__ import annotations

import collections
import pathlib
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import minifloat as mf
from gpu_device import RECIPES, autocast
from residual_mlp import MLP

SRC = pathlib.Path(mf.__file__).resolve().parent
# ATen ops whose result Python reads on the host (or whose output shape depends on values): each is a host sync
SYNC_OPS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select",
                      "unique", "_unique2", "unique_consecutive", "repeat_interleave",
                      # torch.tensor / as_tensor of Python data: on a GPU, a copy from pageable host memory, which
                      # waits for the copy (device constants made once and cached do not reach it per step)
                      "lift_fresh"})
# (file under src/minifloat, function): the reads a CPU step may make: ScalingState's checks for a non-finite amax
# (`record`'s, and `warn_if_nonfinite`'s after a cast recorded its own), which warn at once (a CPU waits for nothing;
# on a GPU the checks are skipped)
CPU_ONLY_READS = frozenset({("fp8/scaling.py", "record"), ("fp8/scaling.py", "warn_if_nonfinite")})
DIM, HIDDEN, TOKENS = 128, 256, 32
WARMUP = 3  # steps before the counted one: scales seeded (delayed), every role's host mirror set


class HostSyncs(TorchDispatchMode):
    """Counts the host syncs run inside it, by (file under src/minifloat, function) of the innermost minifloat
    frame that called them; ("", "") when no minifloat frame did."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.__name__.split(".")[0] in SYNC_OPS or to_host(func, args, kwargs):
            self.sites[minifloat_caller()] += 1
        return func(*args, **kwargs)


def to_host(func, args, kwargs) -> bool:
    """A copy of a device tensor to the CPU (`.cpu()`, `.to("cpu")`, a device tensor's `.tolist()`)."""
    name = func.__name__.split(".")[0]
    if name == "_to_copy":
        dest = kwargs.get("device")
        return dest is not None and torch.device(dest).type == "cpu" and args[0].device.type != "cpu"
    if name == "copy_":
        return args[0].device.type == "cpu" and isinstance(args[1], torch.Tensor) and args[1].device.type != "cpu"
    return False


def minifloat_caller() -> tuple[str, str]:
    frame = sys._getframe(1)
    while frame is not None:
        path = pathlib.Path(frame.f_code.co_filename).resolve()
        if path.is_relative_to(SRC):
            return path.relative_to(SRC).as_posix(), frame.f_code.co_name
        frame = frame.f_back
    return "", ""


def make_step(name: str, device: str, *, dim: int = DIM, hidden: int = HIDDEN, tokens: int = TOKENS):
    """A converted residual MLP, its SGD optimizer (no step counter to read) and one training step."""
    torch.manual_seed(0)
    model = mf.convert(MLP(dim, hidden), recipe=dict(RECIPES)[name], keep_first_last=False).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(tokens, dim, device=device)

    def step():
        with autocast(device):
            y = model(x)
        (y.float() ** 2).mean().backward()
        opt.step()  # ends the FP8 step (mf.fp8_step) through the optimizer hook
        opt.zero_grad()

    return step
