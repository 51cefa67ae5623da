"""PrecisionPolicy: which dtype every part of training runs in, and `apply(model)` to make any nn.Module follow it.

A policy names the dtype of the parameters, matmuls (compute), optimizer weights and state, gradient reductions, an
optional FP8 recipe for the linear layers, and the float32 islands mixed-precision practice keeps (Micikevicius et
al., arXiv 1710.03740 §3; DeepSeek-V3, arXiv 2412.19437 §3.3): norms, softmax, cross-entropy, scores·V, embeddings
and the output head.

    policy = PrecisionPolicy.preset("fp8-delayed")
    policy.apply(model)                                    # cast, fp32 norms / embeddings / head, FP8 linears
    opt = policy.optimizer(torch.optim.AdamW, model, lr=3e-4)
    with policy.autocast("cpu"):
        loss = model(x)
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch
from rich.table import Table
from torch import nn

from minifloat.amp.islands import FLOAT_DTYPES, ISLAND_ATTR, inside, make_fp32_island
from minifloat.amp.lowp_weights import LowPrecisionWeightOptimizer
from minifloat.amp.master import MasterWeightOptimizer
from minifloat.amp.norms import LayerNorm, RMSNorm, swap_norms
from minifloat.core import roles
from minifloat.core.autocast import autocast_device
from minifloat.core.validate import check_bool, check_choice, check_module
from minifloat.fp8 import convert as convert_module
from minifloat.fp8.convert import Filter, check_filter, check_keep_blocks, check_no_other_recipe, convert, fp8_plan
from minifloat.fp8.modules import Fp8Linear
from minifloat.fp8.recipes import (BlockScaling, CurrentScaling, DelayedScaling, MXScaling, NVFP4Scaling, Recipe,
                                   check_recipe)
from minifloat.fp8.scaling import ScalingState
from minifloat.numerics.stateformats import StateFormat

log = logging.getLogger("minifloat")

# module types apply() can reach beyond the roles of minifloat.core.roles (norms, embeddings, the head); functional
# calls inside a forward() are out of its reach (see `describe`)
_SOFTMAX = (nn.Softmax, nn.LogSoftmax)
_LOSSES = (nn.CrossEntropyLoss, nn.NLLLoss)

_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
STATE_NAMES = tuple(f.value for f in StateFormat)

# master_weights modes: "none" (the optimizer updates the parameters), "fp32" (fp32 master copies), bf16 weights
# updated by stochastic rounding or with a Kahan compensation buffer (minifloat.amp.lowp_weights). True / False are
# read as "fp32" / "none".
MASTER_WEIGHTS = ("none", "fp32", "bf16-sr", "bf16-kahan")
_LOWP_UPDATES = {"bf16-sr": "stochastic", "bf16-kahan": "kahan"}
_MASTER_DESCRIPTIONS = {"none": "none (params are updated directly)", "fp32": "fp32",
                        "bf16-sr": "none: bf16 weights, stochastic rounding",
                        "bf16-kahan": "none: bf16 weights + bf16 Kahan compensation"}


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype each part of training runs in.

    Attributes:
        param_dtype: storage dtype of the parameters outside the fp32 islands.
        compute_dtype: dtype of the matmuls; bf16/fp16 with fp32 params means torch.autocast (`autocast()`).
            With low-precision params it must equal param_dtype (autocast cannot upcast).
        master_weights: how low-precision params keep small updates: "none" (False), "fp32" (True: float32 master
            copies; param_dtype bf16 or fp16), "bf16-sr" (stochastic rounding, no master copy) or "bf16-kahan" (a bf16
            compensation buffer); the bf16 modes need param_dtype bf16. Read it as `master_mode`.
        optimizer_state_dtype: how the optimizer state is stored. A torch.dtype: torch optimizers keep their state
            in the dtype of the weights they update, so the only dtype is that one (fp32 with master weights or fp32
            params, else param_dtype); None means that (see `state_dtype`). Or state formats, one per state of a
            minifloat.optim optimizer, stored per block with scales (minifloat.numerics.stateformats): "e4m3,bf16"
            or ("e4m3", "bf16") for AdamW's m and v, or one format for all, e.g. "int8-dynamic"; `optimizer()` then
            needs a minifloat.optim class. Read them as `state_formats`.
        recipe: FP8 (or 4-bit) recipe for the eligible nn.Linear layers, or None.
        keep_blocks: (first, last): with a recipe, the linear layers of the first `first` and last `last`
            transformer blocks stay in compute_dtype (minifloat.core.roles.transformer_blocks), as 4-bit training
            does (arXiv 2509.25149 §4.1: the first 2 and last 8 of 62 blocks in BF16). Each is a count (int) or a
            fraction of the blocks (float in [0, 1), rounded up): (0, 0.15) keeps the last 15%.
        fp32_norms: LayerNorm / RMSNorm / BatchNorm / GroupNorm / InstanceNorm compute in fp32 with fp32 weights and
            return their input's dtype.
        fp32_softmax: nn.Softmax / nn.LogSoftmax modules compute in fp32.
        fp32_cross_entropy: nn.CrossEntropyLoss / nn.NLLLoss modules compute in fp32 and return an fp32 loss.
        fp32_attention: attention scores and scores·V in fp32. Recorded for code that reads it (minifloat's model);
            apply() cannot reach a functional attention call inside an arbitrary forward(). Both implementations of
            minifloat.amp.attention satisfy it: "fp32" computes them in fp32 explicitly; "sdpa"'s fused kernels
            (FlashAttention-2, cuDNN, memory-efficient, CPU flash) keep the softmax's max and sum and the probs·V
            accumulation in fp32 and round only the output (the probabilities enter that GEMM as bf16 operands).
        fp32_embeddings: embedding tables stay fp32 (rare tokens get tiny sparse updates; their gradient sums many
            tokens) and return param_dtype.
        fp32_head: the output head keeps fp32 weights, runs in fp32 and returns fp32 logits (for the softmax and the
            cross-entropy over the vocabulary); it never goes FP8.
        reduce_dtype: dtype of gradient all-reduce / reduce-scatter (for DDP / FSDP wrappers that read it).
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    master_weights: bool | str = False
    optimizer_state_dtype: torch.dtype | str | tuple[str, ...] | None = None
    recipe: Recipe | None = None
    keep_blocks: tuple[int | float, int | float] = (0, 0)
    fp32_norms: bool = True
    fp32_softmax: bool = True
    fp32_cross_entropy: bool = True
    fp32_attention: bool = True
    fp32_embeddings: bool = True
    fp32_head: bool = True
    reduce_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "reduce_dtype"):
            check_choice(field, getattr(self, field), FLOAT_DTYPES)
        if self.param_dtype != torch.float32 and self.compute_dtype != self.param_dtype:
            raise ValueError(f"compute_dtype must equal param_dtype ({self.param_dtype}) when the parameters are "
                             f"low precision, got {self.compute_dtype!r}")
        if not isinstance(self.master_weights, (bool, str)) or (isinstance(self.master_weights, str)
                                                                and self.master_weights not in MASTER_WEIGHTS):
            raise ValueError(f"master_weights must be a bool or one of {list(MASTER_WEIGHTS)}, "
                             f"got {self.master_weights!r}")
        if self.master_mode != "none" and self.param_dtype == torch.float32:
            raise ValueError(f"master_weights={self.master_weights!r} needs param_dtype bfloat16 or float16 (float32 "
                             f"parameters are their own master), got param_dtype={self.param_dtype!r}")
        if self.master_mode in _LOWP_UPDATES and self.param_dtype != torch.bfloat16:
            raise ValueError(f"master_weights={self.master_weights!r} needs param_dtype bfloat16, "
                             f"got {self.param_dtype!r}")
        if self.state_formats is None and self.optimizer_state_dtype is not None \
                and self.optimizer_state_dtype != self._updated_dtype():
            raise ValueError(f"optimizer_state_dtype must be {self._updated_dtype()} (the dtype of the weights the "
                             f"optimizer updates), state formats such as 'e4m3,bf16' ({', '.join(STATE_NAMES)}) "
                             f"or None, got {self.optimizer_state_dtype!r}")
        if self.recipe is not None:
            check_recipe(self.recipe)
        check_keep_blocks(self.keep_blocks)
        for field in ("fp32_norms", "fp32_softmax", "fp32_cross_entropy", "fp32_attention", "fp32_embeddings",
                      "fp32_head"):
            check_bool(field, getattr(self, field))

    @property
    def master_mode(self) -> str:
        """`master_weights` as one of MASTER_WEIGHTS (True is "fp32", False "none")."""
        if isinstance(self.master_weights, bool):
            return "fp32" if self.master_weights else "none"
        return self.master_weights

    def _updated_dtype(self) -> torch.dtype:
        # every master mode updates fp32 values (masters, or the fp32 temporaries of the bf16 modes)
        return torch.float32 if self.master_mode != "none" else self.param_dtype

    @property
    def state_dtype(self) -> torch.dtype:
        """The dtype of the weights the optimizer updates, which is its state's dtype unless `state_formats` say
        how the state is stored."""
        return self._updated_dtype()

    @property
    def state_formats(self) -> tuple[str, ...] | None:
        """`optimizer_state_dtype` as state formats (one per optimizer state, or one for all), or None for a dtype;
        ValueError naming the known formats for an unknown one."""
        value = self.optimizer_state_dtype
        if value is None or isinstance(value, torch.dtype):
            return None
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (tuple, list)) or not items:
            raise ValueError(f"optimizer_state_dtype must be a torch.dtype, state formats ('e4m3,bf16' or a tuple) "
                             f"or None, got {value!r}")
        return tuple(StateFormat.parse(str(f).strip(), field="optimizer_state_dtype").value for f in items)

    @property
    def autocast_enabled(self) -> bool:
        return self.compute_dtype != torch.float32

    @classmethod
    def preset(cls, name: str) -> "PrecisionPolicy":
        """A named policy: "fp32", "bf16", "fp16", "fp8-delayed", "fp8-current", "fp8-block", "mxfp8", "nvfp4"
        or "mxfp4" (the 4-bit ones keep the last transformer block in bf16: `keep_blocks=(0, 1)`).

        Every preset keeps fp32 parameters (mixed precision through autocast) and all fp32 islands; derive other
        variants with dataclasses.replace, e.g. pure bf16 with master weights:
        `replace(preset("bf16"), param_dtype=torch.bfloat16, master_weights=True)`.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown precision preset {name!r}; known: {list(PRESETS)}")
        return PRESETS[name]

    def autocast(self, device_type: str = "cpu"):
        """torch.autocast in compute_dtype (disabled when compute_dtype is fp32), for the forward pass and loss. fp16
        also needs loss scaling (mf.LossScaler or torch.amp.GradScaler) around backward and the step."""
        return torch.autocast(autocast_device(device_type), dtype=self.compute_dtype, enabled=self.autocast_enabled)

    def optimizer(self, optimizer_cls: Callable[..., torch.optim.Optimizer], model: nn.Module,
                  **kwargs) -> torch.optim.Optimizer:
        """`optimizer_cls` over the model's parameters, behind the `master_weights` mode's wrapper (fp32 masters:
        MasterWeightOptimizer; bf16-sr / bf16-kahan: LowPrecisionWeightOptimizer, `seed` among kwargs)."""
        check_module("PrecisionPolicy.optimizer", model)  # the model, not its parameters: roles decide the states
        if isinstance(optimizer_cls, torch.optim.Optimizer) or not callable(optimizer_cls):
            raise TypeError(f"PrecisionPolicy.optimizer takes an optimizer class (e.g. torch.optim.AdamW) and builds "
                            f"it over the model's parameters, got an instance of {type(optimizer_cls).__name__}: pass "
                            f"the class and its options, policy.optimizer(torch.optim.AdamW, model, lr=...)")
        if self.state_formats is not None:
            # minifloat.optim's optimizers (BlockwiseOptimizer) name their states in STATES; optim is a layer above
            if not isinstance(getattr(optimizer_cls, "STATES", None), tuple):
                name = getattr(optimizer_cls, "__name__", repr(optimizer_cls))
                raise ValueError(f"optimizer_state_dtype={self.optimizer_state_dtype!r} stores states per block, which "
                                 f"{name} cannot: it keeps them in the weights' dtype. Use a minifloat.optim class "
                                 f"(AdamW, Adam, SGD, Lion)")
            kwargs.setdefault("state_formats", self.state_formats)
            kwargs.setdefault("model", model)  # norms and embeddings keep fp32 state
        if self.master_mode == "fp32":
            return MasterWeightOptimizer(optimizer_cls, model, **kwargs)
        if self.master_mode in _LOWP_UPDATES:
            return LowPrecisionWeightOptimizer(optimizer_cls, model, update=_LOWP_UPDATES[self.master_mode], **kwargs)
        return optimizer_cls(model.parameters(), **kwargs)

    def plan(self, model: nn.Module, *, head: str | None = "auto", filter: Filter | None = None) -> dict[str, str]:
        """What apply() does to each module, by name: "norm", "embedding", "head", "softmax", "loss" (fp32 islands),
        "fp8" (becomes Fp8Linear), "linear" (stays a linear layer in compute_dtype) — modules it leaves alone are
        absent. See `apply` for `head` and `filter`."""
        check_filter("minifloat.PrecisionPolicy", filter)
        head_name = _resolve_head(model, head) if self.fp32_head else None
        kinds = {}
        for name, m in model.named_modules():
            if isinstance(m, ScalingState):
                continue
            if name == head_name:
                kinds[name] = "head"
            elif self.fp32_norms and roles.is_norm(m):
                kinds[name] = "norm"
            elif self.fp32_embeddings and roles.is_embedding(m):
                kinds[name] = "embedding"
            elif self.fp32_softmax and isinstance(m, _SOFTMAX):
                kinds[name] = "softmax"
            elif self.fp32_cross_entropy and isinstance(m, _LOSSES):
                kinds[name] = "loss"
            if isinstance(m, nn.Linear):
                kinds.setdefault(name, "fp8" if isinstance(m, Fp8Linear) else "linear")
        if self.recipe is not None:  # mf.convert's own rule: first and last layers (and blocks) kept, features % 16
            for name in fp8_plan(model, filter=filter, keep_blocks=self.keep_blocks).convert:
                if kinds[name] == "linear":  # not an island
                    kinds[name] = "fp8"
        return kinds

    def apply(self, model: nn.Module, *, head: str | None = "auto", filter: Filter | None = None) -> nn.Module:
        """Make `model` (any nn.Module) follow this policy, in place. Call it before building the optimizer.

        1. torch.nn.LayerNorm / RMSNorm become minifloat.amp.norms twins (fp32 compute); other norms, the embeddings,
           the head (roles as minifloat.core.roles defines them), nn.Softmax / LogSoftmax and nn.CrossEntropyLoss /
           NLLLoss become fp32 islands (a wrapped forward that upcasts the inputs, switches autocast off and casts
           the output back), each as its field says.
        2. Parameters and floating-point buffers of the islands become fp32, all others param_dtype (FP8 scaling
           state stays fp32).
        3. With a recipe, the nn.Linear layers mf.convert would convert (`fp8_plan`: input projections and output
           head kept, features multiples of 16) become Fp8Linear, islands excluded.

        Args:
            model: any nn.Module.
            head: the output head's module name; "auto" takes minifloat.core.roles.output_head (a linear named
                lm_head, classifier, score, head or output, else one tied to an embedding, else the last linear
                outside a pooler); None means no head.
            filter: with a recipe, `filter(name, linear) -> bool` as mf.convert takes it (mf.where_fp8_pays: only
                where FP8 is predicted to be faster); the layers it refuses stay in compute_dtype.
        Returns:
            The model (a new module if `model` itself is a torch.nn.LayerNorm / RMSNorm).
        """
        check_module("PrecisionPolicy.apply", model)
        if self.fp32_norms:
            model = swap_norms(model)
        kinds = self.plan(model, head=head, filter=filter)
        check_no_other_recipe("minifloat.PrecisionPolicy.apply", model, self.recipe, lambda *_: True)  # all FP8
        islands = {name for name, kind in kinds.items() if kind not in ("fp8", "linear")}
        for name, m in model.named_modules():
            if isinstance(m, ScalingState):
                continue
            dtype = torch.float32 if inside(name, islands) else self.param_dtype
            # non-persistent buffers are derived constants (HF's RoPE inv_freq: in bf16 its phases drift by 0.7 rad
            # at position 4096), not state: they keep their dtype
            buffers = [b for n, b in m.named_buffers(recurse=False) if n not in m._non_persistent_buffers_set]
            for t in list(m.parameters(recurse=False)) + buffers:
                if t.is_floating_point() and t.dtype != dtype:
                    t.data = t.data.to(dtype)
                    if t.grad is not None:
                        t.grad = t.grad.to(dtype)
        if self.recipe is not None:
            fp8 = {name for name, kind in kinds.items() if kind == "fp8"}
            if fp8:
                convert(model, recipe=self.recipe, filter=lambda name, _: name in fp8, keep_first_last=False)
            else:  # in the policy's own terms (convert would blame its `filter`, which the user never wrote)
                log.warning("minifloat.PrecisionPolicy: no linear layer runs in %s, %s", type(self.recipe).__name__,
                            self._why_no_fp8(model, kinds, filter))
        out_dtypes = {"embedding": self.param_dtype, "head": torch.float32, "loss": torch.float32}
        for name in islands:
            m = model.get_submodule(name)
            if not isinstance(m, (LayerNorm, RMSNorm)) and not hasattr(m, ISLAND_ATTR):  # apply() twice: one hook
                make_fp32_island(m, out_dtypes.get(kinds[name]))
            setattr(m, ISLAND_ATTR, kinds[name])
        return model

    def _why_no_fp8(self, model: nn.Module, kinds: dict[str, str], filter: Filter | None) -> str:
        """Why `apply` converts none of `model`'s linear layers, for its one warning line."""
        linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        if not linears:
            return f"the {type(model).__name__} has no nn.Linear layer"
        plan = fp8_plan(model, keep_blocks=self.keep_blocks)
        refused = [name for name in plan.convert if kinds.get(name) == "linear"] if filter is not None else []
        blocks = f" or in the blocks keep_blocks={tuple(self.keep_blocks)} keeps" if any(self.keep_blocks) else ""
        reasons = [f"{len(plan.kept)} kept as input projection or output head{blocks}"] if plan.kept else []
        if plan.misshapen:
            reasons.append(f"{len(plan.misshapen)} with features that are not multiples of 16")
        islands = [name for name in linears if kinds.get(name) not in ("fp8", "linear") and name not in plan.kept]
        if islands:
            reasons.append(f"{len(islands)} kept in fp32 as {'/'.join(sorted({kinds[n] for n in islands}))}")
        if refused:  # a WhereFp8Pays says what it predicts; a plain function is just "filter"
            said = str(filter) if type(filter).__str__ is not object.__str__ else "`filter`"
            reasons.append(f"{len(refused)} refused by {said}")
        return f"all {len(linears)} of the {type(model).__name__}'s nn.Linear layers stay in high precision: " + \
            "; ".join(reasons) + convert_module.other_projections(model)

    def describe(self, model: nn.Module | None = None, *, head: str | None = "auto") -> Table:
        """A rich Table of what runs in which dtype: the policy's settings, or (given a model) each module apply()
        acts on, with its parameter dtype, compute dtype and output dtype. Print it with rich.console.Console."""
        c = _NAMES[self.compute_dtype]
        if model is None:
            table = Table("part", "dtype", title="PrecisionPolicy")
            fp8 = type(self.recipe).__name__ if self.recipe is not None else "off"
            fp8 += f", blocks kept: first {self.keep_blocks[0]}, last {self.keep_blocks[1]}" if any(self.keep_blocks) \
                else ""
            for part, value in [
                ("parameters", _NAMES[self.param_dtype]),
                ("matmuls (compute)", c + (" (torch.autocast)" if self.autocast_enabled else "")),
                ("FP8 linear GEMMs", fp8),
                ("master weights", _MASTER_DESCRIPTIONS[self.master_mode]),
                ("optimizer state", ",".join(self.state_formats) + " (per block)" if self.state_formats
                 else _NAMES[self.state_dtype]),
                ("norms", "fp32 compute, fp32 weights" if self.fp32_norms else c),
                ("softmax", "fp32" if self.fp32_softmax else c),
                ("cross-entropy", "fp32" if self.fp32_cross_entropy else c),
                ("attention scores·V", "fp32 (model code reads it; SDPA: fp32 inside its kernel)"
                 if self.fp32_attention else c),
                ("embeddings", "fp32 weights" if self.fp32_embeddings else _NAMES[self.param_dtype]),
                ("output head", "fp32 weights, compute and logits" if self.fp32_head else c),
                ("gradient reduction", _NAMES[self.reduce_dtype]),
            ]:
                table.add_row(part, value)
            return table
        table = Table("module", "type", "params", "compute", "output", title="PrecisionPolicy on model",
                      caption="functional ops inside forward() run under torch.autocast rules")
        p = _NAMES[self.param_dtype]
        recipe = type(self.recipe).__name__ if self.recipe is not None else ""
        rows = {
            "norm": ("fp32", "fp32", "input dtype"),
            "embedding": ("fp32", "lookup", p),
            "head": ("fp32", "fp32", "fp32"),
            "softmax": ("-", "fp32", "input dtype"),
            "loss": ("-", "fp32", "fp32"),
            "fp8": (p, f"fp8 ({recipe})", c),
            "linear": (p, c, c),
        }
        for name, kind in self.plan(model, head=head).items():
            table.add_row(name or "(root)", type(model.get_submodule(name)).__name__, *rows[kind])
        return table


def _resolve_head(model: nn.Module, head: str | None) -> str | None:
    """apply()'s `head` argument as a module name: "auto" asks minifloat.core.roles.output_head."""
    if head is None:
        return None
    if head == "auto":
        return roles.output_head(model)
    try:
        model.get_submodule(head)
    except AttributeError:
        raise ValueError(f"head must name a submodule of the model, got {head!r}") from None
    return head


PRESETS: dict[str, PrecisionPolicy] = {
    "fp32": PrecisionPolicy(),
    "bf16": PrecisionPolicy(compute_dtype=torch.bfloat16),
    "fp16": PrecisionPolicy(compute_dtype=torch.float16),
    "fp8-delayed": PrecisionPolicy(compute_dtype=torch.bfloat16, recipe=DelayedScaling()),
    "fp8-current": PrecisionPolicy(compute_dtype=torch.bfloat16, recipe=CurrentScaling()),
    "fp8-block": PrecisionPolicy(compute_dtype=torch.bfloat16, recipe=BlockScaling()),
    "mxfp8": PrecisionPolicy(compute_dtype=torch.bfloat16, recipe=MXScaling()),
    # 4-bit: one block in six kept (the 10.7M Llama), close to NVIDIA's 16% (arXiv 2509.25149 §4.1)
    "nvfp4": PrecisionPolicy(compute_dtype=torch.bfloat16, recipe=NVFP4Scaling(), keep_blocks=(0, 1)),
    "mxfp4": PrecisionPolicy(compute_dtype=torch.bfloat16, recipe=MXScaling(format="e2m1"), keep_blocks=(0, 1)),
}
