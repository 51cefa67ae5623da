"""A lent GPU's session, prepared: each device call as one command, every log under one folder.

Device time is scarce (minutes per session, at most 10 per call), so what a call runs is written down here and
checked on any machine (tests/test_gpu_session.py), not composed by hand on the day. A call is a list of steps, each
a command with its own time limit; the limits of a call add up to less than one call's 10 minutes. Every step's
output goes to OUT/<step>.log, and a summary (each step's exit status, seconds and pytest's last line) to
OUT/summary.txt and the screen.

    call 1  the autotuned large casts, the in-launch amax records racing on real programs, the GPU tier's part no
            GPU has run yet (tests/test_gpu_training.py), and the eager benchmark with the profiler (host time,
            syncs and Python per run: the 100m question first)
    call 2  eager CUDA-graph replays of FP8 layers, the optimizer-state and no-sync tests, and CUDA graphs
            (reduce-overhead) for the host-bound 100m step
    call 3  sibling layers sharing their input's cast, the inference tier, the Llama-3-8B shapes compiled, FP8 where
            it pays (a later session's)

A step that reaches its limit is interrupted first (SIGINT, GRACE_S before the limit), so pytest still prints which
tests failed and why, and a benchmark keeps the rows it saved.

Usage (on the GPU machine, from the repository root; $OUT is the folder whose files come back):
    python3 -m pip install --no-deps --no-build-isolation -e . && python3 benchmarks/gpu_session.py 1 --out $OUT
    python3 benchmarks/gpu_session.py 2 --out $OUT
    python benchmarks/gpu_session.py 1 --dry-run          # print the commands, run nothing (any machine)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
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
        # the autotuned large casts (new since the last GPU run) in their own step, before the records' 15 cases
        # (83 s on the H200) could use up a shared limit
        Step("large-cast", 45, _pytest("-m", "gpu", "tests/test_gpu_numerics.py", "-k", "large_cast")),
        Step("records", 100, _pytest("-m", "gpu", "tests/test_gpu_numerics.py", "-k", "recording_its_amax")),
        # ~40-60 s of compiling per case on an H100: the three fullgraph cases and delayed's CUDA graphs
        Step("compiled", 180, _pytest("-m", "gpu", "--durations=20", "tests/test_gpu_training.py", "-k",
                                      "(compiled_model and fullgraph) or (cuda_graphs and delayed)")),
        # the host-bound 100m first (the question this call asks), the GEMM ceiling left out (measured twice)
        Step("bench-eager", 135, _bench("--sections", "100m,linear,llama8b", "--variants",
                                        "delayed,current,row,block", "--no-compile", "--profile",
                                        "{out}/profile.txt", "--json", "{out}/gpu_eager.json", "--overwrite")),
    ),
    2: (
        # since 2026-12-07: an eager FP8 model's forward and backward captured with torch.cuda.graph and replayed
        # (no host cache frozen into the graph: minifloat.core.capture), never run on a GPU
        Step("eager-graphs", 60, _pytest("-m", "gpu", "tests/test_gpu_training.py", "-k",
                                         "eager_graph_replays and (delayed or current)")),
        # the host-bound 100m step with eager FP8 layers replayed from a CUDA graph, bf16 likewise (issue 21's 0.9x)
        Step("bench-eager-graphs", 90, _bench("--sections", "100m", "--variants", "delayed,current", "--no-compile",
                                              "--cuda-graphs", "--json", "{out}/gpu_eager_graphs.json",
                                              "--overwrite")),
        Step("optim", 40, _pytest("-m", "gpu", "tests/test_gpu_training.py", "-k",
                                  "optimizer or master or stochastic")),
        Step("no-sync", 60, _pytest("-m", "gpu", "tests/test_gpu_training.py", "-k", "synchronise")),
        # compiled only (call 1 measured the eager rows): bf16 and delayed under CUDA graphs, the budget read from
        # the bf16 run's own compile time
        Step("bench-graphs", 170, _bench("--sections", "100m", "--variants", "delayed", "--compile-variants",
                                         "delayed", "--compiled-only", "--compile-mode", "reduce-overhead",
                                         "--budget-s", "165", "--json", "{out}/gpu_graphs.json", "--overwrite")),
    ),
    3: (
        # since 2026-12-07: q/k/v and gate/up sharing their input's cast on the device's kernels, bitwise unshared
        Step("shared-input", 60, _pytest("-m", "gpu", "tests/test_gpu_training.py", "-k", "shared_input")),
        # since 2026-11-28: NVFP4 inference layers (per-token global scales through torch.ldexp), never run on a GPU
        Step("inference", 90, _pytest("-m", "gpu", "tests/test_gpu_inference.py")),
        Step("bench-compiled", 260, _bench("--sections", "llama8b", "--variants", "delayed,current",
                                           "--compile-variants", "delayed,current", "--compiled-only", "--budget-s",
                                           "255", "--json", "{out}/gpu_compiled.json", "--overwrite")),
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


GRACE_S = 15  # a step at its limit gets SIGINT this long before it (pytest then prints its failures), then SIGKILL


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_step(argv: list[str], log: pathlib.Path, timeout_s: int, env: dict) -> int:
    """Run one step's command under its limit. At `timeout_s - GRACE_S` it is interrupted (SIGINT: pytest reports what
    failed so far, a benchmark has saved its rows), at `timeout_s` killed; 124 then, as timeout(1) says."""
    with log.open("w") as f:
        # SIGINT at its default in the step: a shell runs a background job (`cmd &`) with SIGINT ignored, which the
        # step would inherit, and then the interrupt below would do nothing
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                preexec_fn=_default_sigint)
        try:
            return proc.wait(timeout=max(timeout_s - GRACE_S, 1))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return 124


def run_call(number: int, out: pathlib.Path) -> int:
    """Run call `number`'s steps in order, each under its time limit; returns 0 when every step exited 0."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    rows, worst = [], 0
    for step in CALLS[number]:
        log = out / f"{step.name}.log"
        t0 = time.monotonic()
        code = run_step(command(step, out), log, step.timeout_s, env)
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
