"""export_hf of Hugging Face transformers models (minifloat.inference.hf_models): prepared for FP8 inference or
trained with minifloat, written under the model's own names and config in the serving layouts, and read back by
transformers' from_pretrained (on a CPU it dequantizes block FP8 to bf16 linears: their weights are asserted
exactly). Before 2026-12-02 export_hf refused every model but minifloat's reference Llama.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

import minifloat as mf
from minifloat.inference import hf
from minifloat.inference.export import export_hf
from minifloat.inference.experts import expert_layer_names
from minifloat.inference.layers import Fp8InferenceLinear
from minifloat.numerics.formats import E4M3
from minifloat.numerics.quantize import quantize, sqnr_db

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints only with accelerate")

# from_pretrained's model (weights rounded to E4M3 blocks, activations in bf16) against the fp32 original; E4M3's
# single-cast SQNR is ~28 dB, and the measured figure on this model is 27.4 dB
WEIGHT_ONLY_LOGITS_SQNR_FLOOR_DB = 24.0


def tiny(tied: bool = True):
    torch.manual_seed(0)  # sizes at most 128 or multiples of it: transformers' CPU block dequantization is exact
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                                      max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))


def fp8_layers(model) -> dict[str, torch.nn.Module]:
    """The prepared linear layers, less those holding MoE experts' matrices (tests/test_moe_inference.py)."""
    inside = expert_layer_names(model)
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8InferenceLinear) and n not in inside}


def test_a_prepared_model_exports_as_block_fp8_that_transformers_reads(tmp_path):
    original = tiny()
    prepared = mf.prepare_inference(copy.deepcopy(original), recipe=mf.BlockScaling())
    out = export_hf(prepared, tmp_path / "block", format="hf-fp8-block")
    config = json.loads((out / hf.CONFIG_FILE).read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is True  # the head was kept: still the embedding
    quant = config["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == [128, 128]
    assert set(quant["ignored_layers"]) == {"lm_head", *(f"model.layers.0.self_attn.{p}_proj" for p in "qkv")}
    tensors = load_file(out / hf.WEIGHTS_FILE)
    assert "lm_head.weight" not in tensors and not any("fp8_state" in k or k.endswith(".input_scale") for k in tensors)
    layers = fp8_layers(prepared)
    assert layers and all(tensors[f"{n}.weight"].dtype == torch.float8_e4m3fn for n in layers)
    for name, layer in layers.items():  # the stored FP8 bytes, as they are
        assert torch.equal(tensors[f"{name}.weight"].view(torch.uint8), layer.weight.view(torch.uint8))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    for name, layer in layers.items():
        assert torch.equal(theirs.get_submodule(name).weight, layer.dequantized_weight().to(torch.bfloat16)), name
    with torch.no_grad():
        reference, loaded = original(input_ids=ids()).logits, theirs(input_ids=ids()).logits.float()
    assert sqnr_db(reference, loaded) >= WEIGHT_ONLY_LOGITS_SQNR_FLOOR_DB


def test_a_quantized_head_unties_the_export(tmp_path):
    prepared = mf.prepare_inference(tiny(tied=True), recipe=mf.BlockScaling(), keep_first_last=False)
    assert isinstance(prepared.lm_head, Fp8InferenceLinear)
    out = export_hf(prepared, tmp_path / "e", format="hf-fp8-block")
    assert json.loads((out / hf.CONFIG_FILE).read_text())["tie_word_embeddings"] is False
    tensors = load_file(out / hf.WEIGHTS_FILE)
    assert tensors["lm_head.weight"].dtype == torch.float8_e4m3fn and "model.embed_tokens.weight" in tensors
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(theirs.lm_head.weight, prepared.lm_head.dequantized_weight().to(torch.bfloat16))


def test_a_model_trained_with_minifloat_exports_its_delayed_input_scales(tmp_path):
    model = mf.convert(tiny(tied=False).train(), recipe=mf.DelayedScaling())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(3):
        batch = ids(step)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    out = export_hf(model.eval(), tmp_path / "fp8", format="hf-fp8")  # activations "auto": the delayed scales
    config = json.loads((out / hf.CONFIG_FILE).read_text())
    assert config["quantization_config"]["activation_scheme"] == "static"
    assert config["quantization_config"]["expert_dtype"] == hf.TRANSFORMERS_REFUSAL
    tensors = load_file(out / hf.WEIGHTS_FILE)
    trained = {n: m for n, m in model.named_modules() if isinstance(m, mf.Fp8Linear)}
    assert trained and not any("fp8_state" in k for k in tensors)
    for name, layer in trained.items():
        assert tensors[f"{name}.weight"].dtype == torch.float8_e4m3fn
        assert tensors[f"{name}.weight_scale"].shape == () and tensors[f"{name}.input_scale"].shape == ()
        # the scale the layer's FP8 forward used for its input: 1 / its delayed input multiplier
        delayed = layer.fp8_state.scale[0].reciprocal()
        assert torch.equal(tensors[f"{name}.input_scale"], delayed.float().reshape(())), name


def test_a_plain_export_of_a_prepared_model_holds_its_dequantized_weights(tmp_path):
    prepared = mf.prepare_inference(tiny(), recipe=mf.CurrentScaling(granularity="row"))
    out = export_hf(prepared, tmp_path / "bf16", format="hf")
    assert "quantization_config" not in json.loads((out / hf.CONFIG_FILE).read_text())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    for name, layer in fp8_layers(prepared).items():
        assert theirs.get_submodule(name).weight.dtype == torch.bfloat16
        assert torch.equal(theirs.get_submodule(name).weight, layer.dequantized_weight().to(torch.bfloat16)), name


def test_a_peft_model_is_told_to_merge_first(tmp_path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny(), peft.LoraConfig(r=16, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="merge_and_unload"):
        export_hf(model, tmp_path / "e", format="hf-fp8-block")
    assert not (tmp_path / "e").exists()


_SIZES = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64)
# fused projections (Phi-3's qkv_proj and gate_up_proj), biases (Qwen2's q/k/v, OPT's), an encoder (BERT), an
# encoder-decoder whose embedding three modules share (T5: written once, tied again on load)
ARCHITECTURES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_SIZES, num_key_value_heads=2)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_SIZES, num_key_value_heads=2, pad_token_id=0)),
    "bert": ("BertConfig", "BertForMaskedLM", _SIZES),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(vocab_size=128, hidden_size=128, ffn_dim=256, num_hidden_layers=2,
                                                num_attention_heads=4, max_position_embeddings=64,
                                                word_embed_proj_dim=128)),
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(vocab_size=128, d_model=128, d_kv=32, d_ff=256,
                                                          num_layers=2, num_heads=4)),
}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_other_architectures_export_block_fp8_that_transformers_reads(tmp_path, arch):
    config_name, class_name, fields = ARCHITECTURES[arch]
    config = getattr(transformers, config_name)(**fields)
    torch.manual_seed(0)
    model_class = getattr(transformers, class_name)
    original = model_class(config).eval()
    prepared = mf.prepare_inference(copy.deepcopy(original), recipe=mf.BlockScaling())
    layers = fp8_layers(prepared)
    assert layers
    theirs = model_class.from_pretrained(export_hf(prepared, tmp_path / arch, format="hf-fp8-block")).eval()
    for name, layer in layers.items():
        assert torch.equal(theirs.get_submodule(name).weight, layer.dequantized_weight().to(torch.bfloat16)), name
    batch = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    inputs = dict(input_ids=batch, **({"decoder_input_ids": batch} if arch == "t5" else {}))
    with torch.no_grad():
        reference, loaded = original(**inputs).logits, theirs(**inputs).logits.float()
    assert sqnr_db(reference, loaded) >= WEIGHT_ONLY_LOGITS_SQNR_FLOOR_DB


# ---- minifloat export --hf DIR ------------------------------------------------------------------------------------

@pytest.fixture
def model_folder(tmp_path):
    """A Hugging Face model folder as save_pretrained writes it, with a tokenizer.json beside it."""
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path / "model"
    tiny(tied=False).save_pretrained(folder)
    tokenizers.Tokenizer(tokenizers.models.BPE()).save(str(folder / hf.TOKENIZER_FILE))
    return folder


def test_cli_exports_a_model_folder_in_block_fp8(model_folder, tmp_path, capsys):
    from minifloat.cli import main

    assert main(["export", "--hf", str(model_folder), "--format", "hf-fp8-block", "--out", str(tmp_path / "o")]) == 0
    assert "wrote" in capsys.readouterr().out
    out = tmp_path / "o"
    assert (out / hf.TOKENIZER_FILE).read_bytes() == (model_folder / hf.TOKENIZER_FILE).read_bytes()
    # what the Python API gives for the same folder: the model prepared with BlockScaling, exported
    prepared = mf.prepare_inference(transformers.AutoModelForCausalLM.from_pretrained(model_folder).eval(),
                                    recipe=mf.BlockScaling())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out)
    layers = fp8_layers(prepared)
    assert len(layers) == 11  # 14 linears less the first block's q/k/v (the head, untied, is kept too: 15 - 4)
    for name, layer in layers.items():
        assert torch.equal(theirs.get_submodule(name).weight, layer.dequantized_weight().to(torch.bfloat16)), name


@pytest.mark.parametrize("case", ["both", "neither", "not-a-model", "quantized", "calibrate", "static"])
def test_cli_refuses_a_bad_model_folder_in_one_line(model_folder, tmp_path, capsys, case):
    from minifloat.cli import main

    if case == "quantized":
        assert main(["export", "--hf", str(model_folder), "--format", "hf-fp8-block", "--out",
                     str(tmp_path / "q")]) == 0
        capsys.readouterr()
    args = {"both": ["--hf", str(model_folder), "--run", str(tmp_path)], "neither": [],
            "not-a-model": ["--hf", str(tmp_path / "nothing")], "quantized": ["--hf", str(tmp_path / "q")],
            "calibrate": ["--hf", str(model_folder), "--calibrate", "4"],
            "static": ["--hf", str(model_folder), "--format", "hf-fp8", "--activations", "static"]}[case]
    expected = {"both": "name one source", "neither": "name one source", "not-a-model": "not a Hugging Face model",
                "quantized": "already quantized", "calibrate": "--calibrate N and --data DIR go together",
                "static": "--activations static needs scales"}[case]
    assert main(["export", *args, "--out", str(tmp_path / "o")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], lines
    assert not (tmp_path / "o").exists()


@pytest.fixture
def calibration_folder(tmp_path):
    """A model folder whose tokenizer.json is a byte-level BPE trained on the standard library's json package, and
    that package's sources as the calibration text."""
    import glob
    import os
    import shutil

    tokenizers = pytest.importorskip("tokenizers")
    text = tmp_path / "text"
    text.mkdir()
    for path in sorted(glob.glob(os.path.join(os.path.dirname(json.__file__), "*.py"))):
        shutil.copy(path, text)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    folder = tmp_path / "model"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(p) for p in sorted(text.iterdir())], trainer)
    tokenizer.save(str(folder / hf.TOKENIZER_FILE))
    return folder, text


def test_cli_calibrates_a_model_folder_on_text(calibration_folder, tmp_path):
    from minifloat.cli import main
    from minifloat.inference import hf_models

    folder, text = calibration_folder
    assert main(["export", "--hf", str(folder), "--format", "hf-fp8", "--calibrate", "2", "--data", str(text),
                 "--out", str(tmp_path / "o")]) == 0
    config = json.loads((tmp_path / "o" / hf.CONFIG_FILE).read_text())
    assert config["quantization_config"]["activation_scheme"] == "static"
    tensors = load_file(tmp_path / "o" / hf.WEIGHTS_FILE)
    # the Python API on the same folder and text: the scales prepare_inference calibrates
    model = hf_models.load_pretrained(folder)
    batches = hf_models.folder_calibration(folder, text, 2, model)
    assert len(batches) == 2 and tuple(batches[0].shape) == (hf_models.CALIBRATION_BATCH, 256)
    prepared = mf.prepare_inference(model, recipe=mf.CurrentScaling(), calibration=batches, activations="static")
    layers = fp8_layers(prepared)
    assert layers
    for name, layer in layers.items():
        assert torch.equal(tensors[f"{name}.input_scale"], layer.input_scale.float().reshape(())), name
        assert torch.equal(tensors[f"{name}.weight"].view(torch.uint8), layer.weight.view(torch.uint8)), name


@pytest.mark.parametrize("case", ["no-data", "data-without-calibrate", "data-with-run", "block"])
def test_cli_calibration_options_are_checked_in_one_line(calibration_folder, tmp_path, capsys, case):
    from minifloat.cli import main

    folder, text = calibration_folder
    args = {"no-data": ["--hf", str(folder), "--format", "hf-fp8", "--calibrate", "2"],
            "data-without-calibrate": ["--hf", str(folder), "--format", "hf-fp8", "--data", str(text)],
            "data-with-run": ["--run", str(tmp_path), "--data", str(text)],
            "block": ["--hf", str(folder), "--format", "hf-fp8-block", "--calibrate", "2", "--data", str(text)]}[case]
    expected = {"no-data": "go together", "data-without-calibrate": "go together", "data-with-run": "--data is for --hf",
                "block": "does not store"}[case]
    assert main(["export", *args, "--out", str(tmp_path / "o")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], lines
    assert not (tmp_path / "o").exists()


def test_cli_never_exports_over_the_model_folder_it_reads(model_folder, capsys):
    """--out DIR --overwrite on the --hf folder itself would have replaced the user's model by the export."""
    from minifloat.cli import main

    before = {p.name: p.read_bytes() for p in model_folder.iterdir()}
    assert main(["export", "--hf", str(model_folder), "--format", "hf-fp8-block", "--out", str(model_folder),
                 "--overwrite"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "is the model folder --hf reads" in lines[0], lines
    assert {p.name: p.read_bytes() for p in model_folder.iterdir()} == before


# ---- checkpoint layout: MoE experts -------------------------------------------------------------------------------

MOE = {"mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_SIZES, num_key_value_heads=2, num_local_experts=4,
                                                              num_experts_per_tok=2)),
       "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(_SIZES, num_key_value_heads=2, num_experts=4,
                                                                  num_experts_per_tok=2, moe_intermediate_size=128,
                                                                  shared_expert_intermediate_size=256))}


@pytest.mark.parametrize("arch", sorted(MOE))
def test_moe_experts_are_exported_in_the_checkpoint_layout(tmp_path, arch):
    """transformers holds a Mixtral's experts as stacked 3-D parameters but saves (and the Hub and vLLM hold) one
    matrix per expert: the export writes what save_pretrained writes, bit for bit in bf16, and reads back."""
    config_name, class_name, fields = MOE[arch]
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(getattr(transformers, config_name)(**fields)).to(torch.bfloat16).eval()
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / hf.WEIGHTS_FILE)
    assert any(".experts.0." in k for k in saved)  # the per-expert layout this test is about
    plain = load_file(export_hf(model, tmp_path / "plain", format="hf") / hf.WEIGHTS_FILE)
    assert set(plain) == set(saved) and all(torch.equal(plain[k], saved[k]) for k in saved)
    prepared = mf.prepare_inference(copy.deepcopy(model), recipe=mf.BlockScaling())
    out = export_hf(prepared, tmp_path / "block", format="hf-fp8-block")
    block = load_file(out / hf.WEIGHTS_FILE)
    layers = fp8_layers(prepared)
    assert layers and all(block[f"{n}.weight"].dtype == torch.float8_e4m3fn and f"{n}.weight_scale_inv" in block
                          for n in layers)
    experts = {k for k in saved if ".experts." in k}
    assert {k for k in block if ".experts." in k} == experts | {k + "_scale_inv" for k in experts}
    raw = load_file(export_hf(model, tmp_path / "raw", format="hf-fp8-block") / hf.WEIGHTS_FILE)
    for key in experts:  # an unprepared model's expert matrices quantized as its linears' weights are
        q = quantize(saved[key].float(), E4M3, granularity="block")
        assert torch.equal(raw[key].view(torch.uint8), q.data.view(torch.uint8)), key
        assert torch.equal(raw[key + "_scale_inv"], q.scale.float()), key
    assert not any("experts" in n for n in json.loads((out / hf.CONFIG_FILE).read_text())["quantization_config"]
                   ["ignored_layers"])
    theirs = getattr(transformers, class_name).from_pretrained(out).eval()
    for name, layer in layers.items():
        assert torch.equal(theirs.get_submodule(name).weight, layer.dequantized_weight().to(torch.bfloat16)), name
    for name, module in theirs.named_modules():  # transformers stacks the dequantized expert matrices back
        if hasattr(module, "gate_up_proj"):
            prefix = next(k for k in experts if k.startswith(name.replace(".mlp.", ".block_sparse_moe.")
                                                          if arch == "mixtral" else name)).split(".experts.")[0]
            for e in range(module.num_experts):
                gate, up = (f"{prefix}.experts.{e}.{p}.weight" for p in (("w1", "w3") if arch == "mixtral"
                                                                         else ("gate_proj", "up_proj")))
                expected = torch.cat([dequantized(block, gate), dequantized(block, up)])
                assert torch.equal(module.gate_up_proj[e], expected.to(torch.bfloat16)), (name, e)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference, loaded = prepared(ids).logits.float(), theirs(ids).logits.float()
    assert sqnr_db(reference, loaded) >= WEIGHT_ONLY_LOGITS_SQNR_FLOOR_DB


def dequantized(tensors: dict, key: str) -> torch.Tensor:
    """An hf-fp8-block weight times its 128×128 block scales, in fp32."""
    scale = tensors[f"{key}_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
    weight = tensors[key].float()
    return weight * scale[:weight.shape[0], :weight.shape[1]]


def moe(arch: str = "mixtral"):
    config_name, class_name, fields = MOE[arch]
    torch.manual_seed(0)
    return getattr(transformers, class_name)(getattr(transformers, config_name)(**fields)).eval()


def test_per_tensor_fp8_exports_each_expert_matrix_with_its_scale(tmp_path):
    model = moe()
    tensors = load_file(export_hf(model, tmp_path / "fp8", format="hf-fp8") / hf.WEIGHTS_FILE)
    stacked = model.model.layers[1].mlp.experts.gate_up_proj.detach()
    for e in range(4):  # w1 is the first half of gate_up_proj's rows, w3 the second (transformers' conversion)
        for key, rows in (("w1", slice(0, 256)), ("w3", slice(256, 512))):
            name = f"model.layers.1.block_sparse_moe.experts.{e}.{key}"
            q = quantize(stacked[e, rows].float().contiguous(), E4M3, granularity="tensor")
            assert torch.equal(tensors[f"{name}.weight"].view(torch.uint8), q.data.view(torch.uint8)), name
            assert tensors[f"{name}.weight_scale"].shape == () and torch.equal(tensors[f"{name}.weight_scale"],
                                                                                 q.scale.float().reshape(()))


def test_a_static_export_keeps_the_experts_and_names_them_for_each_reader(tmp_path, caplog):
    """A static-activation export would need each expert's input scale: the experts stay in the export's dtype and
    are listed in ignored_layers under the checkpoint's names (vLLM) and in modules_to_not_convert under the
    model's (transformers)."""
    model = moe()
    with caplog.at_level("WARNING", logger="minifloat"):
        out = export_hf(model, tmp_path / "static", format="hf-fp8", calibration=[ids(2)])
    tensors = load_file(out / hf.WEIGHTS_FILE)
    assert tensors["model.layers.0.block_sparse_moe.experts.0.w1.weight"].dtype == torch.bfloat16
    assert not any(".experts." in k and "scale" in k for k in tensors)
    assert tensors["model.layers.1.self_attn.q_proj.input_scale"].shape == ()  # the linears are static FP8
    quant = json.loads((out / hf.CONFIG_FILE).read_text())["quantization_config"]
    assert quant["activation_scheme"] == "static"
    assert {f"model.layers.{i}.block_sparse_moe.experts" for i in (0, 1)} <= set(quant["ignored_layers"])
    assert {f"model.layers.{i}.mlp.experts" for i in (0, 1)} <= set(quant["modules_to_not_convert"])
    assert any("keeps 2 MoE experts module(s) in high precision" in r.getMessage() and "input scale" in r.getMessage()
               for r in caplog.records)


def test_a_model_trained_with_fp8_experts_exports_them_in_fp8_and_one_trained_without_keeps_them(tmp_path):
    trained = mf.convert(moe(), recipe=mf.DelayedScaling())
    block = load_file(export_hf(trained, tmp_path / "trained", format="hf-fp8-block") / hf.WEIGHTS_FILE)
    assert block["model.layers.0.block_sparse_moe.experts.2.w2.weight"].dtype == torch.float8_e4m3fn
    assert not any("fp8_state" in k for k in block)
    dense_only = mf.convert(moe(), recipe=mf.DelayedScaling(), filter=lambda name, m: isinstance(m, torch.nn.Linear))
    assert not any(hasattr(m, "fp8_state") and hasattr(m, "num_experts") for m in dense_only.modules())
    out = export_hf(dense_only, tmp_path / "dense", format="hf-fp8-block")
    kept = load_file(out / hf.WEIGHTS_FILE)
    assert kept["model.layers.0.block_sparse_moe.experts.2.w2.weight"].dtype == torch.bfloat16
    assert "model.layers.0.mlp.experts" in json.loads((out / hf.CONFIG_FILE).read_text())["quantization_config"][
        "modules_to_not_convert"]
    theirs = transformers.MixtralForCausalLM.from_pretrained(out).eval()  # transformers reads the kept experts as bf16
    assert torch.equal(theirs.model.layers[0].mlp.experts.down_proj[2],
                       dense_only.model.layers[0].mlp.experts.down_proj[2].detach().to(torch.bfloat16))


def test_cli_exports_a_moe_folder_with_fp8_experts_and_no_contradicting_warning(tmp_path, capsys):
    """`minifloat export --hf` of a Mixtral folder: the experts are written in FP8 (through the whole model: the
    checkpoint layout is converted), and no line says they stay in high precision."""
    from minifloat.cli import main

    folder = tmp_path / "mixtral"
    moe().to(torch.bfloat16).save_pretrained(folder)
    assert main(["export", "--hf", str(folder), "--format", "hf-fp8-block", "--out", str(tmp_path / "o")]) == 0
    captured = capsys.readouterr()
    assert "wrote" in captured.out and "stay in high precision" not in captured.err + captured.out
    tensors = load_file(tmp_path / "o" / hf.WEIGHTS_FILE)
    assert tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight_scale_inv" in tensors
