"""Where FP8 pays: a layer's predicted FP8 speed-up on a named GPU, and a `convert` filter built on it.

FP8 makes a linear layer's three GEMMs (`input @ weight_t = output`, `grad_output @ weight = grad_input`,
`input_t @ grad_output = grad_weight`: 6·M·K·N flops for M tokens, K in and N out features) about twice as fast, and
adds passes over memory: every cast reads a bf16 tensor and writes its FP8 layouts (x and dy of M·K and M·N
elements, W of K·N). Per layer and step:

    t_bf16 = 6·M·K·N / R_bf16
    t_fp8  = 6·M·K·N / (R_fp8 · gemm_factor) + bytes_per_element · (M·K + M·N + K·N) / B_cast

with R the GEMM rates a GPU reaches and B_cast the bandwidth of minifloat's cast kernels on it, both measured
(docs/benchmarks.md). A layer pays when t_bf16 / t_fp8 reaches `min_speedup`. Small layers lose: at d_model 768 and
8k tokens the casts cost more than the GEMMs save. The prediction depends only on shapes, the recipe and the GPU
named, never on the machine it runs on, so a run converts the same layers on a CPU (emulating) as on the GPU.
What it leaves out, and why `min_speedup` is above 1: host work per layer (eager launches, which CUDA graphs remove),
and fusion with neighbouring work under torch.compile.

torchao's auto filter (`_auto_filter_for_recipe`) decides from fixed (K, N) thresholds; this one takes the tokens per
step into account, so the same model can pay at 16k tokens per step and not at 2k.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from minifloat.core.validate import check_int, check_number
from minifloat.fp8.recipes import BlockScaling, CurrentScaling, DelayedScaling, Recipe, check_recipe
from minifloat.numerics.granularity import Granularity


@dataclasses.dataclass(frozen=True)
class GpuRates:
    """What one GPU reaches, for the cost model above.

    Attributes:
        bf16_tflops: dense bf16 GEMM rate reached at large shapes (TFLOP/s).
        fp8_tflops: tensor-wise E4M3 `torch._scaled_mm` rate reached at large shapes (TFLOP/s).
        cast_tbps: bandwidth of minifloat's cast kernels (TB/s of bytes read and written).
        source: where the figures come from.
    """

    bf16_tflops: float
    fp8_tflops: float
    cast_tbps: float
    source: str


# Measured with benchmarks/gpu.py (docs/benchmarks.md, "GPU benchmark"): the GEMM ceiling at 8192³ and the casts'
# bandwidth from the profiler (209-223 µs for the 256 MB a cast of an 8192² tensor moves: a quarter of the H200's
# memory speed, bound by the bytes each program keeps in flight, not by the memory). The H100 run did not profile
# the casts; its figure is the H200's, the same kernels on as many SMs.
GPUS = {
    "h100": GpuRates(785.0, 1357.0, 1.2, "H100 SXM 80 GB, 2026-11-24: bf16 mm 1.40 ms, FP8 0.81 ms at 8192³"),
    "h200": GpuRates(810.0, 1500.0, 1.2, "H200 141 GB, 2026-11-27: GEMM ceiling and profiled casts"),
}
DEFAULT_GPU = "h100"
DEFAULT_MIN_SPEEDUP = 1.05  # above 1: the model leaves out host work per layer (see the module docstring)


@dataclasses.dataclass(frozen=True)
class CastCost:
    """One recipe family's costs. bytes_per_element: bytes its casts move per element of x, dy and W (2 read from
    bf16, 1 written per FP8 layout, plus amax passes and re-quantizations); gemm_factor: its FP8 GEMM's rate against
    the tensor-wise one (None: no native GEMM on SM90, so the product runs emulated at the bf16 rate)."""

    bytes_per_element: float
    gemm_factor: float | None


# bytes: delayed = one cast writing both layouts (2 + 1 + 1); current adds an amax pass (+2); row = an amax pass
# and a cast per axis, the column one from the FP8 bytes; block = 1×128 tiles both ways plus the 128×128 weight.
# gemm_factor: the GEMM ceiling's row and block columns against tensor (1.70-1.82× and 1.62-1.70× vs 1.79-1.88×),
# lowered for block to fit its measured linear rows (its wgrad is 1×128 × 1×128 tiles).
COSTS = {
    "delayed": CastCost(4.0, 1.0),
    "current": CastCost(6.0, 1.0),
    "row": CastCost(8.0, 0.95),
    "block": CastCost(8.0, 0.85),
    "emulated": CastCost(4.0, None),  # MX and NVFP4: native only on SM100, which GPUS has no figures for yet
}


def recipe_cost(recipe: Recipe) -> tuple[str, CastCost]:
    """The COSTS row (name, cost) of `recipe`."""
    recipe = check_recipe(recipe)
    if isinstance(recipe, DelayedScaling):
        name = "delayed"
    elif isinstance(recipe, CurrentScaling):
        name = "current" if Granularity(recipe.granularity) is Granularity.TENSOR else "row"
    elif isinstance(recipe, BlockScaling):
        name = "block"
    else:
        name = "emulated"
    return name, COSTS[name]


def gpu_rates(gpu: str) -> GpuRates:
    """GPUS[gpu]; ValueError naming the known GPUs otherwise."""
    if not isinstance(gpu, str) or gpu.lower() not in GPUS:
        raise ValueError(f"gpu must be one of {', '.join(GPUS)} (the GPUs whose FP8 rates minifloat has measured), "
                         f"got {gpu!r}")
    return GPUS[gpu.lower()]


def fp8_speedup(recipe: Recipe, *, tokens: int, in_features: int, out_features: int, gpu: str = DEFAULT_GPU) -> float:
    """Predicted t_bf16 / t_fp8 of one linear layer's forward and backward (the module docstring's model).

    Args:
        recipe: the FP8 recipe the layer would run.
        tokens: M, the rows of the layer's input per forward (batch × sequence length of one micro-batch).
        in_features, out_features: K and N.
        gpu: a name in GPUS.
    """
    rates = gpu_rates(gpu)
    for name, value in (("tokens", tokens), ("in_features", in_features), ("out_features", out_features)):
        check_int(name, value, low=1)
    _, cost = recipe_cost(recipe)
    m, k, n = tokens, in_features, out_features
    flops = 6.0 * m * k * n
    t_bf16 = flops / (rates.bf16_tflops * 1e12)
    gemm = t_bf16 if cost.gemm_factor is None else flops / (rates.fp8_tflops * cost.gemm_factor * 1e12)
    casts = cost.bytes_per_element * (m * k + m * n + k * n) / (rates.cast_tbps * 1e12)
    return t_bf16 / (gemm + casts)


@dataclasses.dataclass(frozen=True)
class WhereFp8Pays:
    """A `convert` / `PrecisionPolicy.apply` filter: `filter(name, linear)` is True where `fp8_speedup` of the
    layer reaches `min_speedup`. Build it with `where_fp8_pays`."""

    recipe: Recipe
    tokens: int
    gpu: str = DEFAULT_GPU
    min_speedup: float = DEFAULT_MIN_SPEEDUP

    def __post_init__(self):
        check_recipe(self.recipe)
        gpu_rates(self.gpu)
        check_int("tokens", self.tokens, low=1)  # the rows of a layer's input per forward: batch × sequence length
        check_number("min_speedup", self.min_speedup, low=0.0, low_open=True)

    def speedup(self, linear: nn.Linear) -> float:
        """The layer's predicted FP8 speed-up over bf16."""
        return fp8_speedup(self.recipe, tokens=self.tokens, in_features=linear.in_features,
                           out_features=linear.out_features, gpu=self.gpu)

    def __call__(self, name: str, linear: nn.Linear) -> bool:
        return self.speedup(linear) >= self.min_speedup

    def __str__(self) -> str:
        return (f"the FP8-pays filter (FP8 predicted below {self.min_speedup:g}× bf16 on an {self.gpu.upper()} at "
                f"{self.tokens} tokens per forward)")


def where_fp8_pays(recipe: Recipe, *, tokens: int, gpu: str = DEFAULT_GPU,
                   min_speedup: float = DEFAULT_MIN_SPEEDUP) -> WhereFp8Pays:
    """A filter for `mf.convert(model, recipe=recipe, filter=...)` (or `PrecisionPolicy.apply(model, filter=...)`)
    that converts only the layers FP8 is predicted to speed up by `min_speedup` at `tokens` rows per forward on
    `gpu` (see the module docstring for the model and its measured figures).

    Args:
        recipe: the recipe the layers will run (row and block scaling pay at larger shapes than tensor-wise).
        tokens: rows of each layer's input per forward: batch × sequence length of one micro-batch.
        gpu: "h100" or "h200"; the decision depends on it and the shapes only, not on the machine it runs on.
        min_speedup: the predicted speed-up a layer must reach.
    """
    return WhereFp8Pays(recipe, tokens, gpu.lower() if isinstance(gpu, str) else gpu, min_speedup)
