"""The machine a benchmark ran on, in words: CPU model (read from /proc/cpuinfo, which platform.processor() leaves
empty on Linux), its bfloat16 features, core count, torch and its thread count. Every figure in docs/benchmarks.md
is a ratio within one run, but which CPU it ran on decides what the ratio means (AMX-BF16 makes bfloat16 GEMMs ~14x
faster than fp32; AVX512-BF16 far less), so each benchmark's JSON records this."""

from __future__ import annotations

import os
import pathlib
import platform

import torch

BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_model() -> str:
    """The CPU's model name, or the architecture where /proc/cpuinfo says nothing."""
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """Which of BF16_FLAGS the CPU reports."""
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    flags = set()
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return [f for f in BF16_FLAGS if f in flags]


def describe() -> dict:
    """{cpu, bf16_flags, cores, torch, threads, python}."""
    return {"cpu": cpu_model(), "bf16_flags": cpu_flags(), "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version()}


def line() -> str:
    """describe() in one line, for a printed table's heading."""
    d = describe()
    return (f"{d['cpu']} ({', '.join(d['bf16_flags']) or 'no bf16 extensions'}), {d['cores']} cores, "
            f"torch {d['torch']} on {d['threads']} thread(s)")


def add_overwrite(parser) -> None:
    """The --overwrite flag every benchmark with output files takes (keep_existing reads it)."""
    parser.add_argument("--overwrite", action="store_true",
                        help="replace what exists: output files (--json, --markdown), and run folders where the "
                             "benchmark trains")


def keep_runs(parser, args, folders) -> None:
    """Stop with one line (exit status 2) before any work when a run folder the benchmark would train into already
    holds a run (minifloat.training.rundir.RUN_ITEMS) and --overwrite was not given: earlier runs are a person's
    results, which a benchmark never replaces on its own."""
    from minifloat.training.rundir import run_items

    held = [str(f) for f in folders if pathlib.Path(f).is_dir() and run_items(pathlib.Path(f))]
    if held and not getattr(args, "overwrite", False):
        more = f" and {len(held) - 1} more" if len(held) > 1 else ""
        parser.exit(2, f"{parser.prog}: error: {held[0]}{more} already hold(s) a run; choose another --out, or add "
                       f"--overwrite to replace the runs\n")


def keep_existing(parser, args, *names: str) -> None:
    """Stop with one line (exit status 2) before any work when an output path args.<name> exists and --overwrite
    was not given: a benchmark never replaces a file a person already has, such as a recorded docs/bench_*.json."""
    for name in names:
        path = getattr(args, name, None)
        if path and pathlib.Path(path).exists() and not getattr(args, "overwrite", False):
            parser.exit(2, f"{parser.prog}: error: --{name.replace('_', '-')} {path} exists; choose another path, "
                           f"or add --overwrite to replace it\n")


def child_peak(argv: list[str]) -> tuple[float, float, int, str]:
    """(peak resident memory in MiB, wall seconds, exit status, the tail of its stderr) of `python ARGV`, run by a
    fresh helper process whose only child it is, so that the helper's RUSAGE_CHILDREN maximum is this run's."""
    import subprocess
    import sys

    probe = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
             "r = subprocess.run([sys.executable, *sys.argv[1:]], capture_output=True, text=True); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, time.perf_counter() - t, r.returncode); "
             "sys.stderr.write(r.stderr[-3000:] if r.returncode else '')")
    out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, check=True)
    kib, seconds, code = out.stdout.split()
    return int(kib) / 1024, float(seconds), int(code), out.stderr
