"""Recorded healthy runs for the spike guard's tests: per-step loss and gradient norm of real trainings.

tests/data/guard_healthy_traces.json holds, for each run, the loss and the total gradient norm (before clipping) of
every step, as `StepGuard.check` saw them, rounded to 4 significant digits (the spike rule compares ratios of 5×, so
the rounding, at most 0.05%, cannot change a verdict). The runs were trained with the spike guard off, so a trace is
the run that never skips, whatever rule is replayed on it; a rule that skips nothing on the trace leaves the real run
bitwise unchanged.

Regenerate (hours on 2 CPU cores, for the 10m runs):

    python tests/guard_traces.py                 # every run in RUNS
    python tests/guard_traces.py tiny-2000-bf16  # one of them, the others kept
"""

from __future__ import annotations

import csv
import dataclasses
import json
import pathlib
import sys
import tempfile
from unittest import mock

TRACES = pathlib.Path(__file__).parent / "data" / "guard_healthy_traces.json"
DIGITS = 4

# name -> (the command the trace reproduces, the TrainConfig fields over compare.DEFAULT_CONFIG or TrainConfig())
COMPARE = "minifloat compare"
TRAIN_2000 = "minifloat train --model tiny --preset bf16 --steps 2000"
CONVERGENCE_10M = "python benchmarks/convergence.py --model 10m --seeds 0"
TEN_M = dict(model="10m", steps=600, batch_size=16, seq_len=128, warmup=50, eval_every=600, eval_batches=32,
             max_bytes=4_000_000)
RUNS = {
    **{f"compare-{p}": (COMPARE, "compare", dict(preset=p))
       for p in ("bf16", "fp8-delayed", "fp8-current", "fp8-block", "mxfp8")},
    "tiny-2000-bf16": (TRAIN_2000, "train", dict(steps=2000)),
    "10m-bf16": (CONVERGENCE_10M, "train", dict(TEN_M, preset="bf16")),
    "10m-fp8-current": (CONVERGENCE_10M, "train", dict(TEN_M, preset="fp8-current")),
}


def load() -> dict[str, dict]:
    """name -> {"command", "config", "loss", "grad_norm"}."""
    return json.loads(TRACES.read_text())["runs"]


def record(name: str) -> dict:
    """Train run `name` with the spike guard off and return its trace."""
    from minifloat.safety.guards import GuardConfig, StepGuard
    from minifloat.training.compare import DEFAULT_CONFIG
    from minifloat.training.config import TrainConfig
    from minifloat.training.loop import train

    command, base, fields = RUNS[name]
    base = DEFAULT_CONFIG if base == "compare" else TrainConfig()
    guard_init = StepGuard.__init__

    def without_spike_guard(self, model, optimizer, *, config=None, stateful=None):
        config = dataclasses.replace(config or GuardConfig(), spike_signals=())
        guard_init(self, model, optimizer, config=config, stateful=stateful)

    with tempfile.TemporaryDirectory() as tmp:
        config = dataclasses.replace(base, **fields, out=tmp, overwrite=True, checkpoint_every=0)
        with mock.patch.object(StepGuard, "__init__", without_spike_guard):  # the trainer has no switch for it
            result = train(config, progress=False)
        if result.stopped_by is not None or result.skipped:  # a trace is a whole run, and a healthy one (no NaN)
            raise RuntimeError(f"{name}: stopped by {result.stopped_by}, skipped {result.skipped}; not recorded")
        with open(f"{tmp}/log.csv", newline="") as f:
            rows = list(csv.DictReader(f))
    rounded = lambda key: [float(f"{float(r[key]):.{DIGITS}g}") for r in rows]  # noqa: E731
    return {"command": command, "config": {k: v for k, v in fields.items()}, "loss": rounded("loss"),
            "grad_norm": rounded("grad_norm")}


def save(runs: dict[str, dict]) -> None:
    about = ("per-step loss and gradient norm (before clipping) of healthy runs, spike guard off, 4 significant "
             "digits; made by `python tests/guard_traces.py`, replayed by tests/test_guards.py")
    lines = [f'  "{n}": {json.dumps(r, separators=(",", ":"))}' for n, r in runs.items()]
    TRACES.write_text('{"about": ' + json.dumps(about) + ',\n "runs": {\n' + ",\n".join(lines) + "\n}}\n")


def main(names: list[str]) -> None:
    runs = load() if TRACES.exists() else {}
    for name in names or list(RUNS):
        runs[name] = record(name)
        save({n: runs[n] for n in RUNS if n in runs})  # after each run: the 10m runs take an hour each
        print(f"recorded {name}: {len(runs[name]['loss'])} steps", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
