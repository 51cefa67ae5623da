"""FP8 scaling recipes: frozen, validated configuration.

A recipe decides, for each of the three tensors a linear layer quantizes (its input, its weight and the gradient of
its output), the element format, the granularity of the scales and whether a scale comes from the tensor itself
("current") or from an amax history of earlier steps ("delayed"). `Role` and `CastSpec` are that decision written out;
the rest of minifloat only reads `recipe.spec(role)`.
"""

from __future__ import annotations

import dataclasses
import enum

from minifloat.numerics.formats import E4M3, E5M2, NumberFormat
from minifloat.numerics.granularity import Granularity


class Role(str, enum.Enum):
    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"


ROLES = (Role.INPUT, Role.WEIGHT, Role.GRAD_OUTPUT)


class Fp8Format(str, enum.Enum):
    HYBRID = "hybrid"  # E4M3 forward (input, weight), E5M2 backward (gradients) — Transformer Engine's HYBRID
    E4M3 = "e4m3"  # E4M3 for all three tensors


# Amax history length: DelayedScaling's default, and the telemetry history every other recipe keeps (so a run that
# switches to delayed scaling starts from current statistics).
DEFAULT_AMAX_HISTORY_LEN = 16


class AmaxCompute(str, enum.Enum):
    MAX = "max"
    MOST_RECENT = "most_recent"


@dataclasses.dataclass(frozen=True)
class CastSpec:
    """How one tensor role is quantized. `granularity` is a `Granularity` member (recipes convert strings)."""

    fmt: NumberFormat
    granularity: Granularity
    delayed: bool = False
    power_of_two: bool = False
    margin: int = 0
    mx_rule: str = "up"

    def __post_init__(self):
        if not isinstance(self.granularity, Granularity):  # frozen: convert before constructing, not here
            raise ValueError(f"granularity must be a Granularity, one of {[g.value for g in Granularity]}, "
                             f"got {self.granularity!r}")


def _enum(cls, field: str, value):
    """Validate a string-valued option (str enums compare equal to their strings, so values are kept as given)."""
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{field} must be one of {[m.value for m in cls]}, got {value!r}") from None


def _formats(fmt: Fp8Format | str) -> dict[Role, NumberFormat]:
    grad = E5M2 if Fp8Format(fmt) == Fp8Format.HYBRID else E4M3
    return {Role.INPUT: E4M3, Role.WEIGHT: E4M3, Role.GRAD_OUTPUT: grad}


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Per-tensor delayed scaling (Transformer Engine semantics).

    scale = fp8_max / amax / 2^margin with amax = max(history) ("max") or the newest entry ("most_recent"); a zero,
    infinite or NaN amax keeps the previous scale; the history rolls once per training step.

    Unlike Transformer Engine, whose first step runs with scale 1, the first step of each layer seeds its scales
    from the current amax (one step of current scaling), so step 0 is not under- or over-flowing.

    Default history: 16 steps with "max". Transformer Engine defaults to 1024/"max", Megatron-LM to 1/"most_recent".
    A 1024-step max keeps the range of a single early spike for 1024 steps (wasting precision long after it); a
    1-step history reacts to the previous step only and overflows on any growth. 16 steps with "max" absorbs
    step-to-step growth yet forgets a spike within 16 steps.
    """

    format: Fp8Format | str = Fp8Format.HYBRID
    margin: int = 0
    amax_history_len: int = DEFAULT_AMAX_HISTORY_LEN
    amax_compute: AmaxCompute | str = AmaxCompute.MAX

    def __post_init__(self):
        _enum(Fp8Format, "format", self.format)
        _enum(AmaxCompute, "amax_compute", self.amax_compute)
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"margin must be a non-negative int, got {self.margin!r}")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be an int >= 1, got {self.amax_history_len!r}")

    delayed = True  # scales come from the amax history, updated once per optimizer step

    @property
    def history_len(self) -> int:
        return self.amax_history_len

    def spec(self, role: Role) -> CastSpec:
        return CastSpec(_formats(self.format)[role], Granularity.TENSOR, delayed=True, margin=self.margin)


class _JustInTime:
    """Recipes whose scales come from each tensor itself; their history only feeds telemetry."""

    delayed = False
    history_len = DEFAULT_AMAX_HISTORY_LEN


@dataclasses.dataclass(frozen=True)
class CurrentScaling(_JustInTime):
    """Current (just-in-time) scaling from each tensor's own amax, per tensor or per row.

    "row" scales each row of the input and of grad_output (one scale per token) and each output row of the weight.
    """

    format: Fp8Format | str = Fp8Format.HYBRID
    granularity: Granularity | str = Granularity.TENSOR
    power_of_two: bool = False

    GRANULARITIES = (Granularity.TENSOR, Granularity.ROW)  # scales that factor out of the GEMM's K-sum

    def __post_init__(self):
        _enum(Fp8Format, "format", self.format)
        Granularity.parse(self.granularity, field="granularity", allowed=self.GRANULARITIES)
        if not isinstance(self.power_of_two, bool):
            raise ValueError(f"power_of_two must be a bool, got {self.power_of_two!r}")

    def spec(self, role: Role) -> CastSpec:
        return CastSpec(_formats(self.format)[role], Granularity(self.granularity), power_of_two=self.power_of_two)


@dataclasses.dataclass(frozen=True)
class BlockScaling(_JustInTime):
    """DeepSeek-V3 fine-grained scaling (arXiv 2412.19437 §3.3).

    E4M3 for every tensor; current scaling per 1×128 tile for activations and activation gradients, per 128×128
    block for weights; partial sums promoted to fp32 per 128-wide K block. Scales are powers of two by default
    (as in Transformer Engine's block recipe), which makes the dequantized operands exact bfloat16 values.
    """

    power_of_two: bool = True

    def __post_init__(self):
        if not isinstance(self.power_of_two, bool):
            raise ValueError(f"power_of_two must be a bool, got {self.power_of_two!r}")

    def spec(self, role: Role) -> CastSpec:
        granularity = Granularity.BLOCK if role == Role.WEIGHT else Granularity.TILE
        return CastSpec(E4M3, granularity, power_of_two=self.power_of_two)


@dataclasses.dataclass(frozen=True)
class MXScaling(_JustInTime):
    """MXFP8 (OCP MX v1.0): blocks of 32 elements along K sharing an E8M0 (power-of-two) scale.

    format "e4m3" uses E4M3 for all tensors (the usual MXFP8 training choice), "hybrid" E5M2 for gradients.
    scale_rule "up" picks the smallest power of two that avoids overflow; "floor" is the OCP rule, under which the
    largest element of a block may saturate by up to 12.5% — on output gradients that bias made a 500-step MLP run
    diverge in minifloat's tests (tests/test_convergence.py), as Mishra et al. report for LLM pre-training
    ("Recipes for Pre-training LLMs with MXFP8", arXiv 2506.08027), who round the scale up instead.
    """

    format: Fp8Format | str = Fp8Format.E4M3
    scale_rule: str = "up"

    def __post_init__(self):
        _enum(Fp8Format, "format", self.format)
        if self.scale_rule not in ("up", "floor"):
            raise ValueError(f"scale_rule must be 'up' or 'floor', got {self.scale_rule!r}")

    def spec(self, role: Role) -> CastSpec:
        return CastSpec(_formats(self.format)[role], Granularity.MX, power_of_two=True, mx_rule=self.scale_rule)


Recipe = DelayedScaling | CurrentScaling | BlockScaling | MXScaling
RECIPE_TYPES = (DelayedScaling, CurrentScaling, BlockScaling, MXScaling)


def check_recipe(recipe) -> Recipe:
    if not isinstance(recipe, RECIPE_TYPES):
        raise ValueError(f"recipe must be one of {[t.__name__ for t in RECIPE_TYPES]}, got {type(recipe).__name__}")
    return recipe
