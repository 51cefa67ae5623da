"""The demo: train the same small byte-level MLP language model in fp32, bf16 and under every FP8 recipe.

The data is real text present on every machine: the Python standard library's own source files. The model sees 16
bytes of context and predicts the next byte. Every variant starts from the same weights and sees the same batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable

import torch
from torch import nn

from minifloat.core.validate import check_choice, check_int, check_number, check_seed
from minifloat.fp8 import telemetry
from minifloat.fp8.convert import convert
from minifloat.fp8.recipes import BlockScaling, CurrentScaling, DelayedScaling, MXScaling
from minifloat.training.data import ByteCorpus, DataConfig

RECIPES = {
    "fp8-delayed": DelayedScaling(),
    "fp8-current": CurrentScaling(),
    "fp8-current-row": CurrentScaling(granularity="row"),
    "fp8-block": BlockScaling(),
    "mxfp8": MXScaling(),
}
VARIANTS = ("fp32", "bf16", *RECIPES)
WARMUP_STEPS = 5  # steps left out of ms/step (the first FP8 steps compile kernels)
FINAL_LOSS_STEPS = 20  # a variant's final loss averages its last steps' losses: less noise than one batch


def stdlib_bytes(limit: int = 2_000_000) -> torch.Tensor:
    """The standard-library corpus's training split (minifloat.training.data), capped at `limit` bytes, as int64."""
    return ByteCorpus.load(DataConfig(max_bytes=limit)).train.long()


class ByteMLP(nn.Module):
    """Embedding of `context` bytes -> MLP -> logits over the next byte."""

    def __init__(self, context: int = 16, embed: int = 32, hidden: int = 512, depth: int = 4):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(256, embed)
        layers: list[nn.Module] = [nn.Linear(context * embed, hidden), nn.GELU()]
        for _ in range(depth - 2):
            layers += [nn.Linear(hidden, hidden), nn.GELU()]
        layers.append(nn.Linear(hidden, 256))
        self.mlp = nn.Sequential(*layers)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx).flatten(1)  # (B, context·embed)
        return self.mlp(x)  # (B, 256)


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """What the demo trains.

    Args:
        steps: optimizer steps per variant, >= 1.
        batch: sequences per batch, >= 1.
        seed: seed of the weights and the batch order, >= 0.
        variants: names from VARIANTS, each at most once, in the order they run.
        lr: AdamW's learning rate, > 0.
    """

    steps: int = 300
    batch: int = 256
    seed: int = 0
    variants: tuple[str, ...] = VARIANTS
    lr: float = 2e-3

    def __post_init__(self):
        check_int("steps", self.steps, low=1)
        check_int("batch", self.batch, low=1)
        check_seed("seed", self.seed)
        check_number("lr", self.lr, low=0, low_open=True)
        if not isinstance(self.variants, tuple) or not self.variants:
            raise ValueError(f"variants must be a non-empty tuple of names from {list(VARIANTS)}, "
                             f"got {self.variants!r}")
        for variant in self.variants:
            check_choice("variants", variant, VARIANTS)
        if len(set(self.variants)) != len(self.variants):
            raise ValueError(f"variants must name each variant once, got {list(self.variants)}")


@dataclasses.dataclass
class DemoResult:
    """One variant's outcome: `final_loss` is the mean of the last FINAL_LOSS_STEPS steps' training loss; SQNR and
    saturation are over every FP8 cast of the last step (nan without FP8); `rel_diff_vs_bf16` is nan until
    `run_demo` has the bf16 result."""

    variant: str
    final_loss: float
    rel_diff_vs_bf16: float
    ms_per_step: float
    min_sqnr_db: float
    max_saturated: float


def _batches(data: torch.Tensor, steps: int, batch: int, context: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, data.numel() - context - 1, (batch,), generator=g)
        idx = start[:, None] + torch.arange(context + 1)
        window = data[idx]
        yield window[:, :-1], window[:, -1]


def train_variant(variant: str, data: torch.Tensor, config: DemoConfig = DemoConfig(), *,
                  progress: Callable[[int], None] | None = None,
                  ) -> tuple[list[float], float, telemetry.Recorder | None]:
    """Train one variant from `config.seed`'s weights on `config.steps` batches of `data`.

    Args:
        variant: a name from VARIANTS.
        data: (N,) int64 byte stream, longer than the model's context.
        config: steps, batch, seed and lr (its `variants` are not used).
        progress: called after each step with the number of steps done.
    Returns:
        (losses, ms per step after the warm-up steps, telemetry of the last step or None without FP8).
    """
    check_choice("variant", variant, VARIANTS)
    torch.manual_seed(config.seed)
    model = ByteMLP()
    if data.dim() != 1 or data.numel() <= model.context + 1:
        raise ValueError(f"data must be a 1-D byte stream longer than {model.context + 1}, got shape "
                         f"{tuple(data.shape)}")
    if variant in RECIPES:
        convert(model, recipe=RECIPES[variant])
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.1)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant != "fp32")
    losses, tel = [], None
    warmup = min(WARMUP_STEPS, config.steps - 1)  # at least one step is timed
    t0 = time.perf_counter()
    for step, (x, y) in enumerate(_batches(data, config.steps, config.batch, model.context, config.seed)):
        if step == warmup:
            t0 = time.perf_counter()
        last = step == config.steps - 1 and variant in RECIPES
        with autocast, (telemetry.capture() if last else contextlib.nullcontext()) as rec:
            loss = nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tel = rec if last else tel
        if progress is not None:
            progress(step + 1)
    return losses, (time.perf_counter() - t0) / (config.steps - warmup) * 1e3, tel


def run_demo(config: DemoConfig = DemoConfig(), *, progress: Callable[[str, int], None] | None = None,
             on_result: Callable[[DemoResult], None] | None = None) -> tuple[list[DemoResult], dict[str, list[float]]]:
    """Train every variant of `config` on the standard library's bytes, one after another.

    Args:
        config: what to train.
        progress: called as progress(variant, steps done) when a variant starts (0) and after each of its steps.
        on_result: called with each variant's result as it finishes (before `rel_diff_vs_bf16` is known).
    Returns:
        (one DemoResult per variant, {variant: per-step training losses}).
    """
    data = stdlib_bytes()
    results, curves = [], {}
    for v in config.variants:
        if progress is not None:
            progress(v, 0)
        losses, ms, tel = train_variant(v, data, config, progress=None if progress is None else
                                        functools.partial(progress, v))
        curves[v] = losses
        tail = losses[-FINAL_LOSS_STEPS:]
        min_sqnr = min((r.sqnr_db for r in tel.records), default=math.nan) if tel else math.nan
        max_sat = max((r.saturated for r in tel.records), default=math.nan) if tel else math.nan
        results.append(DemoResult(v, sum(tail) / len(tail), math.nan, ms, min_sqnr, max_sat))
        if on_result is not None:
            on_result(results[-1])
    base = next((r.final_loss for r in results if r.variant == "bf16"), None)
    for r in results:
        r.rel_diff_vs_bf16 = (r.final_loss - base) / base if base else math.nan
    return results, curves
