"""Which layers run in FP8: `convert(model, ...)` swaps eligible nn.Linear layers for Fp8Linear.

A layer is eligible when it is an nn.Linear (not yet an Fp8Linear), `filter` accepts it, `keep_first_last` does not
keep it, and its features are multiples of 16 (minifloat.core.roles.fp8_shape_ok). `keep_first_last` keeps the
layers nearest the data and the output, found by role (minifloat.core.roles), not by module order: the input
projections (a transformer's first q/k/v projections together, an MLP's first layer) and the output head (lm_head,
classifier, score, a linear tied to an embedding, else the last linear outside a pooler). `fp8_plan` says what
`convert` will do; `PrecisionPolicy` plans with it too. `keep_blocks=(first, last)` also keeps every linear layer of
the first and last transformer blocks (minifloat.core.roles.transformer_blocks), as 4-bit training does (arXiv
2509.25149 §4.1 kept the first 2 and last 8 of 62 blocks in BF16).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch
from torch import nn
from torch.nn.utils import parametrize

from minifloat.core import roles
from minifloat.core.roles import MIN_DIM_MULTIPLE
from minifloat.core.validate import check_bool, check_choice, check_module
from minifloat.fp8.experts import Fp8Experts, convert_experts, experts_reason
from minifloat.fp8.gemm import BACKENDS
from minifloat.fp8.modules import Fp8Linear
from minifloat.fp8.recipes import DelayedScaling, Recipe, check_recipe

log = logging.getLogger("minifloat")


@dataclasses.dataclass(frozen=True)
class Fp8Plan:
    """What `convert` does to a model's nn.Linear layers, by name, in module order.

    Attributes:
        convert: layers that become Fp8Linear.
        kept: layers `keep_first_last` (input projections and output head) or `keep_blocks` keeps in high precision.
        misshapen: layers left in high precision because their features are not multiples of 16.
        own_forward: nn.Linear subclasses with a forward of their own (MoE routers returning a tuple, ...), left as
            they are: an Fp8Linear would replace that forward by a plain linear's.
        stacked: modules holding stacked matmul weights (MoE experts' 3-D parameters, minifloat.core.roles.
            stacked_weights) that stay in high precision (minifloat.fp8.experts.experts_reason says why).
        unsupported: (name, reason) of the layers an Fp8Linear cannot stand in for, left as they are
            (`unsupported_reason`): a weight computed by a parametrization, weight norm or pruning; a float64
            weight; state of an nn.Linear subclass's own; nn.MultiheadAttention's out_proj.
        adapters: adapter layers (PEFT's LoRA lora_A / lora_B beside a `base_layer`, minifloat.core.roles.
            adapter_linears), kept in high precision whatever `filter` says: low-rank GEMMs FP8 cannot speed up,
            whose weights are the ones being trained.
    """

    convert: tuple[str, ...]
    kept: tuple[str, ...]
    misshapen: tuple[str, ...]
    own_forward: tuple[str, ...] = ()
    stacked: tuple[str, ...] = ()
    unsupported: tuple[tuple[str, str], ...] = ()
    adapters: tuple[str, ...] = ()
    experts: tuple[str, ...] = ()  # transformers experts modules convert runs in FP8 (minifloat.fp8.experts)


Filter = Callable[[str, nn.Linear], bool]  # filter(name, linear) -> bool: convert the layer?


def check_filter(caller: str, filter) -> None:
    """TypeError naming `caller` unless `filter` is None or callable."""
    if filter is not None and not callable(filter):
        raise TypeError(f"{caller}: filter must be a function (name, linear) -> bool, such as mf.where_fp8_pays(...), "
                        f"got {type(filter).__name__}")


KEEP_BLOCKS_RULE = "each a block count (int >= 0) or a fraction of the blocks (float in [0, 1))"


def check_keep_blocks(keep_blocks) -> tuple[int | float, int | float]:
    """`keep_blocks` as (first, last), each a count of blocks (int >= 0) or a fraction of them (float in [0, 1),
    rounded up to whole blocks by `minifloat.core.roles.linears_in_blocks`); ValueError naming the field otherwise."""
    def ok(v) -> bool:
        if isinstance(v, bool):
            return False
        return (isinstance(v, int) and v >= 0) or (isinstance(v, float) and 0.0 <= v < 1.0)

    if not isinstance(keep_blocks, (tuple, list)) or len(keep_blocks) != 2 or not all(ok(v) for v in keep_blocks):
        raise ValueError(f"keep_blocks must be (first, last), {KEEP_BLOCKS_RULE}, got {keep_blocks!r}")
    return tuple(keep_blocks)


def fp8_plan(model: nn.Module, *, filter: Filter | None = None,
             keep_first_last: bool = True, keep_blocks: tuple[int, int] = (0, 0)) -> Fp8Plan:
    """What `convert(model, filter=filter, keep_first_last=..., keep_blocks=...)` would do, without doing it.

    Layers that are already Fp8Linear, and those `filter` refuses, appear in none of the lists.
    """
    first_last = roles.first_and_last(model) if keep_first_last else set()
    first_last |= roles.linears_in_blocks(model, *check_keep_blocks(keep_blocks))
    first_last_blocks = tuple(f"{b}." for b in roles.kept_blocks(model, *check_keep_blocks(keep_blocks)))
    convert_, kept, misshapen, own, unsupported, adapters = [], [], [], [], [], []
    read_directly, adapter_names = _read_directly(model), roles.adapter_linears(model)
    for name, lin in roles.named_linears(model):
        if isinstance(lin, Fp8Linear):
            continue
        if name in adapter_names:
            adapters.append(name)
        elif type(lin).forward is not nn.Linear.forward:
            own.append(name)
        elif name in first_last:
            kept.append(name)
        elif accepts(filter, name, lin):
            reason = read_directly.get(id(lin)) or unsupported_reason(lin)
            if reason:
                unsupported.append((name, reason))
            else:
                (convert_ if roles.fp8_shape_ok(lin) else misshapen).append(name)
    experts, stacked = _plan_experts(model, filter, first_last_blocks)
    return Fp8Plan(tuple(convert_), tuple(kept), tuple(misshapen), tuple(own), stacked, tuple(unsupported),
                   tuple(adapters), experts)


def _plan_experts(model: nn.Module, filter: Filter | None,
                  kept_blocks: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the stacked-experts modules convert runs in FP8, the other modules with stacked weights). `filter` sees the
    experts module itself; one that reads an nn.Linear's attributes off it (AttributeError) keeps it."""
    experts, stacked = [], []
    for name in roles.stacked_weights(model):
        module = model.get_submodule(name)
        if isinstance(module, Fp8Experts):
            continue
        try:
            wanted = not name.startswith(kept_blocks) and accepts(filter, name, module)
        except AttributeError:
            wanted = False
        (experts if wanted and experts_reason(module) is None else stacked).append(name)
    return tuple(experts), tuple(stacked)


_LINEAR_STATE = {"weight", "bias"}


def unsupported_reason(linear: nn.Linear) -> str:
    """Why an Fp8Linear cannot stand in for `linear` (which runs nn.Linear's forward), or "" when it can."""
    if parametrize.is_parametrized(linear) or not isinstance(linear._parameters.get("weight"),
                                                                            nn.Parameter):
        return "its weight is computed (a parametrization, weight norm, spectral norm or pruning)"
    if linear.weight.dtype == torch.float64:
        return "float64 weight (FP8 GEMMs give bfloat16, float16 or float32)"
    extra = ({n for n, _ in linear.named_parameters(recurse=False)} | {n for n, _ in linear.named_buffers(
        recurse=False)}) - _LINEAR_STATE
    if extra or any(True for _ in linear.children()):
        return f"{type(linear).__name__} holds state of its own ({', '.join(sorted(extra)) or 'submodules'})"
    return ""


def _read_directly(model: nn.Module) -> dict[int, str]:
    """{id(linear): reason} for linears whose weight their parent reads itself instead of calling them."""
    return {id(m.out_proj): "nn.MultiheadAttention reads its out_proj's weight itself"
            for m in model.modules() if isinstance(m, nn.MultiheadAttention)}


def replace_module(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Put `new` wherever `model` holds `old` (a module registered under two names is replaced under both), with
    `old`'s forward, backward and state-dict hooks (the same hook dicts, so their handles still remove them; a
    module shared with another model then shares its later hooks too)."""
    for attr in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks",
                 "_is_full_backward_hook", "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                 "_load_state_dict_post_hooks"):
        if hasattr(old, attr):
            setattr(new, attr, getattr(old, attr))
    for parent in model.modules():
        for child, module in list(parent._modules.items()):
            if module is old:
                parent._modules[child] = new


def accepts(filter: Filter | None, name: str, layer: nn.Module) -> bool:
    """filter(name, layer), which must be a bool (a truthy "no" converted a layer; a tensor raised torch's error)."""
    if filter is None:
        return True
    verdict = filter(name, layer)
    if not isinstance(verdict, bool):
        raise TypeError(f"filter(name, layer) must return a bool (True: convert the layer), got a "
                        f"{type(verdict).__name__} for {name!r}")
    return verdict


def convert(model: nn.Module, *, recipe: Recipe | None = None,
            filter: Filter | None = None, keep_first_last: bool = True,
            keep_blocks: tuple[int, int] = (0, 0), backend: str | None = None) -> nn.Module:
    """Replace the nn.Linear layers of `model` (in place) by Fp8Linear layers sharing their parameters.

    Use the return value, as with torch's `convert_*` helpers: `model = mf.convert(model, ...)`. It is `model`
    itself, except when `model` is an nn.Linear, which cannot be replaced in place: then it is the new Fp8Linear.

    Args:
        model: any nn.Module (HF transformers models included), or a single nn.Linear.
        recipe: the FP8 recipe (default DelayedScaling()).
        filter: `filter(name, linear) -> bool`; only layers it accepts are converted. `mf.where_fp8_pays(recipe,
            tokens=...)` accepts those FP8 is predicted to make faster (minifloat.fp8.payoff).
        keep_first_last: keep the layers nearest the data and the output in high precision, as mixed-precision
            practice advises: the input projections (all of a transformer's first q/k/v projections, an MLP's
            first layer) and the output head, recognised by role (see the module docstring). A lone nn.Linear is
            both, so it is kept unless this is False.
        keep_blocks: (first, last): also keep every linear layer of the model's first `first` and last `last`
            transformer blocks in high precision (none without such blocks).
        backend: GEMM backend for the converted layers.
    Returns:
        The converted model (see above). Layers whose in/out features are not multiples of 16 (what FP8 tensor
        cores accept) stay in high precision; one warning lists them. When no layer of the model runs in FP8
        afterwards, one warning says why instead.
    """
    check_module("convert", model)
    check_filter("minifloat.convert", filter)
    check_bool("keep_first_last", keep_first_last)
    if backend is not None:
        check_choice("backend", backend, BACKENDS)  # before any layer is built, so even when none would be
    recipe = check_recipe(recipe if recipe is not None else DelayedScaling())
    first_last = roles.first_and_last(model) if keep_first_last else set()
    first_last |= roles.linears_in_blocks(model, *check_keep_blocks(keep_blocks))
    check_no_other_recipe("minifloat.convert", model, recipe,
                          lambda name, layer: name not in first_last and accepts(filter, name, layer))
    plan = fp8_plan(model, filter=filter, keep_first_last=keep_first_last, keep_blocks=keep_blocks)
    root = model
    layers = [(name, model.get_submodule(name)) for name in plan.convert]  # every one found before any is replaced
    for name, lin in layers:
        fp8 = Fp8Linear.from_linear(lin, recipe=recipe, backend=backend, name=name)
        if not name:  # the model is the linear layer itself: nothing holds it, so the new layer is returned
            root = fp8
            replace_module(nn.Module(), lin, fp8)  # its hooks
            continue
        replace_module(model, lin, fp8)
    stacked = plan.stacked
    if recipe.four_bit:  # 4-bit training runs nn.Linear layers only
        stacked, experts = plan.stacked + plan.experts, ()
    else:
        experts = plan.experts
    for name in experts:
        convert_experts(model.get_submodule(name), recipe=recipe, backend=backend, name=name)
    if experts:
        log.info("minifloat.convert: %d MoE experts module(s) compute their experts in FP8: %s", len(experts),
                 _listed(model, experts))
    if not getattr(root, "_minifloat_orphans_hook", False):
        root.register_load_state_dict_pre_hook(_drop_orphaned_state)
        root._minifloat_orphans_hook = True
    if not fp8_layers(root) and not experts:
        log.warning("minifloat.convert: converted nothing, %s", _nothing_converted(model, plan, filter))
    elif plan.misshapen:
        log.warning("minifloat.convert: kept %d layer(s) in high precision, their features are not multiples of "
                    "%d: %s", len(plan.misshapen), MIN_DIM_MULTIPLE, _listed(model, plan.misshapen, sizes=True))
    if plan.own_forward:
        log.warning("minifloat.convert: kept %d nn.Linear subclass(es) with a forward of their own as they are (an "
                    "Fp8Linear would replace it): %s", len(plan.own_forward), _listed(model, plan.own_forward))
    if stacked:
        log.warning("minifloat.convert: %s", stacked_note(model, stacked, recipe))
    if plan.adapters:
        log.info("minifloat.convert: kept %d adapter layer(s) in high precision (low-rank and trained): %s",
                 len(plan.adapters), _listed(model, plan.adapters))
    if plan.unsupported:
        log.warning("minifloat.convert: %s", unsupported_note(plan.unsupported))
    fused = [f"{n}." for n, m in model.named_modules() if isinstance(m, nn.TransformerEncoderLayer)]
    if any(name.startswith(tuple(fused)) for name in plan.convert):
        log.warning("minifloat.convert: torch's nn.TransformerEncoderLayer has a fused fast path for evaluation "
                    "(eval(), no grad, no torch.autocast) that reads its linear1/linear2 weights itself, in high "
                    "precision: evaluate under torch.autocast to run them in FP8 as in training")
    return root


def _drop_orphaned_state(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """A load's pre-hook (convert registers it on the model): the FP8 scaling state a checkpoint holds for layers
    this model keeps in high precision (an earlier minifloat converted them, e.g. nn.MultiheadAttention's out_proj,
    or a decoder's last block under keep_blocks) is left out, with one warning, instead of failing a strict load."""
    modules = dict(module.named_modules())
    orphans = [key for key in state_dict if key.startswith(prefix) and ".fp8_state." in key
               and not isinstance(modules.get(key[len(prefix):].partition(".fp8_state.")[0]), (Fp8Linear, Fp8Experts))]
    for key in orphans:
        del state_dict[key]
    if orphans:
        layers = sorted({key[len(prefix):].partition(".fp8_state.")[0] for key in orphans})
        log.warning("minifloat: the state dict holds FP8 scaling state for %d layer(s) this model keeps in high "
                    "precision (converted by another minifloat or recipe), left out: %s", len(layers),
                    ", ".join(layers[:MAX_LISTED]) + (", ..." if len(layers) > MAX_LISTED else ""))


def unsupported_note(unsupported: tuple[tuple[str, str], ...]) -> str:
    """One line naming the layers an Fp8Linear cannot stand in for, with why."""
    return (f"kept {len(unsupported)} nn.Linear layer(s) as they are, which an Fp8Linear cannot stand in for: "
            f"{_reasons(unsupported)}")


def _reasons(unsupported: tuple[tuple[str, str], ...]) -> str:
    shown = "; ".join(f"{name or 'the model itself'} ({reason})" for name, reason in unsupported[:MAX_LISTED])
    return shown + (f"; ... ({len(unsupported)} in all)" if len(unsupported) > MAX_LISTED else "")


def stacked_note(model: nn.Module, stacked: tuple[str, ...], recipe: Recipe | None = None) -> str:
    """One line saying that `stacked` (modules with stacked matmul weights: MoE experts) stay in high precision, why
    (for convert, under `recipe`; None: FP8 inference, which runs nn.Linear layers only), and what share of the
    model's parameters they hold."""
    found = roles.stacked_weights(model)
    shown = []
    for name in stacked[:MAX_LISTED]:
        shapes = ", ".join(f"{p} {'x'.join(map(str, shape))}" for p, shape in found[name])
        why = experts_reason(model.get_submodule(name), recipe) if recipe is not None else None
        shown.append(f"{name or 'the model itself'} ({shapes}{f': {why}' if why else ''})")
    held = sum(model.get_submodule(n).get_parameter(p).numel() for n in stacked for p, _ in found[n])
    total = sum(p.numel() for p in model.parameters()) or 1
    more = f", ... ({len(stacked)} in all)" if len(stacked) > MAX_LISTED else ""
    where = ("FP8 inference runs nn.Linear layers only, and transformers' experts modules with dynamic activations"
             if recipe is None else "FP8 runs transformers' experts modules and nn.Linear layers only")
    return (f"{len(stacked)} module(s) multiply stacked weights of their own (MoE experts held as 3-D parameters), "
            f"which {where}: they stay in high precision, {100 * held / total:.0f}% of the model's parameters: "
            f"{', '.join(shown)}{more}")


MAX_LISTED = 4  # layers a warning names before "..."


def check_no_other_recipe(caller: str, model: nn.Module, recipe: Recipe | None,
                          wanted: Callable[[str, nn.Linear], bool]) -> None:
    """ValueError if Fp8Linear layers of `model` that `wanted(name, layer)` would put under `recipe` (None: no FP8)
    already run another recipe: converting does not touch them, so they would silently keep it."""
    others = [(name, m) for name, m in model.named_modules()
              if isinstance(m, Fp8Linear) and m.recipe != recipe and wanted(name, m)]
    if not others:
        return
    old = sorted({type(m.recipe).__name__ for _, m in others})
    names = ", ".join(repr(name) for name, _ in others[:MAX_LISTED]) + (", ..." if len(others) > MAX_LISTED else "")
    result = (f"converted layers are left as they are, so they would not run {type(recipe).__name__}"
              f"({_fields(recipe)})" if recipe is not None else
              "this policy has no FP8 recipe, but converted layers are left as they are, so they would stay in FP8")
    raise ValueError(f"{caller}: {len(others)} layer(s) are already Fp8Linear under {'/'.join(old)} ({names}); "
                     f"{result}. Start from the model before its FP8 conversion (rebuild it, or load its weights "
                     f"into a fresh one)")


def _fields(recipe: Recipe) -> str:
    """The fields where `recipe` differs from its class's defaults, as `name=value`."""
    default = type(recipe)()
    return ", ".join(f"{f.name}={getattr(recipe, f.name)!r}" for f in dataclasses.fields(recipe)
                     if getattr(recipe, f.name) != getattr(default, f.name))


def _listed(model: nn.Module, names: tuple[str, ...], *, sizes: bool = False) -> str:
    """Up to MAX_LISTED layer names, with (in->out) features when `sizes`; "" names the model itself."""
    shown = []
    for name in names[:MAX_LISTED]:
        layer = model.get_submodule(name)
        shown.append((name or "the model itself") + (f" ({layer.in_features}->{layer.out_features})" if sizes else ""))
    return ", ".join(shown) + (f", ... ({len(names)} in all)" if len(names) > MAX_LISTED else "")


def _nothing_converted(model: nn.Module, plan: Fp8Plan, filter) -> str:
    """Why `plan` leaves every layer of `model` in high precision, for convert's one warning line."""
    linears = roles.named_linears(model)
    if not linears:
        return f"the {type(model).__name__} has no nn.Linear layer (the only kind convert runs in FP8)" + \
            other_projections(model)
    reasons = []
    if plan.kept:
        reasons.append(f"{len(plan.kept)} kept as input projection or output head (keep_first_last=True) or in a "
                       f"kept block (keep_blocks): {_listed(model, plan.kept)}")
    if plan.misshapen:
        reasons.append(f"{len(plan.misshapen)} with features that are not multiples of {MIN_DIM_MULTIPLE}: "
                       f"{_listed(model, plan.misshapen, sizes=True)}")
    if plan.own_forward:
        reasons.append(f"{len(plan.own_forward)} nn.Linear subclass(es) with a forward of their own: "
                       f"{_listed(model, plan.own_forward)}")
    if plan.unsupported:
        reasons.append(f"{len(plan.unsupported)} that an Fp8Linear cannot stand in for: "
                       f"{_reasons(plan.unsupported)}")
    refused = len(linears) - len(plan.kept) - len(plan.misshapen) - len(plan.own_forward) - len(plan.unsupported)
    if refused and filter is not None:
        reasons.append(f"{refused} refused by `filter`")
    return f"every nn.Linear of the {type(model).__name__} stays in high precision: " + "; ".join(reasons) + \
        other_projections(model)


def other_projections(model: nn.Module) -> str:
    """", and N layers of another kind ..." when the model's projections are not nn.Linear (GPT-2's transformers
    Conv1D): the real reason nothing converts, which the nn.Linear count alone hides."""
    other = [name for name, m in model.named_modules() if type(m).__name__ == "Conv1D" and hasattr(m, "nf")]
    return (f"; and its {len(other)} transformers Conv1D projection(s) ({other[0]}, ...) are not nn.Linear, the only "
            f"kind convert runs in FP8" if other else "")


def fp8_layers(model: nn.Module) -> list[Fp8Linear]:
    """The model's Fp8Linear layers, in module order."""
    return [m for m in model.modules() if isinstance(m, Fp8Linear)]
