"""Every benchmark that writes result files keeps a file that is already there: it stops before measuring anything,
with one line naming the path and the fix (--overwrite), and exit status 2. One child process runs every script's
command line in turn (runpy), so the scripts' import-time settings stay out of the test process."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
# script: the output flags it takes. gpu.py refuses on its own (tests/test_bench_gpu.py).
OUTPUTS = {"cast_routes": ("--json",), "column_amax": ("--json",), "convergence": ("--json", "--markdown"),
           "distributed": ("--json",), "export_memory": ("--json",), "fp4_convergence": ("--json",), "generate": ("--json",),
           "minilm_inference": ("--json",), "optimizer_states": ("--json",), "peak_memory": ("--json",),
           "requantize": ("--json",), "shared_input": ("--json",), "step_time": ("--json", "--markdown"),
           "tokenize_memory": ("--json",)}

DRIVER = textwrap.dedent("""
    import contextlib, io, json, runpy, sys
    results = []
    for script, *argv in json.loads(sys.argv[1]):
        sys.argv = [script, *argv]
        err = io.StringIO()
        code = "no exit"
        with contextlib.redirect_stderr(err):
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as e:
                code = e.code
            except BaseException as e:  # a crash is a result too: the test names it
                code = f"raised {type(e).__name__}: {e}"
        results.append([script, argv, code, err.getvalue()])
    print(json.dumps(results))
""")


def run_driver(cases: list[list[str]], cwd: pathlib.Path) -> list:
    """[script, argv, exit code, stderr] for each [script, *argv], run one after another in one child process."""
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300, cwd=cwd)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    return results


def test_every_benchmark_keeps_an_existing_output_file(tmp_path):
    cases = []
    for script, flags in OUTPUTS.items():
        for flag in flags:
            path = tmp_path / f"{script}{flag.replace('-', '_')}.out"
            path.write_text("recorded by hand\n")
            cases.append([str(BENCH / f"{script}.py"), flag, str(path)])
    assert {p.stem for p in BENCH.glob("*.py")} >= set(OUTPUTS)
    for (script, (flag, _), code, err), (_, _, path) in zip(run_driver(cases, tmp_path), cases):
        name = pathlib.Path(script).name
        assert code == 2, f"{name} {flag}: {code!r}\n{err}"
        lines = err.strip().splitlines()
        assert len(lines) == 1 and path in lines[0] and "--overwrite" in lines[0], f"{name} {flag}: {err!r}"
        assert pathlib.Path(path).read_text() == "recorded by hand\n", name


def test_overwrite_lets_a_benchmark_past_the_check(tmp_path):
    """With --overwrite the same command goes on to its own work (here: an argument error after the check)."""
    path = tmp_path / "r.json"
    path.write_text("old\n")
    done = subprocess.run([sys.executable, str(BENCH / "step_time.py"), "--json", str(path), "--overwrite",
                           "--steps", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--steps must be >= 1" in done.stderr and "exists" not in done.stderr
    assert path.read_text() == "old\n"


# script, its arguments (OUT is the run root), the run folder under OUT an earlier invocation left
RUN_CASES = [
    ("optimizer_states", ["--pairs", "fp32,fp32;e4m3,bf16@bf16-sr", "--model", "tiny", "--steps", "1"],
     "e4m3_bf16-bf16-sr-s0"),
    ("fp4_convergence", ["--variants", "bf16,nvfp4", "--seeds", "0"], "seed0/nvfp4"),
    ("fp4_convergence", ["--throughput-steps", "1"], "throughput/seed0/bf16"),
    ("convergence", ["--model", "tiny", "--steps", "1", "--presets", "bf16,fp8-delayed"], "seed0/fp8-delayed"),
    ("convergence", ["--model", "tiny", "--throughput-steps", "1", "--compile"], "throughput/bf16-compiled"),
]


def test_every_training_benchmark_keeps_earlier_runs(tmp_path):
    """A benchmark that trains into run folders under --out stops, before training anything, when one of the folders
    it would train into holds a run (here a log.csv written by hand): one line naming it and --overwrite, exit 2,
    the run's files as they were."""
    cases = []
    for i, (script, argv, held) in enumerate(RUN_CASES):
        run = tmp_path / f"out{i}" / held
        run.mkdir(parents=True)
        (run / "log.csv").write_text("step,loss\n1,5.5\n")
        cases.append([str(BENCH / f"{script}.py"), *argv, "--out", str(tmp_path / f"out{i}")])
    for (script, argv, code, err), (_, _, held), i in zip(run_driver(cases, tmp_path), RUN_CASES, range(99)):
        run = tmp_path / f"out{i}" / held
        lines = err.strip().splitlines()
        assert code == 2, f"{script} {argv}: {code!r}\n{err}"
        assert len(lines) == 1 and "--overwrite" in lines[-1] and held.split("/")[-1] in lines[-1], (script, err)
        assert (run / "log.csv").read_text() == "step,loss\n1,5.5\n", script
        assert sorted(p.name for p in run.iterdir()) == ["log.csv"], script
