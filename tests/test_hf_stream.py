"""minifloat.inference.hf_stream: a Hugging Face model folder exported shard by shard, without loading the model.

The streamed export must be the whole-model export (`export_hf(prepare_inference(load_pretrained(DIR), recipe))`)
bit for bit, tensors, config.json and generation_config.json, with one output shard per input file; it must read
one input file at a time, never build the model, fall back to the whole model (and say why) where streaming could
read something other than what from_pretrained reads, and keep the export folder's rules (overwrite, errors).
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

import minifloat as mf
from minifloat.inference import hf, hf_models, hf_stream
from minifloat.inference.export import export_hf
from minifloat.inference.export_files import INDEX_FILE

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints only with accelerate")

_SIZES = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64)
# a tied and an untied Llama; biases (Qwen2); an encoder (BERT); one embedding under three names (T5)
ARCHITECTURES = {
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(_SIZES, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_SIZES, num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_SIZES, num_key_value_heads=2)),
    "bert": ("BertConfig", "BertForMaskedLM", _SIZES),
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(vocab_size=128, d_model=128, d_kv=32, d_ff=256,
                                                          num_layers=2, num_heads=4)),
    # MoE: transformers stacks the stored per-expert matrices on load (a converted checkpoint layout)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_SIZES, num_key_value_heads=2, num_local_experts=4,
                                                            num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(_SIZES, num_key_value_heads=2, num_experts=4,
                                                                num_experts_per_tok=2, moe_intermediate_size=128,
                                                                shared_expert_intermediate_size=256)),
}
SHARD_SIZE = "100KB"  # the tiny Llama (~620 kB in bf16) in 8 files


def save_model(folder, arch: str = "llama", *, shard: str | None = SHARD_SIZE, dtype=torch.bfloat16):
    config_name, class_name, fields = ARCHITECTURES[arch]
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(getattr(transformers, config_name)(**fields)).to(dtype)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return folder


def whole_model_export(folder, out, fmt: str):
    model = hf_models.load_pretrained(folder)
    if (recipe := hf_models.FORMAT_RECIPES[fmt]) is not None:
        model = mf.prepare_inference(model, recipe=recipe)
    return export_hf(model, out, format=fmt, activations="dynamic", copy_files=hf_models.tokenizer_files(folder))


def tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def assert_same_export(a, b) -> None:
    ta, tb = tensors(a), tensors(b)
    assert set(ta) == set(tb)
    for key in ta:
        assert ta[key].dtype == tb[key].dtype and torch.equal(bits(ta[key]), bits(tb[key])), key
    for name in (hf.CONFIG_FILE, hf.GENERATION_FILE):
        assert (a / name).is_file() == (b / name).is_file(), name
        if (a / name).is_file():
            assert json.loads((a / name).read_text()) == json.loads((b / name).read_text()), name


@pytest.mark.parametrize("fmt", ["hf", "hf-fp8", "hf-fp8-block"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_streamed_export_is_the_whole_model_export_bit_for_bit(tmp_path, arch, fmt, monkeypatch):
    folder = save_model(tmp_path / "model", arch, shard=SHARD_SIZE if arch == "llama" else None)
    expected = whole_model_export(folder, tmp_path / "whole", fmt)
    monkeypatch.setattr(hf_models, "load_pretrained", lambda *a: pytest.fail("the model was loaded whole"))
    out = hf_stream.export_folder(folder, tmp_path / "streamed", format=fmt)
    assert_same_export(out, expected)
    stored = sorted(p.name for p in folder.glob("*.safetensors"))
    written = sorted(p.name for p in out.glob("*.safetensors"))
    assert written == stored  # one output file per input file, under the same names
    if fmt != "hf":
        assert any(t.dtype == torch.float8_e4m3fn for t in tensors(out).values())


def test_the_folder_is_read_as_the_class_that_saved_it(tmp_path):
    """A BertForMaskedLM folder is a BertForMaskedLM (its config's architectures), not AutoModel's BertModel, which
    would drop the masked-LM head and start a pooler from random numbers, exported as if it were the model."""
    folder = save_model(tmp_path / "model", "bert", shard=None)
    assert type(hf_models.load_pretrained(folder)).__name__ == "BertForMaskedLM"
    out = hf_stream.export_folder(folder, tmp_path / "o", format="hf-fp8-block")
    written = tensors(out)
    assert "cls.predictions.bias" in written and not any(k.startswith("bert.pooler") for k in written)


def test_a_sharded_export_has_an_index_that_transformers_reads(tmp_path):
    folder = save_model(tmp_path / "model")
    out = hf_stream.export_folder(folder, tmp_path / "o", format="hf-fp8-block")
    index = json.loads((out / INDEX_FILE).read_text())
    for name in {*index["weight_map"].values()}:
        assert set(load_file(out / name)) == {k for k, v in index["weight_map"].items() if v == name}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors(out).values())
    expected = transformers.AutoModelForCausalLM.from_pretrained(whole_model_export(folder, tmp_path / "w",
                                                                                    "hf-fp8-block"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out)
    for (name, a), (_, b) in zip(theirs.state_dict().items(), expected.state_dict().items()):
        assert torch.equal(a, b), name


def test_it_reads_one_input_file_at_a_time(tmp_path, monkeypatch):
    """Each output shard is written before the next input file is opened: memory holds one shard, not the model."""
    folder = save_model(tmp_path / "model")
    events = []
    real_open, real_save = hf_stream.safe_open, hf_stream.save_file

    def opened(path, **kwargs):
        events.append(("open", path))
        return real_open(path, **kwargs)

    def saved(out, path, **kwargs):
        events.append(("save", path))
        return real_save(out, path, **kwargs)

    monkeypatch.setattr(hf_stream, "safe_open", opened)
    monkeypatch.setattr(hf_stream, "save_file", saved)
    hf_stream.export_folder(folder, tmp_path / "o", format="hf-fp8")
    writing = events[[e[0] for e in events].index("save") - 1:]  # from the first file read for its tensors on
    assert [e[0] for e in writing] == ["open", "save"] * len(list(folder.glob("*.safetensors")))


def test_a_folder_it_cannot_stream_is_exported_whole_and_says_why(tmp_path, caplog):
    """An fp32 checkpoint whose config says bfloat16: from_pretrained rounds each tensor to bfloat16 first, so a
    stream of the stored fp32 values would quantize other numbers. The whole-model path runs instead."""
    folder = save_model(tmp_path / "model", dtype=torch.float32)
    config = json.loads((folder / hf.CONFIG_FILE).read_text())
    (folder / hf.CONFIG_FILE).write_text(json.dumps({**config, "dtype": "bfloat16"}))
    assert "which from_pretrained loads as torch.bfloat16" in hf_stream.stream_plan(folder, quantize=True)
    with caplog.at_level(logging.INFO, logger="minifloat"):
        out = hf_stream.export_folder(folder, tmp_path / "o", format="hf-fp8-block")
    assert "through the whole model, not shard by shard" in caplog.text
    assert_same_export(out, whole_model_export(folder, tmp_path / "w", "hf-fp8-block"))


def test_a_renamed_tensor_is_not_streamed(tmp_path):
    folder = save_model(tmp_path / "model", shard=None)
    stored = load_file(folder / hf.WEIGHTS_FILE)
    stored["model.norm.gamma"] = stored.pop("model.norm.weight")
    save_file(stored, folder / hf.WEIGHTS_FILE, metadata={"format": "pt"})
    assert "model.norm.weight is not among its stored tensors" in hf_stream.stream_plan(folder, quantize=True)


def test_a_non_finite_weight_is_refused_before_anything_is_written(tmp_path):
    folder = save_model(tmp_path / "model", shard=None)
    stored = load_file(folder / hf.WEIGHTS_FILE)
    stored["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(stored, folder / hf.WEIGHTS_FILE, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj \(1 non-finite\)"):
        hf_stream.export_folder(folder, tmp_path / "o", format="hf-fp8")
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.tmp-*"))


@pytest.mark.parametrize("first, second", [(None, SHARD_SIZE), (SHARD_SIZE, None)])
def test_overwrite_leaves_no_stale_weight_files(tmp_path, first, second):
    """A single-file export replaced by a sharded one (and back): the old weights are gone, or transformers would
    load them (model.safetensors is what it reads first)."""
    one, two = save_model(tmp_path / "a", shard=first), save_model(tmp_path / "b", shard=second)
    out = hf_stream.export_folder(one, tmp_path / "o", format="hf")
    (out / "notes.txt").write_text("mine")
    hf_stream.export_folder(two, out, format="hf-fp8-block", overwrite=True)
    assert sorted(p.name for p in out.glob("model*")) == sorted(p.name for p in two.glob("model*"))
    assert (out / "notes.txt").read_text() == "mine"
    assert_same_export(out, whole_model_export(two, tmp_path / "w", "hf-fp8-block"))


# ---- the command line -----------------------------------------------------------------------------------------------

def test_cli_exports_a_sharded_folder_shard_by_shard(tmp_path, capsys, monkeypatch):
    from minifloat.cli import main

    folder = save_model(tmp_path / "model")
    monkeypatch.setattr(hf_models, "load_pretrained", lambda *a: pytest.fail("the model was loaded whole"))
    assert main(["export", "--hf", str(folder), "--format", "hf-fp8-block", "--out", str(tmp_path / "o")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "o" / INDEX_FILE).is_file()


@pytest.mark.parametrize("damage", ["truncated", "missing-shard"])
def test_cli_names_a_damaged_folder_in_one_line(tmp_path, capsys, damage):
    from minifloat.cli import main

    folder = save_model(tmp_path / "model")
    shard = sorted(folder.glob("model-*.safetensors"))[2]
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        shard.unlink()
    capsys.readouterr()  # save_pretrained's own progress lines
    assert main(["export", "--hf", str(folder), "--format", "hf-fp8", "--out", str(tmp_path / "o")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "transformers cannot load the model" in lines[0], lines
    assert not (tmp_path / "o").exists()


def test_a_moe_folder_streams_its_expert_matrices_as_stored(tmp_path):
    """transformers stacks a Mixtral's per-expert matrices on load; the stream reads them as stored (the checkpoint
    layout the export writes), one input file at a time, and quantizes each as prepare_inference's FP8 experts do
    (the bits: test_a_streamed_export_is_the_whole_model_export_bit_for_bit)."""
    folder = save_model(tmp_path / "model", "mixtral", shard="200KB")
    plan = hf_stream.stream_plan(folder, quantize=True)
    assert isinstance(plan, hf_stream.StreamPlan) and len(plan.files()) > 1
    assert set(plan.sources) == set(tensors(folder))
    assert set(plan.origin["model.layers.0.mlp.experts.gate_up_proj"]) == {
        f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in range(4) for w in ("w1", "w3")}
    out = hf_stream.export_folder(folder, tmp_path / "o", format="hf-fp8-block")
    assert_same_export(out, whole_model_export(folder, tmp_path / "w", "hf-fp8-block"))
    assert tensors(out)["model.layers.1.block_sparse_moe.experts.2.w2.weight"].dtype == torch.float8_e4m3fn


def cache_snapshot(root, repo: str, folder) -> None:
    """`folder`'s files as the Hugging Face cache under `root` holds a download of `repo` (refs/main -> snapshot)."""
    import shutil

    entry = root / f"models--{repo.replace('/', '--')}"
    shutil.copytree(folder, entry / "snapshots" / "0123abc")
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("0123abc")


def test_cli_takes_a_hub_id_from_the_local_cache(tmp_path, capsys, monkeypatch):
    from minifloat.cli import main

    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache_snapshot(tmp_path / "cache", "someone/tiny-llama", save_model(tmp_path / "model"))
    assert main(["export", "--hf", "someone/tiny-llama", "--format", "hf-fp8-block", "--out", str(tmp_path / "o")]) == 0
    assert_same_export(tmp_path / "o", whole_model_export(tmp_path / "model", tmp_path / "w", "hf-fp8-block"))
    capsys.readouterr()
    assert main(["export", "--hf", "someone/absent", "--out", str(tmp_path / "o2")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "neither a folder nor a model in the local Hugging Face cache" in lines[0], lines
