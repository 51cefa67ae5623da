"""benchmarks/shared_input.py runs end to end on a tiny model and records what it measured (no figure is asserted:
the test checks the measurement's shape, and that sharing saved bytes)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "shared_input.py"


def test_the_benchmark_measures_both_settings(tmp_path):
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--batch-size", "2", "--seq-len", "16",
                           "--steps", "1", "--rounds", "1", "--warmup", "1", "--recipes", "current,delayed",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {row["recipe"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"current", "delayed"}
    for row in rows.values():
        assert all(ms > 0 for ms in row["step_ms"].values())
    for row in rows.values():  # q/k/v and gate/up saved one FP8 copy of their input
        assert row["saved_ratio"] < 1.0


def test_an_unknown_recipe_is_refused_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--recipes", "current,bogus"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "bogus" in done.stderr.strip().splitlines()[-1]


def test_sibling_layers_launch_fewer_kernels_on_the_native_path(monkeypatch):
    """benchmarks/launches.py --siblings on the torch path (no Triton here): three layers reading one input launch
    fewer ops with their input's cast shared, under current scaling (the amax and cast passes of two casts against
    a record each); the counts leave out the CPU-only reads a GPU skips."""
    import importlib.util

    bench_dir = SCRIPT.parent
    sys.path.insert(0, str(bench_dir))
    try:
        spec = importlib.util.spec_from_file_location("launches", bench_dir / "launches.py")
        launches = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(launches)
    finally:
        sys.path.remove(str(bench_dir))
    import minifloat as mf

    launches.native_everywhere(set_attr=monkeypatch.setattr, count=False)
    counts = launches.count_siblings(mf.CurrentScaling(), tokens=16, dim=64, n=3)
    assert 0 < counts["shared"] < counts["unshared"]
