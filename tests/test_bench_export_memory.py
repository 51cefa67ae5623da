"""benchmarks/export_memory.py: its model folder, its check that the two exports agree, and (slow) a whole run."""

from __future__ import annotations

import json
import pathlib
import runpy
import subprocess
import sys
import types

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "export_memory.py"
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bench():
    return types.SimpleNamespace(**runpy.run_path(str(SCRIPT)))  # its functions, without running main()


def test_the_folder_is_a_sharded_bf16_llama(bench, tmp_path):
    params = bench.build(tmp_path / "m", layers=2, dim=128, vocab=256, shard_size="100KB")
    files = sorted(p.name for p in (tmp_path / "m").glob("*.safetensors"))
    assert len(files) > 1 and (tmp_path / "m" / "model.safetensors.index.json").is_file()
    stored = sum((tmp_path / "m" / f).stat().st_size for f in files)
    assert stored >= 2 * params  # bf16: two bytes a parameter, plus the headers


def test_the_moe_folder_stores_each_expert_matrix(bench, tmp_path):
    params = bench.build(tmp_path / "m", layers=2, dim=128, vocab=256, shard_size="100KB", experts=4)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 4
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in index and params > 4 * 3 * 128 * 352 * 2


def test_a_difference_between_the_exports_is_caught(bench, tmp_path):
    import torch
    from safetensors.torch import save_file

    for name, value in (("a", 1.0), ("b", 1.0), ("c", 2.0)):
        (tmp_path / name).mkdir()
        save_file({"w": torch.full((4,), value)}, tmp_path / name / "model.safetensors")
    assert bench.same_tensors(tmp_path / "a", tmp_path / "b")
    assert not bench.same_tensors(tmp_path / "a", tmp_path / "c")


@pytest.mark.slow
def test_a_whole_run_reports_both_ways(tmp_path):
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, str(SCRIPT), "--layers", "1", "--dim", "128", "--vocab", "256", "--shard-size",
                    "100KB", "--json", str(out)], check=True, capture_output=True, text=True, timeout=600)
    result = json.loads(out.read_text())
    assert set(result["rows"]) == {"streamed", "whole model"} and result["files"] > 1
    assert all(r["peak_rss_mib"] > 10 and r["seconds"] > 0 for r in result["rows"].values())
