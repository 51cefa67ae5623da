"""A lent GPU's session, prepared: each device call as one command, every log under one folder.

Device time is scarce (minutes per session, at most 10 per call), so what a call runs is written down here and
checked on any machine (tests/test_gpu_session.py), not composed by hand on the day. A call is a list of steps, each
a command with its own time limit; the limits of a call add up to less than one call's 10 minutes. Every step's
output goes to OUT/<step>.log, and a summary (each step's exit status, seconds and pytest's last line) to
OUT/summary.txt and the screen.

    call 1  the in-launch amax records racing on real programs, the GPU tier's part no GPU has run yet
            (tests/test_gpu_training.py), and the eager benchmark with the profiler (host time, syncs and Python per
            run: the 100m question)
    call 2  the optimizer-state and no-sync tests, and CUDA graphs (reduce-overhead) for the host-bound 100m step
    call 3  the Llama-3-8B shapes compiled (a later session's)

Usage (on the GPU machine, from the repository root; $OUT is the folder whose files come back):
    python3 -m pip install --no-deps --no-build-isolation -e . && python3 benchmarks/gpu_session.py 1 --out $OUT
    python3 benchmarks/gpu_session.py 2 --out $OUT
    python benchmarks/gpu_session.py 1 --dry-run          # print the commands, run nothing (any machine)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import time
from dataclasses import dataclass

CALL_LIMIT_S = 540  # one device call runs at most 600 s; the rest is start-up, install and copying $OUT back
ROOT = pathlib.Path(__file__).resolve().parents[1]  # every step runs from the repository root


@dataclass(frozen=True)
class Step:
    name: str  # the log's name: OUT/<name>.log
    timeout_s: int
    argv: tuple[str, ...]  # run from the repository root; "{out}" becomes the output folder


def _pytest(*args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "pytest", "-v", "-rfE", "--tb=line", *args)


def _bench(*args: str) -> tuple[str, ...]:
    return (sys.executable, "benchmarks/gpu.py", *args)


# Since the session of 2026-11-27 16:00 (H200): the one-pass tests, the in-launch records (15 cases, 83 s: the first
# compiles dominate), activation checkpointing and micro-batches passed there; the compiled tests failed without a
# message before the step's limit (a recompile at step 2, reproduced on the CPU and fixed since). A session gets about
# 15 minutes of device time, the start and a 30 s idle wait included: call 1 (~8 minutes), then at once call 2 (~4).
CALLS: dict[int, tuple[Step, ...]] = {
    1: (
        # what runs natively on this GPU, recipe by recipe (seconds; the table the benchmark's rows depend on)
        Step("gemm-paths", 30, (sys.executable, "-m", "minifloat", "formats", "--gemms")),
        # since 2026-11-28 native dgrad and wgrad write fp32 gradients: each GEMM's output dtype on this GPU
        Step("native-grads", 30, _pytest("-m", "gpu", "tests/test_native_grads.py")),
        Step("records", 120, _pytest("-m", "gpu", "tests/test_gpu_numerics.py", "-k",
                                     "recording_its_amax or large_cast")),
        # ~40-60 s of compiling per case on an H100: the three fullgraph cases and delayed's CUDA graphs
        Step("compiled", 200, _pytest("-m", "gpu", "--durations=20", "tests/test_gpu_training.py", "-k",
                                      "(compiled_model and fullgraph) or (cuda_graphs and delayed)")),
        Step("bench-eager", 150, _bench("--sections", "gemm,linear,llama8b,100m", "--variants",
                                        "delayed,current,row,block", "--no-compile", "--profile",
                                        "{out}/profile.txt", "--json", "{out}/gpu_eager.json", "--overwrite")),
    ),
    2: (
        Step("optim", 70, _pytest("-m", "gpu", "tests/test_gpu_training.py", "-k",
                                  "optimizer or master or stochastic or synchronise")),
        Step("bench-graphs", 160, _bench("--sections", "100m", "--variants", "delayed", "--compile-variants",
                                         "delayed", "--compile-mode", "reduce-overhead", "--budget-s", "150",
                                         "--json", "{out}/gpu_graphs.json", "--overwrite")),
    ),
    3: (
        # since 2026-11-28: NVFP4 inference layers (per-token global scales through torch.ldexp), never run on a GPU
        Step("inference", 90, _pytest("-m", "gpu", "tests/test_gpu_inference.py")),
        Step("bench-compiled", 200, _bench("--sections", "llama8b", "--variants", "delayed,current",
                                           "--compile-variants", "delayed,current", "--budget-s", "180", "--json",
                                           "{out}/gpu_compiled.json", "--overwrite")),
        # since 2026-11-28: FP8 only where mf.where_fp8_pays predicts a gain (the 1b's MLP; none of the 100m's)
        Step("bench-pays", 120, _bench("--sections", "100m,1b", "--variants", "delayed,delayed-pays", "--no-compile",
                                       "--json", "{out}/gpu_pays.json", "--overwrite")),
    ),
}


def command(step: Step, out: pathlib.Path) -> list[str]:
    return [a.replace("{out}", str(out)) for a in step.argv]


def last_line(log: pathlib.Path) -> str:
    """pytest's summary line (or the log's last line): what the step came to, in a few words."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    summary = [line for line in lines if line.startswith("=") and (" passed" in line or " failed" in line)]
    return (summary or lines or ["(no output)"])[-1][:200]


def run_call(number: int, out: pathlib.Path) -> int:
    """Run call `number`'s steps in order, each under its time limit; returns 0 when every step exited 0."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    rows, worst = [], 0
    for step in CALLS[number]:
        log = out / f"{step.name}.log"
        t0 = time.monotonic()
        with log.open("w") as f:
            try:
                code = subprocess.run(command(step, out), stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                      timeout=step.timeout_s).returncode
            except subprocess.TimeoutExpired:
                code = 124
        seconds = time.monotonic() - t0
        worst = worst or code
        rows.append(f"{step.name:15s} exit {code:3d} {seconds:6.0f} s  {last_line(log)}")
        print(rows[-1], flush=True)
    (out / "summary.txt").write_text("\n".join(rows) + "\n")
    return 0 if worst == 0 else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("call", type=int, choices=sorted(CALLS), help="which device call to run")
    p.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_session"),
                   help="folder for the logs and results (default: $OUT, else runs/gpu_session)")
    p.add_argument("--dry-run", action="store_true", help="print the commands and their time limits, run nothing")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out).resolve()  # (the steps run from the repository root)
    if args.dry_run:
        for step in CALLS[args.call]:
            print(f"[{step.timeout_s:3d} s] {step.name}: {' '.join(command(step, out))}")
        return 0
    return run_call(args.call, out)


if __name__ == "__main__":
    sys.exit(main())
