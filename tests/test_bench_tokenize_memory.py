"""benchmarks/tokenize_memory.py: its folder and its measurement of a child process's peak memory."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "tokenize_memory.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("tokenize_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_folder_holds_one_large_file_and_four_small_ones(bench, tmp_path):
    size = bench.build_folder(tmp_path / "text", 1)
    files = sorted(p.name for p in (tmp_path / "text").iterdir())
    assert files == ["big.txt", "small0.txt", "small1.txt", "small2.txt", "small3.txt"]
    assert size >= 1_000_000 and size == (tmp_path / "text" / "big.txt").stat().st_size


def test_the_peak_is_the_child_process_own(bench):
    """A run of `minifloat --help` holds at least the interpreter (tens of MiB) and far less than this machine."""
    rss, seconds = bench.peak_rss_mib(["--help"])
    assert 10 < rss < 4096 and seconds > 0


def test_a_failing_run_is_one_clear_exit(bench):
    with pytest.raises(SystemExit, match="minifloat tokenize .* failed"):
        bench.peak_rss_mib(["tokenize", "--data", "/nonexistent-folder", "--out", "/tmp/never-written"])
