"""Precision: a run's precision settings (preset, recipe overrides, kept blocks, master weights), and the policy
and recipe they make."""

from __future__ import annotations

import dataclasses

import torch

from minifloat.amp.policy import PRESETS, PrecisionPolicy
from minifloat.fp8.convert import KEEP_BLOCKS_RULE, check_keep_blocks
from minifloat.fp8.payoff import DEFAULT_GPU, GPUS, WhereFp8Pays, where_fp8_pays
from minifloat.fp8.recipes import NVFP4Scaling
from minifloat.core.validate import check_choice, check_number
from minifloat.training.model import ATTENTIONS
from minifloat.training.optimizer import MASTER_HELP, MASTER_UPDATES, master_policy
from minifloat.training.settings import setting, setting_group

# Precision's NVFP4 overrides and the NVFP4Scaling field each replaces
NVFP4_OVERRIDES = {"nvfp4_weight_2d": "weight_2d", "nvfp4_rht": "rht",
                   "nvfp4_stochastic_rounding": "stochastic_rounding"}
FP8_LAYERS = ("all", "auto", *GPUS)  # fp8_layers: every eligible layer, or where FP8 pays on that GPU
FP8_OVERRIDES = {"fp8_format": "format", "fp8_amax_history_len": "amax_history_len", "fp8_margin": "margin"}


@setting_group("precision")
class Precision:
    """How the run computes: a preset, the overrides of its recipe, the blocks kept in BF16 and the master weights.
    `policy()` is the PrecisionPolicy they make, `recipe` its low-precision recipe (None for bf16 and fp32)."""

    preset: str = setting("bf16", "precision preset: " + ", ".join(PRESETS))
    attention: str = setting(
        "auto", "how attention computes softmax(QKᵀ/√d)·V: sdpa (torch's scaled_dot_product_attention: flash or "
                "cuDNN kernels that keep the softmax and the accumulation in fp32 inside, never storing the T×T "
                "scores), fp32 (explicit fp32 scores, softmax and scores·V) or auto (sdpa on CUDA, fp32 elsewhere)",
        choices=ATTENTIONS)
    fp8_format: str | None = setting(
        None, "FP8 formats of the delayed recipe: hybrid (E4M3 forward, E5M2 gradients) or e4m3 (needs "
              "fp8-delayed; default: the preset's)", resume="fixed",
        why="changes the FP8 formats the scaling state was built for", choices=("hybrid", "e4m3"))
    fp8_amax_history_len: int | None = setting(
        None, "steps of amax history of the delayed recipe (needs fp8-delayed)", resume="fixed",
        why="changes the shape of the FP8 amax histories", metavar="N")
    fp8_margin: int | None = setting(None, "scale = fp8_max / amax / 2^N: N bits of headroom (needs fp8-delayed)",
                                     resume="fixed", why="changes the FP8 scales", metavar="N")
    master: str = setting(
        "fp32", "how the weights outside the fp32 norms, embeddings and head keep small updates: "
                + "; ".join(f"{mode}: {text}" for mode, text in MASTER_HELP.items())
                + ". The bf16 modes halve the gradients too, need a bf16-computing preset and --nproc 1",
        resume="fixed", why="changes the weights' dtype and how updates reach them", absent="fp32", metavar="MODE")
    bf16_tail: float = setting(
        0.0, "run the FP8/FP4 layers in BF16 for the last fraction F of --steps (NVIDIA's late switch for NVFP4; "
             "needs an fp8 or fp4 preset)", resume="fixed", why="changes which steps run in BF16", absent=0.0,
        metavar="F")
    nvfp4_weight_2d: bool | None = setting(
        None, "16×16 weight tiles, so that dgrad's Wᵀ holds the forward's numbers: on (the nvfp4 preset's default) "
              "or off, for ablations (needs --preset nvfp4)", resume="fixed",
        why="changes how the NVFP4 weights are quantized", absent=None, on_off=True)
    nvfp4_rht: bool | None = setting(
        None, "the random Hadamard transform of the wgrad operands: on (the nvfp4 preset's default) or off, for "
              "ablations (needs --preset nvfp4)", resume="fixed",
        why="changes the NVFP4 weight gradients' quantization", absent=None, on_off=True)
    nvfp4_stochastic_rounding: bool | None = setting(
        None, "stochastic rounding of the gradients: on (the nvfp4 preset's default) or off, for ablations (needs "
              "--preset nvfp4)", resume="fixed", why="changes how the NVFP4 gradients are rounded", absent=None,
        on_off=True)
    keep_blocks: tuple[int | float, int | float] | None = setting(
        None, "keep the linear layers of the first FIRST and last LAST transformer blocks in BF16 under an fp8 or "
              "fp4 preset; each a count or a fraction of the blocks below 1, rounded up (0,0.15 keeps the last 15%) "
              "(default: the preset's; nvfp4 and mxfp4 keep the last block: 0,1)", resume="fixed",
        why="changes which layers run in low precision", absent=None, metavar="FIRST,LAST")

    fp8_layers: str = setting(
        "all", "which of the eligible linear layers run the preset's low-precision recipe: all, or only those it is "
               "predicted to make faster than BF16 on a GPU, from their shapes and the tokens per micro-batch: auto "
               "(on an H100) or h100 / h200 (docs/fp8.md, \"Where FP8 pays\"). The choice does not depend on the "
               "machine, so a CPU run converts the layers the GPU run would", resume="fixed",
        why="changes which layers run in low precision", absent="all", choices=FP8_LAYERS)

    def __post_init__(self):
        check_choice("preset", self.preset, list(PRESETS))
        check_choice("fp8_layers", self.fp8_layers, list(FP8_LAYERS))
        check_choice("attention", self.attention, list(ATTENTIONS))
        if not isinstance(self.master, str) or self.master not in MASTER_UPDATES:
            raise ValueError(f"master must be one of {', '.join(MASTER_UPDATES)}, got {self.master!r}")
        compute = PRESETS[self.preset].compute_dtype
        if self.master != "fp32" and compute != torch.bfloat16:
            raise ValueError(f"master {self.master} stores bf16 weights, which need a preset that computes in bf16 "
                             f"(bf16 or an fp8 one), but preset {self.preset!r} computes in "
                             f"{str(compute).removeprefix('torch.')}; use --master fp32 or another --preset")
        recipe = PRESETS[self.preset].recipe
        check_number("bf16_tail", self.bf16_tail, low=0.0, high=1.0, high_open=True)
        if self.bf16_tail and recipe is None:
            raise ValueError(f"bf16_tail switches the FP8/FP4 layers to BF16 late in training, but "
                             f"preset={self.preset!r} has none; use an fp8 or fp4 preset or bf16_tail=0, got "
                             f"bf16_tail={self.bf16_tail!r}")
        for field in FP8_OVERRIDES:
            if getattr(self, field) is not None and not (recipe is not None and recipe.delayed):
                raise ValueError(f"{field} overrides a DelayedScaling recipe, but preset={self.preset!r} has "
                                 f"{type(recipe).__name__ if recipe else 'no FP8 recipe'}; use preset='fp8-delayed'")
        for field in NVFP4_OVERRIDES:
            value = getattr(self, field)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{field} must be True, False or None, got {value!r}")
            if value is not None and not isinstance(recipe, NVFP4Scaling):
                raise ValueError(f"{field} overrides an NVFP4Scaling recipe, but preset={self.preset!r} has "
                                 f"{type(recipe).__name__ if recipe else 'no low-precision recipe'}; use "
                                 f"preset='nvfp4'")
        if self.fp8_layers != "all" and recipe is None:
            raise ValueError(f"fp8_layers={self.fp8_layers} chooses the layers of a low-precision recipe, but "
                             f"preset={self.preset!r} has none; use an fp8 or fp4 preset or fp8_layers=all")
        if self.keep_blocks is not None:
            if not isinstance(self.keep_blocks, tuple):  # a list would make the config unhashable
                raise ValueError(f"keep_blocks must be a tuple (first, last), {KEEP_BLOCKS_RULE}, or None, got "
                                 f"{self.keep_blocks!r}")
            try:
                check_keep_blocks(self.keep_blocks)
            except ValueError:  # the value as the flag spells it, not a Python tuple
                raise ValueError(f"keep_blocks={keep_blocks_spelled(self.keep_blocks)} is not FIRST,LAST, "
                                 f"{KEEP_BLOCKS_RULE}") from None
            if recipe is None:
                raise ValueError(f"keep_blocks={keep_blocks_spelled(self.keep_blocks)} keeps transformer blocks "
                                 f"out of a low-precision recipe, but preset={self.preset!r} has none; use an fp8 or "
                                 f"fp4 preset")
        self.policy()  # DelayedScaling validates the overridden values

    def policy(self) -> PrecisionPolicy:
        """The preset's policy with the fp8_* overrides applied to its DelayedScaling recipe, the nvfp4_* ones to
        its NVFP4Scaling recipe, keep_blocks, and the weights `master` asks for (bf16 parameters outside the fp32
        islands for the bf16 modes)."""
        policy = master_policy(PrecisionPolicy.preset(self.preset), self.master)
        if self.keep_blocks is not None:
            policy = dataclasses.replace(policy, keep_blocks=self.keep_blocks)
        fp8 = {field: getattr(self, name) for name, field in FP8_OVERRIDES.items() if getattr(self, name) is not None}
        if fp8:
            try:
                policy = dataclasses.replace(policy, recipe=dataclasses.replace(policy.recipe, **fp8))
            except ValueError as err:
                raise ValueError(f"fp8_{str(err)}") from None  # DelayedScaling names its field: "margin must be ..."
        nvfp4 = {field: getattr(self, name) for name, field in NVFP4_OVERRIDES.items()
                 if getattr(self, name) is not None}
        if nvfp4:
            policy = dataclasses.replace(policy, recipe=dataclasses.replace(policy.recipe, **nvfp4))
        return policy

    def layer_filter(self, tokens: int) -> WhereFp8Pays | None:
        """The `filter` of PrecisionPolicy.apply for `fp8_layers` at `tokens` rows per forward: None for all."""
        if self.fp8_layers == "all":
            return None
        return where_fp8_pays(self.recipe, tokens=tokens, gpu=DEFAULT_GPU if self.fp8_layers == "auto" else
                              self.fp8_layers)

    @property
    def recipe(self):
        """The run's low-precision recipe, its overrides applied (a DelayedScaling, NVFP4Scaling, ...), or None."""
        return self.policy().recipe

    @property
    def blocks_kept(self) -> tuple[int | float, int | float]:
        """keep_blocks as (first, last), the preset's when None."""
        return PRESETS[self.preset].keep_blocks if self.keep_blocks is None else self.keep_blocks


def keep_blocks_from(text: str) -> tuple[int | float, int | float]:
    """--keep-blocks' spelling "0,0.15" -> (0, 0.15): counts are ints, fractions floats; ValueError naming the field
    when malformed (Precision checks the ranges)."""
    parts = text.split(",")
    try:
        values = tuple(int(p) if p.strip().isdigit() else float(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 2:
        raise ValueError(f"keep_blocks must be 'FIRST,LAST', {KEEP_BLOCKS_RULE}, such as '0,1' or '0,0.15', "
                         f"got {text!r}")
    return values


def keep_blocks_spelled(keep_blocks: tuple) -> str:
    """(0, 0.15) -> "0,0.15", as --keep-blocks takes it."""
    return ",".join(str(v) for v in keep_blocks)
