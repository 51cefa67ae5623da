"""What sharing the input's cast among sibling layers (q, k, v; gate, up) saves in a Llama training step.

minifloat.fp8.shared_input lets the layers of a block that read one tensor take the first one's cast (every recipe).
This measures, on the reference Llama under bfloat16 autocast, each recipe's training step (forward, backward, AdamW)
with the sharing on and off (`shared_input.unshared()`), on one model in one process, the settings alternating round
by round so the machine's drift hits both alike: step time (median of the rounds' medians, and their spread: the
run's noise), the ratio of shared to unshared, and the bytes autograd saves in one forward (distinct tensors,
parameters excluded). Both settings give the same bits (tests/test_shared_input.py); this is only about time and
memory. No number here is asserted anywhere.

Usage:
    python benchmarks/shared_input.py                                 # the 10m preset, 8 x 256 tokens, a few minutes
    python benchmarks/shared_input.py --model tiny --steps 2 --rounds 1   # smoke run
    python benchmarks/shared_input.py --recipes current,block --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import machine  # noqa: E402

import minifloat as mf  # noqa: E402
from minifloat.fp8 import shared_input  # noqa: E402
from minifloat.training.model import Llama, LlamaConfig  # noqa: E402

RECIPES = {
    "current": lambda: mf.CurrentScaling(),
    "current-row": lambda: mf.CurrentScaling(granularity="row"),
    "block": lambda: mf.BlockScaling(),
    "mx": lambda: mf.MXScaling(),
    "delayed": lambda: mf.DelayedScaling(),
    "nvfp4": lambda: mf.NVFP4Scaling(),
}
SETTINGS = ("unshared", "shared")


class Run:
    """One recipe's model, optimizer and data, stepped under one sharing setting."""

    def __init__(self, recipe: str, args: argparse.Namespace):
        torch.manual_seed(args.seed)
        self.model = mf.convert(Llama(LlamaConfig.preset(args.model, attention="fp32")), recipe=RECIPES[recipe]())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(args.seed)
        idx = torch.randint(0, self.model.config.vocab_size, (args.batch_size, args.seq_len + 1), generator=g)
        self.idx, self.targets = idx[:, :-1], idx[:, 1:]

    def loss(self, shared: bool) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16), (contextlib.nullcontext() if shared
                                                            else shared_input.unshared()):
            return self.model(self.idx, self.targets)[1]

    def step(self, shared: bool) -> float:
        t0 = time.perf_counter()
        with contextlib.nullcontext() if shared else shared_input.unshared():
            self.loss(shared).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def saved_bytes(self, shared: bool) -> int:
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        seen: dict[tuple, int] = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen[(ptr, t.storage_offset(), tuple(t.shape))] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = self.loss(shared)
        del loss
        return sum(seen.values())


def measure(recipe: str, args: argparse.Namespace) -> dict:
    # one model for both settings, which alternate round by round: two models' memory lay differently and timed
    # differently by a few percent where the setting changed nothing
    run = Run(recipe, args)
    for setting in SETTINGS:
        for _ in range(args.warmup):
            run.step(setting == "shared")
    times: dict[str, list[float]] = {s: [] for s in SETTINGS}
    for r in range(args.rounds):
        for setting in (SETTINGS if r % 2 == 0 else SETTINGS[::-1]):
            times[setting].append(statistics.median(run.step(setting == "shared") for _ in range(args.steps)))
    ms = {s: statistics.median(t) * 1e3 for s, t in times.items()}
    spread = {s: (max(t) - min(t)) / statistics.median(t) for s, t in times.items()}
    saved = {s: run.saved_bytes(s == "shared") for s in SETTINGS}
    return {"recipe": recipe, "step_ms": ms, "round_spread": spread,
            "shared_over_unshared": ms["shared"] / ms["unshared"],
            "saved_mib": {s: b / 2**20 for s, b in saved.items()},
            "saved_ratio": saved["shared"] / saved["unshared"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="10m", help="reference Llama size (default 10m)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--recipes", default="current,current-row,block,delayed",
                   help=f"comma-separated, of {', '.join(RECIPES)}")
    p.add_argument("--steps", type=int, default=4, help="timed steps per round (their median is the round's)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    machine.add_overwrite(p)
    args = p.parse_args()
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        p.error(f"unknown recipe(s) {unknown}; known: {list(RECIPES)}")
    for name in ("steps", "rounds", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    machine.keep_existing(p, args, "json")
    print(f"{args.model} Llama, {args.batch_size} x {args.seq_len} tokens, AdamW, bfloat16 autocast; "
          f"{machine.line()}")
    rows = []
    for recipe in recipes:
        row = measure(recipe, args)
        rows.append(row)
        print(f"{recipe:12s} unshared {row['step_ms']['unshared']:8.1f} ms  shared {row['step_ms']['shared']:8.1f} ms"
              f"  ratio {row['shared_over_unshared']:.3f} (rounds spread {max(row['round_spread'].values()):.1%})"
              f"   saved for backward {row['saved_mib']['unshared']:.1f}"
              f" -> {row['saved_mib']['shared']:.1f} MiB ({row['saved_ratio']:.3f})", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"machine": machine.describe(), "args": vars(args),
                                                       "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
