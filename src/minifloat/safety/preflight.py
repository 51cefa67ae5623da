"""Pre-flight checks before low-precision training: does a model (or a checkpoint) overflow or underflow FP16, and
does this CPU support BF16 natively?

    report = preflight(model, sample_batch)     # or preflight(state_dict)
    report.issues, report.fp16_safe, report.bf16
"""

from __future__ import annotations

import dataclasses
import json
from typing import Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from minifloat.core.batch import call_model
from minifloat.core.cpu import Bf16Support, bf16_support  # noqa: F401 - re-exported (PreflightReport.bf16)
from minifloat.core.snapshot import restoring_buffers
from minifloat.core.validate import check_number
from minifloat.numerics.formats import FP16
from minifloat.safety.audit import ROOT

@dataclasses.dataclass
class RangeRecord:
    """How one tensor would fare in FP16."""

    name: str
    kind: str  # "weight" or "activation"
    amax: float
    overflow: int  # finite elements beyond FP16.max
    underflow: float  # fraction of non-zero elements that FP16 flushes to zero


@dataclasses.dataclass
class PreflightReport:
    tensors: list[RangeRecord]
    bf16: Bf16Support
    issues: list[str]

    @property
    def fp16_safe(self) -> bool:
        return not self.issues

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "fp16_safe": self.fp16_safe}, indent=1)

    def table(self):
        from rich.table import Table

        t = Table(title=f"minifloat preflight: FP16 range, BF16 {'native' if self.bf16.native else 'emulated'}")
        for col in ("tensor", "kind", "amax", "> FP16 max", "flushed to 0"):
            t.add_column(col, justify="left" if col in ("tensor", "kind") else "right")
        for r in self.tensors:
            bad = r.overflow or r.underflow > 0
            t.add_row(r.name, r.kind, f"{r.amax:.3g}", str(r.overflow), f"{r.underflow:.2%}",
                      style="red" if bad else None)
        return t


@torch.no_grad()
def _range(name: str, kind: str, t: torch.Tensor) -> RangeRecord:
    x = t.detach().float()
    finite = x[torch.isfinite(x)].abs()
    nonzero = finite[finite != 0]
    flushed = (nonzero <= FP16.min_subnormal / 2).sum().item()  # round-to-nearest-even sends the midpoint to 0
    return RangeRecord(name, kind, float(finite.max()) if finite.numel() else 0.0,
                       int(torch.isinf(finite.half()).sum()), flushed / max(nonzero.numel(), 1))  # >= 65520


def _scaling_state(key: str) -> bool:
    """Whether a state-dict entry is an Fp8Linear's scaling state (its `fp8_state` buffers: amax history, scales).
    It stays fp32 under every policy, and a delayed scale fp8_max / amax is often far above FP16's max."""
    return "fp8_state" in key.split(".")


def preflight(model_or_state_dict: nn.Module | Mapping[str, torch.Tensor], sample_batch=None, *,
              underflow_tolerance: float = 0.01) -> PreflightReport:
    """Check weights (and, given `sample_batch`, every module's outputs) against FP16's range, and BF16 support.
    FP8 scaling state (amax histories, scales) is left out: it stays fp32 whatever the model computes in.

    Args:
        model_or_state_dict: a model or a state dict.
        sample_batch: a batch for one no-grad forward (needs a model); buffers are left as they were.
        underflow_tolerance: the fraction of a tensor's non-zero values FP16 may flush to zero before it is an issue.
    Returns:
        A PreflightReport; `.issues` lists tensors that overflow FP16 or underflow beyond the tolerance.
    """
    check_number("underflow_tolerance", underflow_tolerance, low=0.0, high=1.0, high_open=True)
    is_model = isinstance(model_or_state_dict, nn.Module)
    if sample_batch is not None and not is_model:
        raise ValueError("sample_batch needs a model, got a state dict")
    state = model_or_state_dict.state_dict() if is_model else model_or_state_dict
    records = [_range(k, "weight", v) for k, v in state.items()
               if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() and not _scaling_state(k)]
    if sample_batch is not None:
        model = model_or_state_dict
        acts: dict[str, RangeRecord] = {}

        def hook(module, args, output, name):
            for i, t in enumerate(x for x in tree_leaves(output) if isinstance(x, torch.Tensor)):
                if t.is_floating_point() and t.numel():
                    key = name if i == 0 else f"{name}[{i}]"
                    r, old = _range(key, "activation", t), acts.get(key)
                    if old is not None:  # a module called more than once: keep the worst of its calls
                        r = RangeRecord(key, "activation", max(r.amax, old.amax), r.overflow + old.overflow,
                                        max(r.underflow, old.underflow))
                    acts[key] = r

        handles = [m.register_forward_hook(lambda m, a, o, n=(n or ROOT): hook(m, a, o, n))
                   for n, m in model.named_modules()]
        try:
            with torch.no_grad(), restoring_buffers(model):
                call_model(model, sample_batch)
        finally:
            for h in handles:
                h.remove()
        records += list(acts.values())
    issues = [f"{r.kind} {r.name}: {r.overflow} value(s) beyond FP16's max {FP16.max:g} (amax {r.amax:.3g})"
              for r in records if r.overflow]
    issues += [f"{r.kind} {r.name}: {r.underflow:.1%} of non-zero values flush to zero in FP16"
               for r in records if r.underflow > underflow_tolerance]
    return PreflightReport(records, bf16_support(), issues)
