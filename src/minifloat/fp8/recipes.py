"""FP8 and FP4 scaling recipes: frozen, validated configuration.

A recipe decides, for each of the three tensors a linear layer quantizes (its input, its weight and the gradient of
its output), the element format, the granularity of the scales and whether a scale comes from the tensor itself
("current") or from an amax history of earlier steps ("delayed"). `Role` and `CastSpec` (`NVFP4Spec` for NVFP4's
two-level scales) are that decision written out; the rest of minifloat only reads `recipe.spec(role)` and the
recipe's `four_bit` flag (which autograd function runs the layer: minifloat.fp8.fourbit.linear for 4-bit recipes).
"""

from __future__ import annotations

import dataclasses
import enum

from minifloat.core.validate import check_bool, check_choice, check_int
from minifloat.numerics.formats import E2M1, E4M3, E5M2, NumberFormat
from minifloat.numerics.granularity import Granularity, granularity_info
from minifloat.numerics.rounding import ROUNDINGS
from minifloat.numerics.scales import MAX_MARGIN


class Role(str, enum.Enum):
    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"


ROLES = (Role.INPUT, Role.WEIGHT, Role.GRAD_OUTPUT)


class Fp8Format(str, enum.Enum):
    HYBRID = "hybrid"  # E4M3 forward (input, weight), E5M2 backward (gradients) — Transformer Engine's HYBRID
    E4M3 = "e4m3"  # E4M3 for all three tensors


class MXFormat(str, enum.Enum):
    """MXScaling's element formats: MXFP8 (the two FP8 choices) or MXFP4."""

    HYBRID = "hybrid"
    E4M3 = "e4m3"
    E2M1 = "e2m1"  # MXFP4 (OCP MX v1.0 §5.3.3) for all three tensors


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

    @property
    def per_tensor(self) -> bool:
        """One scale for the whole tensor (what tensor parallelism and FSDP's FP8 all-gather need)."""
        return granularity_info(self.granularity).per_tensor


@dataclasses.dataclass(frozen=True)
class NVFP4Spec:
    """How one tensor role is quantized under NVFP4 (minifloat.numerics.fp4.quantize_nvfp4): E2M1 elements, an E4M3
    scale per 1×16 block along the last dim (per 16×16 tile with `block_2d`) and one fp32 scale per tensor, all
    from the tensor's current amax. Two levels of scale have no row in the granularity table, so there is no
    `granularity`; `fmt`, `delayed` and `margin` are what every spec answers (calibration seeds from them).
    """

    block_2d: bool = False
    rounding: str = "nearest"

    fmt = E2M1  # class attributes, not fields: the same for every NVFP4 cast
    delayed = False
    margin = 0
    per_tensor = False

    def __post_init__(self):
        check_bool("block_2d", self.block_2d)
        check_choice("rounding", self.rounding, ROUNDINGS)


def _enum(cls, field: str, value):
    """Validate a string-valued option (str enums compare equal to their strings, so values are kept as given)."""
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{field} must be one of {[m.value for m in cls]}, got {value!r}") from None


def _formats(fmt: Fp8Format | MXFormat | str) -> dict[Role, NumberFormat]:
    if fmt == MXFormat.E2M1:
        return {Role.INPUT: E2M1, Role.WEIGHT: E2M1, Role.GRAD_OUTPUT: E2M1}
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
        check_int("margin", self.margin, low=0, high=MAX_MARGIN)
        # a row of fp32 per role and step in every layer: 2^16 steps is 768 KiB a layer, far past any use (TE: 1024)
        check_int("amax_history_len", self.amax_history_len, low=1, high=2**16)

    delayed = True  # scales come from the amax history, updated once per optimizer step
    four_bit = False

    @property
    def history_len(self) -> int:
        return self.amax_history_len

    def spec(self, role: Role) -> CastSpec:
        return CastSpec(_formats(self.format)[role], Granularity.TENSOR, delayed=True, margin=self.margin)


class _JustInTime:
    """Recipes whose scales come from each tensor itself; their history only feeds telemetry."""

    delayed = False
    history_len = DEFAULT_AMAX_HISTORY_LEN
    four_bit = False  # 4-bit elements: the layer runs minifloat.fp8.fourbit.linear's autograd function


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
    """MXFP8 and MXFP4 (OCP MX v1.0): blocks of 32 elements along K sharing an E8M0 (power-of-two) scale.

    format "e4m3" uses E4M3 for all tensors (the usual MXFP8 training choice), "hybrid" E5M2 for gradients, "e2m1"
    E2M1 for all tensors (MXFP4: the layer then runs as every 4-bit recipe does, minifloat.fp8.fourbit.linear, with the
    transposed operands of the backward quantized from high precision; round to nearest, no stochastic rounding).
    scale_rule "up" picks the smallest power of two that avoids overflow; "floor" is the OCP rule, under which the
    largest element of a block may saturate by up to 12.5% — on output gradients that bias made a 500-step MLP run
    diverge in minifloat's tests (tests/test_convergence.py), as Mishra et al. report for LLM pre-training
    ("Recipes for Pre-training LLMs with MXFP8", arXiv 2506.08027), who round the scale up instead.
    """

    format: Fp8Format | MXFormat | str = Fp8Format.E4M3
    scale_rule: str = "up"

    def __post_init__(self):
        _enum(MXFormat, "format", self.format)
        if self.scale_rule not in ("up", "floor"):
            raise ValueError(f"scale_rule must be 'up' or 'floor', got {self.scale_rule!r}")

    @property
    def four_bit(self) -> bool:
        return self.format == MXFormat.E2M1

    def spec(self, role: Role) -> CastSpec:
        return CastSpec(_formats(self.format)[role], Granularity.MX, power_of_two=True, mx_rule=self.scale_rule)


@dataclasses.dataclass(frozen=True)
class NVFP4Scaling(_JustInTime):
    """NVFP4 training (NVIDIA, "Pretraining Large Language Models with NVFP4", arXiv 2509.25149; Transformer
    Engine's NVFP4BlockScaling).

    E2M1 elements in blocks of 16 along K with E4M3 block scales and one fp32 scale per tensor from its current amax
    (minifloat.numerics.fp4). The backward's transposed operands are quantized from high precision, never from a
    quantized copy. Each of the paper's three fixes can be switched off for ablations:

    weight_2d: 16×16 weight tiles (§4.2), so the forward's weight and the dgrad's transposed weight hold the same
        numbers (the chain rule then differentiates the function the forward computed); False: 1×16 blocks, Wᵀ
        quantized along N on its own.
    rht: a 16×16 random Hadamard transform (§4.3) of both wgrad operands along the token axis they share, so a block's
        outliers are spread over it; fixed random signs `rht_signs(seed)`, stored in the layer's ScalingState. Not on
        fprop or dgrad.
    stochastic_rounding: the output gradient's elements (both of its casts) rounded stochastically (§4.4): unbiased
        gradients. Forward tensors always round to nearest. Draws come from a counter-based stream per layer (its
        seed and draw count are ScalingState buffers), so runs are reproducible and resume bitwise.
    seed: seed of the RHT signs (the same in every layer) and of the layers' rounding streams (mixed with each
        layer's name).
    """

    weight_2d: bool = True
    rht: bool = True
    stochastic_rounding: bool = True
    seed: int = 0

    four_bit = True

    def __post_init__(self):
        for field in ("weight_2d", "rht", "stochastic_rounding"):
            check_bool(field, getattr(self, field))
        check_int("seed", self.seed, low=0, high=2**31 - 1)

    def spec(self, role: Role) -> NVFP4Spec:
        role = Role(role)
        rounding = "stochastic" if role == Role.GRAD_OUTPUT and self.stochastic_rounding else "nearest"
        return NVFP4Spec(block_2d=role == Role.WEIGHT and self.weight_2d, rounding=rounding)


Recipe = DelayedScaling | CurrentScaling | BlockScaling | MXScaling | NVFP4Scaling
RECIPE_TYPES = (DelayedScaling, CurrentScaling, BlockScaling, MXScaling, NVFP4Scaling)


def check_recipe(recipe) -> Recipe:
    if not isinstance(recipe, RECIPE_TYPES):
        raise ValueError(f"recipe must be one of {[t.__name__ for t in RECIPE_TYPES]}, got {type(recipe).__name__}")
    return recipe
