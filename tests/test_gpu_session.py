"""benchmarks/gpu_session.py, the prepared device calls, checked on any machine: each call fits one device call's
time, every pytest step selects tests that exist, every benchmark step's arguments are ones benchmarks/gpu.py takes,
and running a call writes each step's log and a summary (a step past its limit is stopped and reported)."""

import importlib.util
import json
import pathlib
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name: str):
    """benchmarks/<name>.py as a module (registered, as its dataclasses need, under a name of its own)."""
    key = f"benchmarks_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


session = _load("gpu_session")


@pytest.mark.parametrize("number", sorted(session.CALLS))
def test_a_call_fits_one_device_call(number):
    steps = session.CALLS[number]
    assert sum(s.timeout_s for s in steps) <= session.CALL_LIMIT_S < 600
    assert len({s.name for s in steps}) == len(steps), "two steps would write the same log"


# Collects each step's selection with pytest.main in one child process (torch and the test modules imported once),
# printing a JSON list of [exit code, selected test ids, output tail] per step.
COLLECT = """
import contextlib, io, json, sys
import pytest
results = []
for args in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *args])
    lines = out.getvalue().splitlines()
    results.append([int(code), [line for line in lines if "::" in line], "\\n".join(lines[-20:])])
print(json.dumps(results))
"""


def test_each_pytest_step_selects_existing_tests(tmp_path):
    steps = [s for c in session.CALLS.values() for s in c if "pytest" in s.argv]
    selections = []
    for step in steps:
        argv = session.command(step, tmp_path)
        files = [a for a in argv if a.startswith("tests/")]
        assert files and all((ROOT / f).exists() for f in files), (step.name, files)
        selections.append([a for a in argv[3:] if a not in ("-v", "-rfE", "--tb=line")
                           and not a.startswith("--durations")])
    done = subprocess.run([sys.executable, "-c", COLLECT, json.dumps(selections)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == len(steps)
    for step, (code, selected, tail) in zip(steps, results):
        assert code == 0 and selected, f"{step.name}: exit {code}, nothing selected\n{tail}"


@pytest.mark.parametrize("step", [s for c in session.CALLS.values() for s in c if "benchmarks/gpu.py" in s.argv],
                         ids=lambda s: s.name)
def test_each_benchmark_step_is_a_valid_gpu_py_command(step, tmp_path):
    bench = _load("gpu")
    argv = session.command(step, tmp_path)
    args = bench.parse_args(argv[2:])
    known = {v.name for v in bench.VARIANTS}
    assert {v for v in args.variants.split(",") if v} | set(args.compile_variants) <= known | {"all"}
    cases = bench.plan(args, [bench.BASELINE, *[v for v in args.variants.split(",") if v]])
    wanted = {bench.BASELINE, *args.compile_variants}
    if args.compile_variants:  # every variant asked to compile is planned, in every section asked
        assert {(c.section, c.variant) for c in cases if c.compiled} == {
            (s, v) for s in args.sections for v in wanted if s in bench.LLAMA_SECTIONS or not v.endswith("-pays")}
    assert str(tmp_path) in args.json, "the results must land in the call's output folder"


def test_running_a_call_logs_each_step_and_stops_one_past_its_limit(monkeypatch, tmp_path, capsys):
    py = sys.executable
    monkeypatch.setitem(session.CALLS, 9, (
        session.Step("fine", 30, (py, "-c", "print('=== 3 passed in 0.1s ===')")),
        session.Step("slow", 1, (py, "-c", "import time; time.sleep(30)")),
        session.Step("writes", 30, (py, "-c", "import sys; open(sys.argv[1] + '/r.txt', 'w').write('x')", "{out}")),
    ))
    assert session.run_call(9, tmp_path) == 1  # one step failed: the call says so
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert [line.split()[0] for line in summary] == ["fine", "slow", "writes"]
    assert "exit   0" in summary[0] and "3 passed" in summary[0]
    assert "exit 124" in summary[1]
    assert (tmp_path / "r.txt").read_text() == "x" and (tmp_path / "fine.log").exists()
    assert capsys.readouterr().out.count("exit") == 3


def test_dry_run_prints_the_commands_and_runs_nothing(tmp_path, capsys):
    assert session.main(["1", "--dry-run", "--out", str(tmp_path / "o")]) == 0
    printed = capsys.readouterr().out
    assert printed.count("\n") == len(session.CALLS[1]) and str(tmp_path / "o") in printed
    assert not (tmp_path / "o").exists()


def test_a_step_past_its_limit_is_interrupted_first_so_it_can_report(monkeypatch, tmp_path):
    # SIGKILL at the limit lost pytest's summary of failures (printed only at the end of its run): the compiled
    # tests' reasons were lost so on the H200. And a shell starts a background job (`gpu_session.py 1 &`) with SIGINT
    # ignored, which the steps inherited: the interrupt then did nothing, and the step was killed without its report
    monkeypatch.setattr(session, "GRACE_S", 20)
    script = ("import time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n"
              "    print('=== 1 failed, 2 passed in 9s ===', flush=True)\n    raise SystemExit(2)")
    # interrupted at 4 s (a loaded machine may take a second to start Python), killed at 24 s
    monkeypatch.setitem(session.CALLS, 9, (session.Step("slow", 24, (sys.executable, "-c", script)),))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        t0 = time.monotonic()
        assert session.run_call(9, tmp_path) == 1
        seconds = time.monotonic() - t0
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "1 failed, 2 passed" in (tmp_path / "slow.log").read_text()
    assert "exit 124" in (tmp_path / "summary.txt").read_text()
    assert seconds < 20, "the step outlived its interrupt: it was killed at the limit"
