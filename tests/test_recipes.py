"""Tests for minifloat.fp8.recipes: validation, immutability and the per-role cast specs each recipe documents.

The documented specs come from the recipes' sources of truth, not from the code under test:
  * DelayedScaling / CurrentScaling "hybrid": Transformer Engine's Format.HYBRID — E4M3 forward (input, weight),
    E5M2 backward (grad_output);
  * BlockScaling: DeepSeek-V3 (arXiv 2412.19437 §3.3) — E4M3 everywhere, 1×128 tiles for activations and their
    gradients, 128×128 blocks for weights;
  * MXScaling: OCP MX v1.0 — 32-element blocks sharing a power-of-two (E8M0) scale; "e2m1" is MXFP4 (§5.3.3);
  * NVFP4Scaling: arXiv 2509.25149 — E2M1 everywhere, 16×16 weight tiles (§4.2), stochastic rounding for gradients
    only (§4.4), the RHT on the wgrad operands (§4.3, applied by the autograd function, not a cast spec).
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from minifloat.numerics.formats import E2M1, E4M3, E5M2
from minifloat.numerics.granularity import Granularity
from minifloat.fp8.recipes import (
    ROLES,
    BlockScaling,
    CastSpec,
    CurrentScaling,
    DelayedScaling,
    MXScaling,
    NVFP4Scaling,
    NVFP4Spec,
    Role,
    check_recipe,
)

# ---------------------------------------------------------------------------------------------------- validation

# (name, recipe class, keyword arguments, field the message must name, value the message must show)
INVALID = [
    ("delayed-format", DelayedScaling, {"format": "e3m4"}, "format", "e3m4"),
    ("delayed-margin-negative", DelayedScaling, {"margin": -1}, "margin", "-1"),
    ("delayed-margin-float", DelayedScaling, {"margin": 1.5}, "margin", "1.5"),
    ("delayed-history-zero", DelayedScaling, {"amax_history_len": 0}, "amax_history_len", "0"),
    ("delayed-history-float", DelayedScaling, {"amax_history_len": 2.0}, "amax_history_len", "2.0"),
    ("delayed-amax-compute", DelayedScaling, {"amax_compute": "mean"}, "amax_compute", "mean"),
    ("current-format", CurrentScaling, {"format": "e3m4"}, "format", "e3m4"),
    ("current-granularity-tile", CurrentScaling, {"granularity": "tile"}, "granularity", "tile"),
    ("current-granularity-mx", CurrentScaling, {"granularity": "mx"}, "granularity", "mx"),
    ("current-granularity-bogus", CurrentScaling, {"granularity": "bogus"}, "granularity", "bogus"),
    ("current-power-of-two-str", CurrentScaling, {"power_of_two": "yes"}, "power_of_two", "yes"),
    ("block-power-of-two-str", BlockScaling, {"power_of_two": "yes"}, "power_of_two", "yes"),
    ("block-power-of-two-int", BlockScaling, {"power_of_two": 1}, "power_of_two", "1"),
    ("mx-format", MXScaling, {"format": "e3m4"}, "format", "e3m4"),
    ("mx-scale-rule", MXScaling, {"scale_rule": "ceil"}, "scale_rule", "ceil"),
    ("nvfp4-weight-2d-int", NVFP4Scaling, {"weight_2d": 1}, "weight_2d", "1"),
    ("nvfp4-rht-str", NVFP4Scaling, {"rht": "yes"}, "rht", "yes"),
    ("nvfp4-sr-none", NVFP4Scaling, {"stochastic_rounding": None}, "stochastic_rounding", "None"),
    ("nvfp4-seed-negative", NVFP4Scaling, {"seed": -1}, "seed", "-1"),
    ("nvfp4-seed-float", NVFP4Scaling, {"seed": 1.0}, "seed", "1.0"),
    ("nvfp4-spec-rounding", NVFP4Spec, {"rounding": "up"}, "rounding", "up"),
]


@pytest.mark.parametrize("cls, kwargs, field, value", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_value_raises_naming_field_and_value(cls, kwargs, field, value):
    with pytest.raises(ValueError) as info:
        cls(**kwargs)
    message = str(info.value)
    assert field in message
    assert re.search(rf"(?<![\w.-]){re.escape(value)}(?![\w.])", message), message


@pytest.mark.parametrize("value", ["tile", "block", "mx", "bogus", Granularity.TILE])
def test_current_scaling_names_its_allowed_granularities(value):
    with pytest.raises(ValueError, match=re.escape("granularity must be one of ['tensor', 'row'], got")):
        CurrentScaling(granularity=value)


def test_current_scaling_accepts_members_and_strings_alike():
    assert CurrentScaling(granularity=Granularity.ROW) == CurrentScaling(granularity="row")
    assert CurrentScaling(granularity="row").spec(Role.INPUT).granularity is Granularity.ROW


def test_cast_spec_wants_a_granularity_member():
    assert CastSpec(E4M3, Granularity.TILE).granularity is Granularity.TILE
    with pytest.raises(ValueError, match=r"granularity must be a Granularity.*'tile'"):
        CastSpec(E4M3, "tile")


# (name, recipe) — every constructor option at a valid non-default value
VALID = [
    ("delayed-default", DelayedScaling()),
    ("delayed-e4m3", DelayedScaling(format="e4m3", margin=2, amax_history_len=1, amax_compute="most_recent")),
    ("current-default", CurrentScaling()),
    ("current-row-pow2", CurrentScaling(format="e4m3", granularity="row", power_of_two=True)),
    ("block-default", BlockScaling()),
    ("block-no-pow2", BlockScaling(power_of_two=False)),
    ("mx-default", MXScaling()),
    ("mx-hybrid-floor", MXScaling(format="hybrid", scale_rule="floor")),
    ("mxfp4", MXScaling(format="e2m1")),
    ("nvfp4-default", NVFP4Scaling()),
    ("nvfp4-ablated", NVFP4Scaling(weight_2d=False, rht=False, stochastic_rounding=False, seed=5)),
]


@pytest.mark.parametrize("recipe", [c[1] for c in VALID], ids=[c[0] for c in VALID])
def test_valid_recipe_passes_check_recipe(recipe):
    assert check_recipe(recipe) is recipe


@pytest.mark.parametrize("bad", [None, "delayed", DelayedScaling], ids=["none", "string", "class"])
def test_check_recipe_rejects_non_recipes(bad):
    with pytest.raises(ValueError, match="recipe must be one of"):
        check_recipe(bad)


# ---------------------------------------------------------------------------------------------------- immutability

# (name, recipe, a field, a valid new value for it)
FIELDS = [
    ("delayed", DelayedScaling(), "margin", 1),
    ("current", CurrentScaling(), "granularity", "row"),
    ("block", BlockScaling(), "power_of_two", False),
    ("mx", MXScaling(), "scale_rule", "floor"),
    ("nvfp4", NVFP4Scaling(), "rht", False),
]


@pytest.mark.parametrize("recipe, field, value", [c[1:] for c in FIELDS], ids=[c[0] for c in FIELDS])
def test_recipes_are_frozen(recipe, field, value):
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(recipe, field, value)


@pytest.mark.parametrize("recipe, field, value", [c[1:] for c in FIELDS], ids=[c[0] for c in FIELDS])
def test_replace_derives_a_variant(recipe, field, value):
    variant = dataclasses.replace(recipe, **{field: value})
    assert getattr(variant, field) == value
    assert type(variant) is type(recipe)
    assert variant != recipe
    assert getattr(recipe, field) != value  # the original is untouched


@pytest.mark.parametrize("recipe, field", [(DelayedScaling(), "margin"), (CurrentScaling(), "granularity"),
                                           (MXScaling(), "scale_rule")], ids=["delayed", "current", "mx"])
def test_replace_validates(recipe, field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(recipe, **{field: -1 if field == "margin" else "bogus"})


def test_recipes_are_hashable_and_compare_by_value():
    assert DelayedScaling() == DelayedScaling()
    assert hash(CurrentScaling(granularity="row")) == hash(CurrentScaling(granularity="row"))
    assert DelayedScaling() != DelayedScaling(format="e4m3")


# ---------------------------------------------------------------------------------------------------- specs

I, W, G = Role.INPUT, Role.WEIGHT, Role.GRAD_OUTPUT

# (name, recipe, {role: (fmt, granularity)}, delayed, power_of_two)
SPECS = [
    ("delayed-hybrid", DelayedScaling(), {I: (E4M3, "tensor"), W: (E4M3, "tensor"), G: (E5M2, "tensor")}, True, False),
    ("delayed-e4m3", DelayedScaling(format="e4m3"),
     {I: (E4M3, "tensor"), W: (E4M3, "tensor"), G: (E4M3, "tensor")}, True, False),
    ("current-hybrid", CurrentScaling(), {I: (E4M3, "tensor"), W: (E4M3, "tensor"), G: (E5M2, "tensor")}, False, False),
    ("current-row", CurrentScaling(granularity="row"),
     {I: (E4M3, "row"), W: (E4M3, "row"), G: (E5M2, "row")}, False, False),
    ("current-pow2", CurrentScaling(power_of_two=True),
     {I: (E4M3, "tensor"), W: (E4M3, "tensor"), G: (E5M2, "tensor")}, False, True),
    ("block", BlockScaling(), {I: (E4M3, "tile"), W: (E4M3, "block"), G: (E4M3, "tile")}, False, True),
    ("block-no-pow2", BlockScaling(power_of_two=False),
     {I: (E4M3, "tile"), W: (E4M3, "block"), G: (E4M3, "tile")}, False, False),
    ("mx", MXScaling(), {I: (E4M3, "mx"), W: (E4M3, "mx"), G: (E4M3, "mx")}, False, True),
    ("mx-hybrid", MXScaling(format="hybrid"), {I: (E4M3, "mx"), W: (E4M3, "mx"), G: (E5M2, "mx")}, False, True),
    ("mxfp4", MXScaling(format="e2m1"), {I: (E2M1, "mx"), W: (E2M1, "mx"), G: (E2M1, "mx")}, False, True),
]


@pytest.mark.parametrize("recipe, expected, delayed, power_of_two", [c[1:] for c in SPECS],
                         ids=[c[0] for c in SPECS])
def test_spec_per_role(recipe, expected, delayed, power_of_two):
    for role in ROLES:
        spec = recipe.spec(role)
        assert (spec.fmt, spec.granularity) == expected[role], role
        assert isinstance(spec.granularity, Granularity), role
        assert spec.delayed is delayed
        assert spec.power_of_two is power_of_two


def test_spec_accepts_role_strings():
    # Role is a str enum: "grad_output" and Role.GRAD_OUTPUT name the same role
    assert DelayedScaling().spec(Role("grad_output")).fmt == E5M2


def test_delayed_spec_carries_margin():
    assert DelayedScaling(margin=3).spec(Role.INPUT).margin == 3


@pytest.mark.parametrize("rule", ["up", "floor"])
def test_mx_spec_carries_scale_rule(rule):
    assert all(MXScaling(scale_rule=rule).spec(role).mx_rule == rule for role in ROLES)


def test_default_history_is_sixteen_steps_of_max():
    # the recipe's docstring argues for 16 steps with "max" over TE's 1024 and Megatron's 1/"most_recent"
    recipe = DelayedScaling()
    assert recipe.amax_history_len == 16
    assert recipe.amax_compute == "max"
    assert recipe.margin == 0
    assert recipe.format == "hybrid"


# (name, recipe, {role: (block_2d, rounding)})
NVFP4_SPECS = [
    ("default", NVFP4Scaling(), {I: (False, "nearest"), W: (True, "nearest"), G: (False, "stochastic")}),
    ("1x16-weights", NVFP4Scaling(weight_2d=False),
     {I: (False, "nearest"), W: (False, "nearest"), G: (False, "stochastic")}),
    ("no-sr", NVFP4Scaling(stochastic_rounding=False),
     {I: (False, "nearest"), W: (True, "nearest"), G: (False, "nearest")}),
]


@pytest.mark.parametrize("recipe, expected", [c[1:] for c in NVFP4_SPECS], ids=[c[0] for c in NVFP4_SPECS])
def test_nvfp4_spec_per_role(recipe, expected):
    for role in ROLES:
        spec = recipe.spec(role)
        assert isinstance(spec, NVFP4Spec) and spec.fmt == E2M1 and not spec.delayed, role
        assert (spec.block_2d, spec.rounding) == expected[role], role
        assert not spec.per_tensor


@pytest.mark.parametrize("recipe, four_bit", [(DelayedScaling(), False), (CurrentScaling(), False),
                                              (BlockScaling(), False), (MXScaling(), False),
                                              (MXScaling(format="e2m1"), True), (NVFP4Scaling(), True)],
                         ids=["delayed", "current", "block", "mxfp8", "mxfp4", "nvfp4"])
def test_four_bit_flag(recipe, four_bit):
    assert recipe.four_bit is four_bit
    assert not recipe.delayed or not four_bit
