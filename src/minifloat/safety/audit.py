"""Precision audit: which dtype every op of a training step actually ran in, checked against a mixed-precision policy.

    report = audit(model, batch, loss_fn=loss_fn)       # one forward + backward, model left as found
    report.violations            # [Violation(rule, module, phase, op, dtype, detail)]
    print(report.to_json());  Console().print(report.table())

A `TorchDispatchMode` sees every ATen op below autograd and autocast, so it records the dtypes the kernels really ran
in (after autocast's casts). Forward ops are attributed to the innermost module running them (forward pre/post hooks
keep a module stack). Backward ops are attributed through the autograd graph: when a module's forward returns, the
graph nodes it created (reached from its outputs, stopping at its inputs' nodes) are claimed for it, and during
backward `torch._C._current_autograd_node()` names the node running. minifloat's emulated FP8 GEMM is a bfloat16
GEMM on operands that lie on the FP8 grid, so a GEMM counts as FP8 when it runs inside an FP8-enabled `Fp8Linear`
(forward) or inside the backward node of `Fp8LinearFunction` (or of `Fp4LinearFunction`, the 4-bit recipes': their
GEMMs count as "fp8", the low-precision class), or when an operand has a float8 dtype (native backend).

The questions to ask before a run (FP16 range, native BF16) are `minifloat.safety.preflight`'s.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Callable, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from minifloat.core.autocast import autocast_off
from minifloat.core.batch import call_model
from minifloat.core.roles import EMBEDDING_TYPES, HEAD_NAMES, is_norm_type_name, output_head
from minifloat.core.snapshot import restoring_buffers
from minifloat.core.validate import check_bool
from minifloat.fp8.autograd import Fp8LinearFunction
from minifloat.fp8.fourbit.linear import Fp4LinearFunction
from minifloat.fp8.modules import Fp8Linear, current_autocast
from minifloat.numerics.compiling import eager_kernels

log = logging.getLogger("minifloat")

ROOT, LOSS, BACKWARD = "(model)", "<loss>", "<backward>"  # pseudo module paths
# ATen's GEMMs, and the custom-op GEMM kernels of minifloat.fp8.emulated_mm (minifloat::mm_fp32,
# minifloat::addmm_bf16, minifloat::k_block_mm), which a dispatch mode sees as single ops
_GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "_scaled_mm", "_scaled_grouped_mm",
                    "mm_fp32", "addmm_bf16", "k_block_mm"})
_CONVERSIONS = frozenset({"_to_copy", "copy_", "to", "clone", "detach", "view", "t", "expand", "_unsafe_view",
                          "transposed_copy"})
# fused norm kernels accumulate in their statistics' dtype (mean/rstd are fp32 for bf16 inputs): judge them by the
# widest floating tensor they touch, forward and backward
_NORM_KERNELS = frozenset({
    "native_layer_norm", "native_layer_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward",
    "native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training", "_batch_norm_with_update", "batch_norm_backward",
    "native_group_norm", "native_group_norm_backward"})
# fused attention kernels (scaled_dot_product_attention's flash / cuDNN / memory-efficient / CPU-flash backends and
# their backward): bf16 q, k, v in, but the scores' running max and sum and the probs·V accumulation stay in fp32
# inside the kernel (minifloat.amp.attention); their fp32 logsumexp is the one tensor that shows it, so they are
# judged, as the fused norms, by the widest tensor they touch
_FUSED_ATTENTION = frozenset({
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
    "_efficient_attention_backward"})
_SOFTMAX_OPS = frozenset({"_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
                          "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward",
                          "cross_entropy_loss"})
# a softmax or log-sum-exp written by hand (exp, sum, divide): its exp in low precision is what shows it
_EXP_OPS = frozenset({"exp", "exp_", "logsumexp"})
_EMBEDDING_OPS = frozenset({"embedding", "embedding_dense_backward", "_embedding_bag", "embedding_bag"})
_EMBEDDING_TYPE_NAMES = frozenset(t.__name__ for t in EMBEDDING_TYPES)
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})
_COLLECTIVES = frozenset({"allreduce_", "allreduce_coalesced_", "reduce_scatter_", "_reduce_scatter_base_",
                          "all_reduce", "all_reduce_", "all_reduce_coalesced", "reduce_scatter_tensor",
                          "reduce_scatter_tensor_coalesced"})
_NOTABLE = _GEMMS | _NORM_KERNELS | _FUSED_ATTENTION | _SOFTMAX_OPS | _EMBEDDING_OPS | _COLLECTIVES
_FP32_BITS = torch.finfo(torch.float32).bits


@dataclasses.dataclass(frozen=True)
class AuditRules:
    """A mixed-precision policy as checkable rules; each flag switches one rule on.

    Attributes:
        softmax_fp32: softmax, log_softmax and cross-entropy (nll_loss) run in fp32.
        norms_fp32: fused layer/RMS/batch/group norm kernels accumulate in fp32, and inside norm modules (class
            names as minifloat.core.roles.is_norm_type_name reads them: ending in "Norm") the statistics ops
            (`norm_stat_ops`) run in fp32 (catches hand-written norms).
        embedding_not_fp8: embedding lookups (and their backward) never run in FP8.
        collectives_fp32: all-reduce / reduce-scatter (c10d ops) of floating tensors run in fp32.
        head_not_fp8: the output head's GEMMs never run in FP8. The head is minifloat.core.roles.output_head's,
            with `head_names` as its names (the one mf.convert and PrecisionPolicy keep in high precision).
        head_names: own names of an nn.Linear that mark the output head, in priority order.
        norm_stat_ops: ATen ops (overload packet names) that compute a norm's statistics.
    """

    softmax_fp32: bool = True
    norms_fp32: bool = True
    embedding_not_fp8: bool = True
    collectives_fp32: bool = True
    head_not_fp8: bool = True
    head_names: tuple[str, ...] = HEAD_NAMES
    norm_stat_ops: tuple[str, ...] = ("mean", "var", "var_mean", "std", "std_mean", "sum", "rsqrt", "sqrt",
                                      "linalg_vector_norm", "norm")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "bool":
                check_bool(f.name, value)
            if f.type.startswith("tuple") and not (isinstance(value, tuple)
                                                   and all(isinstance(v, str) for v in value)):
                raise ValueError(f"{f.name} must be a tuple of str, got {value!r}")


@dataclasses.dataclass
class OpRecord:
    """One ATen op as it ran: `precision` is "fp8" for FP8 GEMMs, else the compute dtype's name."""

    module: str  # module path ("(model)" for the root, "<loss>" for loss_fn, "<backward>" if unattributed)
    module_type: str
    phase: str  # "forward" or "backward"
    op: str  # e.g. "aten._softmax.default"
    in_dtypes: list[str]
    out_dtypes: list[str]
    precision: str


@dataclasses.dataclass
class Violation:
    rule: str
    module: str
    phase: str
    op: str
    precision: str
    detail: str


@dataclasses.dataclass
class AuditReport:
    records: list[OpRecord]
    violations: list[Violation]
    head: str | None  # the module judged to be the output head

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_json(self) -> str:
        return json.dumps({"head": self.head, "violations": [dataclasses.asdict(v) for v in self.violations],
                           "records": [dataclasses.asdict(r) for r in self.records]}, indent=1)

    def summary(self) -> dict[tuple[str, str, str, str], int]:
        """Op counts per (module, phase, op, precision), in first-seen order."""
        out: dict[tuple[str, str, str, str], int] = {}
        for r in self.records:
            key = (r.module, r.phase, r.op, r.precision)
            out[key] = out.get(key, 0) + 1
        return out

    def table(self, *, full: bool = False):
        """A rich Table of op counts per (module, phase, op, precision), violating rows in red. By default only the
        ops the rules look at (GEMMs, softmax, norms, embeddings, collectives) and violations; `full` shows all.
        Made for 80 columns: an op's default overload is not spelled out (aten.mm, not aten.mm.default; the JSON
        has the full name), and the "rule broken" column is there only when a rule is broken."""
        from rich.table import Table

        bad = {(v.module, v.phase, v.op, v.precision): v.rule for v in self.violations}
        t = Table(title=f"minifloat precision audit: {len(self.violations)} violation(s), head {self.head!r}")
        columns = ("module", "phase", "op", "precision", "count") + (("rule broken",) if bad else ())
        for col in columns:  # a module's name whole on one line: where 80 columns are too few, the op wraps first
            t.add_column(col, justify="right" if col == "count" else "left", no_wrap=col == "module")
        for key, n in self.summary().items():
            rule = bad.get(key, "")
            if full or rule or _packet(key[2]) in _NOTABLE:
                module, phase, op, precision = key
                cells = (module, phase, op.removesuffix(".default"), precision, str(n)) + ((rule,) if bad else ())
                t.add_row(*cells, style="red" if rule else None)
        return t


def _packet(op: str) -> str:
    parts = op.split(".")
    return parts[1] if len(parts) > 1 else op


def _float_dtypes(tensors) -> list[torch.dtype]:
    return [t.dtype for t in tensors if t.is_floating_point()]


def _compute_dtype(name: str, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> torch.dtype | None:
    """The dtype an op computes in: the widest floating tensor for fused norms and fused attention (their
    statistics), the output for conversions and softmax (which may widen, half_to_float), else the narrowest
    floating tensor in or out."""
    if name in _CONVERSIONS or name in ("_softmax", "_log_softmax"):
        floats = _float_dtypes(outs)
        return floats[0] if floats else None
    floats = _float_dtypes(ins) + _float_dtypes(outs)
    if not floats:
        return None
    def precision(d: torch.dtype) -> tuple[int, float]:  # bits, then mantissa (fp16 is finer than bf16)
        return torch.finfo(d).bits, -torch.finfo(d).eps

    widest = name in _NORM_KERNELS or name in _FUSED_ATTENTION
    return max(floats, key=precision) if widest else min(floats, key=precision)


class _Tracker:
    """Module stack (forward) and autograd-node ownership (backward) for one audited step."""

    def __init__(self, model: nn.Module):
        self.names = {m: (n or ROOT) for n, m in model.named_modules()}
        self.stack: list[nn.Module] = []
        self.boundaries: list[set] = []
        self.owner: dict = {}  # autograd Node -> module path
        self.owner_type: dict = {}
        self.handles = []
        for m in self.names:
            self.handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._post, with_kwargs=True, always_call=True))

    def _pre(self, module, args, kwargs):
        self.stack.append(module)
        self.boundaries.append({t.grad_fn for t in tree_leaves((args, kwargs))
                                if isinstance(t, torch.Tensor) and t.grad_fn is not None})

    def _post(self, module, args, kwargs, output):
        self.stack.pop()
        self.claim(output, self.names[module], type(module).__name__, self.boundaries.pop())

    def claim(self, output, path: str, type_name: str, boundary: set) -> None:
        """Attribute the graph nodes created since `boundary` (reached from `output`) to `path`: those no child
        module claimed; the walk goes on through a child's nodes to the module's own behind them (a module whose
        output passes through a child, `proj(softmax(x))`, left its softmax's backward to no module)."""
        todo = [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen = set()
        while todo:
            node = todo.pop()
            if node is None or node in boundary or node in seen:
                continue
            seen.add(node)
            if node not in self.owner:
                self.owner[node], self.owner_type[node] = path, type_name
            todo.extend(n for n, _ in node.next_functions)

    def current(self) -> tuple[str, str, nn.Module | None]:
        if not self.stack:
            return LOSS, "", None
        m = self.stack[-1]
        return self.names[m], type(m).__name__, m

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class _Recorder(TorchDispatchMode):
    def __init__(self, tracker: _Tracker):
        super().__init__()
        self.tracker = tracker
        self.records: list[OpRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        name = func.overloadpacket.__name__
        node = torch._C._current_autograd_node()
        if node is None:
            path, type_name, module = self.tracker.current()
            phase = "forward"
            state = current_autocast()
            fp8_context = isinstance(module, Fp8Linear) and state.enabled and not state.calibrating
        else:
            path = self.tracker.owner.get(node, BACKWARD)
            type_name = self.tracker.owner_type.get(node, "")
            phase = "backward"
            fp8_context = isinstance(node, (Fp8LinearFunction._backward_cls, Fp4LinearFunction._backward_cls))
        dtype = _compute_dtype(name, ins, outs)
        float8 = any(t.dtype.itemsize == 1 and t.is_floating_point() for t in ins + outs)
        is_fp8 = name in _GEMMS and (fp8_context or float8)
        self.records.append(OpRecord(
            module=path, module_type=type_name, phase=phase, op=str(func),
            in_dtypes=[str(t.dtype).replace("torch.", "") for t in ins],
            out_dtypes=[str(t.dtype).replace("torch.", "") for t in outs],
            precision="fp8" if is_fp8 else (str(dtype).replace("torch.", "") if dtype is not None else "-")))
        return out


def _narrower_than_fp32(precision: str) -> bool:
    if precision == "fp8":
        return True
    dtype = getattr(torch, precision, None)
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point and torch.finfo(dtype).bits < _FP32_BITS


def check(records: list[OpRecord], rules: AuditRules, head: str | None = None) -> list[Violation]:
    """The violations of `rules` among `records` (one per offending op)."""
    out = []
    stats = set(rules.norm_stat_ops)
    for r in records:
        name = _packet(r.op)
        namespace = r.op.split(".")[0]
        flag = lambda rule, why: out.append(Violation(rule, r.module, r.phase, r.op, r.precision, why))  # noqa: E731
        low = _narrower_than_fp32(r.precision)
        if rules.softmax_fp32 and name in _SOFTMAX_OPS and low:
            flag("softmax_fp32", f"{name} ran in {r.precision}; softmax / cross-entropy need fp32")
        if rules.softmax_fp32 and name in _EXP_OPS and low and r.precision != "fp8":
            flag("softmax_fp32", f"{name} ran in {r.precision}: a softmax or log-sum-exp written by hand needs fp32")
        if rules.norms_fp32 and low and (name in _NORM_KERNELS or (is_norm_type_name(r.module_type)
                                                                   and name in stats)):
            flag("norms_fp32", f"{name} in {r.module_type or 'a norm'} ran in {r.precision}; norms need fp32")
        if rules.embedding_not_fp8 and (name in _EMBEDDING_OPS or r.module_type in _EMBEDDING_TYPE_NAMES) and (
                r.precision == "fp8" or any(d.startswith("float8") for d in r.in_dtypes + r.out_dtypes)):
            flag("embedding_not_fp8", f"{name} ran in FP8; embeddings stay in high precision")
        if rules.collectives_fp32 and namespace in _COLLECTIVE_NAMESPACES and name in _COLLECTIVES and low:
            flag("collectives_fp32", f"{name} reduced {r.precision} tensors; gradient reductions need fp32")
        if (rules.head_not_fp8 and head is not None and r.precision == "fp8"
                and (r.module == head or r.module.startswith(head + "."))):
            flag("head_not_fp8", f"{name} of the output head {head!r} ran in FP8")
    return out


def _default_loss(output, batch) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    first = next(t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point())
    return first.float().mean()


def audit(model: nn.Module, batch, *, loss_fn: Callable | None = None,
          rules: AuditRules | None = None) -> AuditReport:
    """Run one forward + backward of `model` on `batch`, record every op's precision and check `rules`.

    Args:
        model: the model, converted and wrapped as it will train; run under the autocast contexts that the caller
            has entered (torch.autocast, mf.autocast).
        batch: a tensor (`model(batch)`), a tuple/list (`model(*batch)`) or a mapping (`model(**batch)`).
        loss_fn: `loss_fn(output, batch) -> scalar`; default: `output.loss` if present, else the mean of the first
            floating output.
    Returns:
        An AuditReport. Parameters' `.grad` and the model's buffers are left as they were.
    """
    rules = rules if rules is not None else AuditRules()
    if not isinstance(rules, AuditRules):
        raise ValueError(f"rules must be an AuditRules, got {rules!r}")
    loss_fn = loss_fn if loss_fn is not None else _default_loss
    tracker = _Tracker(model)
    recorder = _Recorder(tracker)
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        with eager_kernels(), restoring_buffers(model), recorder:
            output = call_model(model, batch)
            boundary = {t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor)}
            loss = loss_fn(output, batch)
            tracker.claim(loss, LOSS, "", boundary)
            if loss.requires_grad and params:
                # a training loop runs backward outside torch.autocast; inside it, the backward of fp32 ops
                # (the head, attention) would be recast to bf16 and misreported
                with autocast_off(params[0].device.type):
                    torch.autograd.grad(loss, params, allow_unused=True)  # leaves .grad untouched
            else:
                log.warning("minifloat.safety.audit: the loss needs no gradient; only the forward was audited")
    finally:
        tracker.remove()
    head = output_head(model, names=rules.head_names)
    return AuditReport(recorder.records, check(recorder.records, rules, head), head)
