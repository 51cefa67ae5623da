"""The demo: train the same small byte-level MLP language model in fp32, bf16 and under every FP8 recipe.

The data is real text present on every machine: the Python standard library's own source files. The model sees 16
bytes of context and predicts the next byte. Every variant starts from the same weights and sees the same batches.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
from torch import nn

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


@dataclasses.dataclass
class DemoResult:
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


def train_variant(variant: str, data: torch.Tensor, *, steps: int, batch: int, seed: int, lr: float = 2e-3,
                  progress=None) -> tuple[list[float], float, telemetry.Recorder | None]:
    """Train one variant; returns (losses, ms per step, telemetry of the last step)."""
    torch.manual_seed(seed)
    model = ByteMLP()
    if variant in RECIPES:
        convert(model, recipe=RECIPES[variant])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant != "fp32")
    losses, tel = [], None
    warmup = min(5, steps - 1)  # the first FP8 steps compile kernels: time the rest
    t0 = time.perf_counter()
    for step, (x, y) in enumerate(_batches(data, steps, batch, model.context, seed)):
        if step == warmup:
            t0 = time.perf_counter()
        last = step == steps - 1 and variant in RECIPES
        with autocast, (telemetry.capture() if last else _null()) as rec:
            loss = nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tel = rec if last else tel
        if progress is not None:
            progress()
    return losses, (time.perf_counter() - t0) / (steps - warmup) * 1e3, tel


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def run_demo(*, steps: int = 300, batch: int = 256, seed: int = 0, variants=VARIANTS, progress=None):
    data = stdlib_bytes()
    results, curves = [], {}
    for v in variants:
        losses, ms, tel = train_variant(v, data, steps=steps, batch=batch, seed=seed, progress=progress)
        curves[v] = losses
        tail = sum(losses[-20:]) / len(losses[-20:])  # mean of the last 20 steps: less noise than one batch
        min_sqnr = min((r.sqnr_db for r in tel.records), default=math.nan) if tel else math.nan
        max_sat = max((r.saturated for r in tel.records), default=math.nan) if tel else math.nan
        results.append(DemoResult(v, tail, math.nan, ms, min_sqnr, max_sat))
    base = next((r.final_loss for r in results if r.variant == "bf16"), None)
    for r in results:
        r.rel_diff_vs_bf16 = (r.final_loss - base) / base if base else math.nan
    return results, curves
