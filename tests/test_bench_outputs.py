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
           "distributed": ("--json",), "fp4_convergence": ("--json",), "generate": ("--json",),
           "minilm_inference": ("--json",), "optimizer_states": ("--json",), "peak_memory": ("--json",),
           "requantize": ("--json",), "step_time": ("--json", "--markdown"), "tokenize_memory": ("--json",)}

DRIVER = textwrap.dedent("""
    import contextlib, io, json, runpy, sys
    results = []
    for script, flag, path in json.loads(sys.argv[1]):
        sys.argv = [script, flag, path]
        err = io.StringIO()
        code = "no exit"
        with contextlib.redirect_stderr(err):
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as e:
                code = e.code
            except BaseException as e:  # a crash is a result too: the test names it
                code = f"raised {type(e).__name__}: {e}"
        results.append([script, flag, code, err.getvalue()])
    print(json.dumps(results))
""")


def test_every_benchmark_keeps_an_existing_output_file(tmp_path):
    cases = []
    for script, flags in OUTPUTS.items():
        for flag in flags:
            path = tmp_path / f"{script}{flag.replace('-', '_')}.out"
            path.write_text("recorded by hand\n")
            cases.append([str(BENCH / f"{script}.py"), flag, str(path)])
    assert {p.stem for p in BENCH.glob("*.py")} >= set(OUTPUTS)
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    for (script, flag, code, err), (_, _, path) in zip(results, cases):
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
