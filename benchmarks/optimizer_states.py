"""Low-precision AdamW states on the 10.7M-parameter Llama: final validation loss, optimizer bytes per parameter and
step time of each (m, v) format pair against torch's fp32 AdamW, same seed, data and steps.

    python benchmarks/optimizer_states.py --json docs/bench_optimizer_states_10m.json
    python benchmarks/optimizer_states.py --external --json docs/bench_optimizer_states_10m.json  # + torchao, bnb

The run is docs/benchmarks.md's 10m table (600 steps of 16 × 128 bytes, lr 1e-3 → 1e-4, warm-up 50, 4 MB corpus)
under the bf16 preset: the optimizer state does not depend on the GEMMs' precision. tokens/s comes from the training
runs (minifloat.training.loop.train, first step left out), "× fp32" is its ratio to the fp32,fp32 run of the same
invocation. Bytes per parameter are counted at the end of each run from the optimizer that trained: every tensor in
optimizer.state, each storage once (minifloat.training.memory's ledger), over the model's parameters, so the tensors
kept in fp32 by rule (norms, small tensors; minifloat's rule adds embeddings) are in the average. A tensor subclass
(torchao's OptimState8bit / OptimState4bit / OptimStateFp8) is counted by the plain tensors it wraps (uint8 or FP8
codes, fp32 block scales, its code map), never by its logical fp32 size.

`--external` adds, in the same process with the same seed, data, schedule, clipping and guard, torchao's AdamW8bit,
AdamW4bit and AdamWFp8 and bitsandbytes' AdamW8bit, with train()'s param groups and betas and otherwise their own
defaults: blocks of 256 (128 for torchao's 4-bit) with an fp32 scale each; fp32 state for tensors under 4096
elements (and, in torchao, for those whose size is not a multiple of the block); embeddings quantized. Each is first
tried for two steps on a CPU nn.Linear; one that does not import or step is recorded as unavailable with the error's
first line. torchao compiles its step (torch.compile, so a C++ compiler); the compilation falls in the first step,
which tokens/s leaves out. Both run on CPU with torch 2.13.0+cpu (torchao 0.18.0, bitsandbytes 0.50.2, which has a
CPU backend). `pip install -e ".[bench]"` installs them and keeps an installed CPU torch; where pip might resolve
torch itself, install them without dependencies:

    pip install --no-deps torchao bitsandbytes   # bitsandbytes also needs numpy and packaging
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.metadata
import json
import pathlib
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import machine  # noqa: E402 - benchmarks/machine.py, beside this script

from minifloat.training import loop
from minifloat.training.config import TrainConfig
from minifloat.training.memory import StorageLedger, tensors_in, unique_params
from minifloat.training.optimizer import ADAMW_BETAS

# (m, v) pairs, "@MASTER" for bf16 weights without an fp32 master (TrainConfig.master): fp32 baseline; ≤ 2 B/param
# candidates; ≤ 1 B/param candidates (4-bit m and v, zero-free 4-bit v); bf16 weights
PAIRS = ("fp32,fp32", "bf16,bf16", "e4m3,bf16", "e4m3,e5m2", "int8,int8-dynamic", "int8-dynamic,int8-dynamic",
         "int8-dynamic,int4", "int8-dynamic,int4-dynamic", "int4-dynamic,int4", "int4-dynamic,int4-dynamic",
         "fp32,fp32@bf16-sr", "fp32,fp32@bf16-kahan")
BASELINE = "fp32,fp32"


@dataclasses.dataclass(frozen=True)
class External:
    """An AdamW of another library, run beside minifloat's.

    Attributes:
        name: the row's label.
        distribution: the pip package it comes in.
        module: the module that defines it.
        cls: its class name.
        tensor_lr: it reads the learning rate as a tensor (torchao: a compiled graph input, so a new value does not
            recompile); train() writes the step's float, so a step pre-hook wraps it.
    """

    name: str
    distribution: str
    module: str
    cls: str
    tensor_lr: bool = False

    def make(self, groups: list[dict], *, lr: float) -> torch.optim.Optimizer:
        """The optimizer over train()'s param groups (their weight decay), with train()'s betas.

        Raises:
            ImportError: the package is not installed or does not import.
        """
        optimizer = getattr(importlib.import_module(self.module), self.cls)(groups, lr=lr, betas=ADAMW_BETAS)
        if self.tensor_lr:
            optimizer.register_step_pre_hook(lr_as_tensor)
        return optimizer

    def version(self) -> str | None:
        """The installed version of its package, None when it is not installed."""
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None


EXTERNAL = (
    External("torchao AdamW8bit", "torchao", "torchao.optim", "AdamW8bit", tensor_lr=True),
    External("torchao AdamW4bit", "torchao", "torchao.optim", "AdamW4bit", tensor_lr=True),
    External("torchao AdamWFp8", "torchao", "torchao.optim", "AdamWFp8", tensor_lr=True),
    External("bitsandbytes AdamW8bit", "bitsandbytes", "bitsandbytes.optim", "AdamW8bit"),
)


def lr_as_tensor(optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
    """Step pre-hook: each group's lr as an fp32 tensor (torchao refuses a float lr)."""
    for group in optimizer.param_groups:
        group["lr"] = torch.as_tensor(group["lr"], dtype=torch.float32)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in optimizer.state (moments or their codes, scales, code maps, step counters), each
    storage once: a code map shared by all parameters (bitsandbytes) counts once. Python numbers count 0."""
    return StorageLedger().add(tensors_in(list(optimizer.state.values())))  # wrapper subclasses by what they wrap


def probe(external: External) -> str | None:
    """None when `external` imports and takes two steps on a CPU nn.Linear (a 131,072-element weight with quantized
    state, a bias with fp32 state); otherwise the reason, in one line. The global RNG is left as it was."""
    try:
        with torch.random.fork_rng(devices=[]):
            layer = torch.nn.Linear(256, 512)
            optimizer = external.make([{"params": list(layer.parameters())}], lr=1e-3)
            for _ in range(2):
                layer(torch.randn(4, 256)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
    except Exception as error:  # noqa: BLE001 - however a third-party package fails here, it does not run here
        return one_line(error)
    return None


def one_line(error: BaseException) -> str:
    """`Type: first line of the message`."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


@contextlib.contextmanager
def training_with(make: Callable[..., torch.optim.Optimizer] | None = None):
    """Within the block, train() builds its run as usual (minifloat.training.loop.build) and the run is appended to
    the yielded list; with `make`, the run trains with make(param groups, lr=config.lr) instead of its own AdamW,
    and the guard watches that optimizer. train() takes no optimizer factory (memory.measure does), so loop.build is
    wrapped for the block only."""
    runs: list[loop.Run] = []
    original = loop.build

    def build(*args, **kwargs) -> loop.Run:
        run = original(*args, **kwargs)
        if make is not None:
            run.optimizer = make(run.stability.param_groups(run.model), lr=run.config.lr)
            run.guard.optimizer = run.optimizer
        runs.append(run)
        return run

    loop.build = build
    try:
        yield runs
    finally:
        loop.build = original


def train_row(config: TrainConfig, make=None) -> dict:
    """Train `config` (with `make`'s optimizer, see training_with); its row of the table."""
    with training_with(make) as runs:
        result = loop.train(config, progress=False)
    run = runs[-1]
    return {"optimizer": type(run.optimizer).__name__,
            "val_loss": result.val_losses[-1][1] if result.val_losses else float("nan"),
            "bytes_per_param": state_bytes(run.optimizer) / unique_params(run.model),
            "tokens_per_s": result.tokens_per_s, "skipped": len(result.skipped)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", default="", help="semicolon list of M,V pairs, each optionally @MASTER (bf16-sr, "
                   "bf16-kahan), e.g. 'fp32,fp32;e4m3,bf16;fp32,fp32@bf16-sr' (default: all; 'none' for only --external)")
    p.add_argument("--external", nargs="?", const="all", default="",
                   help="also torchao's AdamW8bit / AdamW4bit / AdamWFp8 and bitsandbytes' AdamW8bit, where they run; "
                        "a semicolon list of their row names picks some, e.g. 'torchao AdamW8bit;bitsandbytes AdamW8bit'")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--model", default="10m")
    p.add_argument("--preset", default="bf16")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/optimizer_states", help="folder of the runs (one sub-folder per row)")
    p.add_argument("--json", default="", help="write the results to this JSON file")
    machine.add_overwrite(p)
    args = p.parse_args()
    machine.keep_existing(p, args, "json")
    pairs = [] if args.pairs == "none" else [s.strip() for s in args.pairs.split(";") if s.strip()] or list(PAIRS)
    externals = pick_externals(args.external)
    if args.threads:
        torch.set_num_threads(args.threads)

    def config(row: str, folder: str) -> TrainConfig:
        pair, _, master = row.partition("@")
        return TrainConfig(master=master or "fp32", model=args.model, preset=args.preset, steps=args.steps, batch_size=16, seq_len=128,
                           lr=1e-3, min_lr=1e-4, warmup=50, eval_every=args.steps, eval_batches=32,
                           max_bytes=4_000_000, checkpoint_every=0, seed=args.seed, optimizer_state=pair,
                           out=f"{args.out}/{folder}-s{args.seed}", overwrite=args.overwrite, device="cpu")

    def folder(row: str) -> str:
        return row.replace(",", "_").replace("@", "-").replace(" ", "_")

    rows_planned = pairs + [e.name for e in externals]
    machine.keep_runs(p, args, [f"{args.out}/{folder(row)}-s{args.seed}" for row in rows_planned])
    rows = {}
    for pair in pairs:
        rows[pair] = train_row(config(pair, folder(pair)))
        print(pair, rows[pair], flush=True)
    versions = {"torch": torch.__version__}
    for external in externals:
        versions[external.distribution] = external.version()
        reason = probe(external)
        if reason is not None:
            rows[external.name] = {"unavailable": reason}
        else:  # the runs build torch's AdamW (fp32,fp32), which the external optimizer replaces before any step
            rows[external.name] = train_row(config(BASELINE, folder(external.name)), external.make)
        print(external.name, rows[external.name], flush=True)

    print_table(rows, args, versions)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": machine.describe(), "rows": rows, "torch": torch.__version__, "versions": versions}, f,
                      indent=1)
    return 0


def pick_externals(spec: str) -> list[External]:
    """The external optimizers `--external` names: none for "", all for "all", else a semicolon list of row names."""
    if spec in ("", "all"):
        return list(EXTERNAL) if spec else []
    by_name = {e.name: e for e in EXTERNAL}
    names = [n.strip() for n in spec.split(";") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"--external: unknown {unknown}; choose from {list(by_name)}")
    return [by_name[n] for n in names]


def print_table(rows: dict[str, dict], args, versions: dict[str, str | None]) -> None:
    """The rows as a table, with val loss and tokens/s relative to the fp32,fp32 row (added to each row)."""
    base = rows.get(BASELINE, {})
    print(f"\n{args.model} Llama, {args.steps} steps, preset {args.preset}, seed {args.seed}; "
          f"{machine.line()}; "
          + ", ".join(f"{name} {version or 'not installed'}" for name, version in versions.items()))
    print(f"{'m,v / optimizer':<28} {'B/param':>8} {'val loss':>9} {'vs fp32':>8} {'tok/s':>7} {'× fp32':>7}")
    for name, r in rows.items():
        if "unavailable" in r:
            print(f"{name:<28} unavailable: {r['unavailable']}")
            continue
        r["rel_diff_vs_fp32"] = ratio(r["val_loss"], base.get("val_loss")) - 1
        r["speed_vs_fp32"] = ratio(r["tokens_per_s"], base.get("tokens_per_s"))
        print(f"{name:<28} {r['bytes_per_param']:>8.3f} {r['val_loss']:>9.4f} {r['rel_diff_vs_fp32']:>+8.2%} "
              f"{r['tokens_per_s']:>7,.0f} {r['speed_vs_fp32']:>7.2f}")


def ratio(value: float, base: float | None) -> float:
    """value / base, NaN without a base."""
    return value / base if base else float("nan")


if __name__ == "__main__":
    sys.exit(main())
