"""Export to Hugging Face (minifloat.inference.export, .hf; `minifloat export`): transformers reads the bf16 / fp32
export and computes our logits; the FP8 layouts (vLLM's per-tensor "fp8", DeepSeek-V3's 128×128 blocks) hold the
documented names, dtypes, shapes and quantization_config, weights within E4M3's rounding error; read back through
minifloat they compute exactly what the FP8 model built from the same quantized weights computes; static input
scales of a run trained with delayed scaling are its own; what transformers (TESTED_TRANSFORMERS, on a CPU) loads
from each FP8 layout, right or wrong, and that the export warns of every wrong load; and the command's one-line
errors.

Models are the tiny reference Llama with random weights (no download); one 2-step FP8 run is trained for the run
folder tests.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import pathlib

import pytest
import torch
from safetensors.torch import load_file, save_file

import minifloat as mf
from minifloat.cli import export as cli_export
from minifloat.cli import main
from minifloat.fp8.recipes import Role
from minifloat.inference import hf
from minifloat.inference.export import export_hf, load_run, quantized_layers, run_calibration
from minifloat.inference.hf import hf_name, llama_config, load_hf_export, minifloat_name, read_hf_export
from minifloat.inference.layers import Fp8InferenceLinear
from minifloat.inference.prepare import prepare_inference
from minifloat.numerics.compiling import eager_kernels
from minifloat.numerics.quantize import quantize, sqnr_db
from minifloat.training.data import ByteCorpus, DataConfig, val_batches
from minifloat.training.loop import TrainConfig, train
from minifloat.training.model import Llama, LlamaConfig

# transformers' fp32 Llama against ours with the same weights: the same maths in another operation order, measured
# max |Δ| 1.5e-7 .. 3.6e-7 on logits up to 2.4 (tiny tied / untied / QK-norm, 128-wide)
FP32_LOGITS_ATOL = 1e-5
# transformers in bf16 (bf16 GEMMs and activations) against our fp32 forward of the same bf16 weights: measured
# 46.3-47.3 dB (the same models; also transformers' dequantized block FP8 against ours: 46.4 dB); one bf16 rounding
# of a tensor is ~50 dB
BF16_LOGITS_SQNR_FLOOR_DB = 40.0
E4M3_REL_ERROR = 2.0 ** -4  # half an ulp of 3 mantissa bits, relative, for normal values
E4M3_SUBNORMAL_ERROR = 2.0 ** -10  # half of E4M3's smallest subnormal 2^-9, times the scale
USER_ERROR = 2
TESTED_TRANSFORMERS = "5.24.0"  # pyproject.toml's dev pin: the release whose behaviour the transformers tests record
ALIGNED = dict(d_model=128, d_ff=256)  # every size a multiple of 128: transformers' block dequantization reads it
FP8 = ("hf-fp8", "hf-fp8-block")
RECIPES = {"hf-fp8": mf.CurrentScaling(), "hf-fp8-block": mf.BlockScaling(power_of_two=False)}
TOKENS = torch.arange(40).reshape(2, 20) * 7 % 256  # (B, T) byte tokens


@pytest.fixture(autouse=True)
def _eager():
    with eager_kernels():  # quantize runs eagerly: compiled and eager agree bitwise, and no compile time here
        yield


def tiny(**overrides) -> Llama:
    """The tiny Llama with random weights, norm gains away from 1 (w and 1 + w conventions differ), non-default
    rope_theta and norm_eps (so the config mapping is exercised)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny", rope_theta=1000.0, norm_eps=1e-6, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def logits(model) -> torch.Tensor:
    """A minifloat Llama's logits on TOKENS, in fp32."""
    with torch.no_grad():
        return model(TOKENS)[0].float()


def transformers_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits.float()


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory) -> str:
    """A 2-step fp8-delayed run of the tiny model with its checkpoint."""
    out = tmp_path_factory.mktemp("runs") / "fp8"
    config = TrainConfig(model="tiny", preset="fp8-delayed", steps=2, batch_size=2, seq_len=32, warmup=1,
                         eval_every=100, eval_batches=1, max_bytes=50_000, checkpoint_every=2, out=str(out))
    with eager_kernels():
        train(config, progress=False)
    return str(out)


# ---- names and config ------------------------------------------------------------------------------------------

NAMES = [
    ("wte.weight", "model.embed_tokens.weight"),
    ("blocks.3.attn_norm.weight", "model.layers.3.input_layernorm.weight"),
    ("blocks.0.attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("blocks.1.attn.k_norm.weight", "model.layers.1.self_attn.k_norm.weight"),
    ("blocks.12.mlp_norm.weight", "model.layers.12.post_attention_layernorm.weight"),
    ("blocks.2.mlp.down_proj", "model.layers.2.mlp.down_proj"),
    ("norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
]


@pytest.mark.parametrize("ours, theirs", NAMES, ids=[n[0] for n in NAMES])
def test_names_map_both_ways(ours, theirs):
    assert hf_name(ours) == theirs and minifloat_name(theirs) == ours


@pytest.mark.parametrize("bad", ["wte_x.weight", "model.layers.0.self_attn.q_proj.weight", "transformer.h.0"])
def test_names_outside_the_reference_llama_are_refused(bad):
    with pytest.raises(ValueError, match="reference Llama"):
        hf_name(bad)


# (name, config.json change, words of the error)
UNSUPPORTED = [
    ("kv-heads-not-a-divisor", {"num_key_value_heads": 3}, "num_key_value_heads"),
    ("bias", {"attention_bias": True}, "attention_bias"),
    ("gelu", {"hidden_act": "gelu"}, "hidden_act"),
    ("rope scaling", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope"),
    ("other model", {"architectures": ["MistralForCausalLM"]}, "architectures"),
]


@pytest.mark.parametrize("name, change, words", UNSUPPORTED, ids=[c[0] for c in UNSUPPORTED])
def test_configs_our_llama_cannot_express_are_refused(name, change, words):
    config = hf.hf_config(LlamaConfig.preset("tiny"), dtype="bfloat16")
    assert llama_config(config) == LlamaConfig.preset("tiny")
    with pytest.raises(ValueError, match=words):
        llama_config({**config, **change})


# ---- bf16 / fp32 exports read by transformers -----------------------------------------------------------------

VARIANTS = {"tied": {}, "untied": {"tie_embeddings": False}, "qk-norm": {"qk_norm": True},
            "gqa": {"n_kv_head": 2, "tie_embeddings": False}}  # transformers' repeat_kv pairs heads as we do


@pytest.mark.parametrize("variant", VARIANTS)
def test_transformers_computes_our_logits(transformers, tmp_path, variant):
    model = tiny(**VARIANTS[variant])
    export_hf(model, tmp_path / "fp32", dtype="float32")
    export_hf(model, tmp_path / "bf16")
    config = json.loads((tmp_path / "bf16" / hf.CONFIG_FILE).read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM" if variant == "qk-norm" else "LlamaForCausalLM"]
    assert "quantization_config" not in config

    assert llama_config(config) == model.config  # num_key_value_heads and back
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32").eval()
    assert theirs.config.rope_parameters["rope_theta"] == 1000.0 and theirs.config.rms_norm_eps == 1e-6
    assert theirs.config.num_key_value_heads == model.config.kv_heads
    assert theirs.dtype == torch.float32
    assert torch.allclose(transformers_logits(theirs), logits(model), rtol=0, atol=FP32_LOGITS_ATOL)

    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").eval()
    assert theirs.dtype == torch.bfloat16
    ours = load_hf_export(tmp_path / "bf16")  # our fp32 forward of the same bf16 weights
    assert sqnr_db(logits(ours), transformers_logits(theirs)) >= BF16_LOGITS_SQNR_FLOOR_DB


@pytest.mark.parametrize("tied, n_kv_head", [(True, None), (False, None), (False, 1)], ids=["tied", "untied", "mqa"])
def test_bf16_export_has_hugging_face_names_and_dtypes(tmp_path, tied, n_kv_head):
    model = tiny(tie_embeddings=tied, n_kv_head=n_kv_head)
    export_hf(model, tmp_path / "out")
    tensors = read_hf_export(tmp_path / "out")
    stored = load_file(str(tmp_path / "out" / hf.WEIGHTS_FILE))
    expected = {hf_name(k) for k in model.state_dict()} - ({"lm_head.weight"} if tied else set())
    assert set(stored) == expected  # a tied head is embed_tokens (tie_word_embeddings), as save_pretrained writes it
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    assert tensors.format.name == "hf" and not tensors.quantized
    assert (tmp_path / "out" / hf.GENERATION_FILE).is_file()
    reloaded = load_hf_export(tmp_path / "out")
    assert reloaded.config == model.config
    for key, p in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], p.to(torch.bfloat16).float()), key


# ---- FP8 layouts ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_layout_names_dtypes_shapes_and_config(tmp_path, fmt):
    model = tiny()
    layers = quantized_layers(model)
    kept = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
            "lm_head"]  # the first block's q/k/v and the head stay high precision (fp8_plan's rule)
    assert sorted(hf_name(n) for n in layers) == sorted(
        hf_name(n) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and hf_name(n) not in kept)
    export_hf(model, tmp_path / "out", format=fmt, activations="dynamic")
    config = json.loads((tmp_path / "out" / hf.CONFIG_FILE).read_text())
    block = fmt == "hf-fp8-block"
    assert config["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128] if block else None, "ignored_layers": kept, "modules_to_not_convert": kept,
        **({} if block else {"expert_dtype": hf.TRANSFORMERS_REFUSAL})}  # transformers refuses hf-fp8 with it
    stored = load_file(str(tmp_path / "out" / hf.WEIGHTS_FILE))
    scale_name = "weight_scale_inv" if block else "weight_scale"
    for name in layers:
        prefix = hf_name(name)
        w, scale = model.get_submodule(name).weight.detach(), stored[f"{prefix}.{scale_name}"]
        out, k = w.shape
        assert stored[f"{prefix}.weight"].dtype == torch.float8_e4m3fn and stored[f"{prefix}.weight"].shape == w.shape
        assert scale.dtype == torch.float32
        assert scale.shape == ((math.ceil(out / 128), math.ceil(k / 128)) if block else ())
        assert f"{prefix}.input_scale" not in stored
        # the one rounding path, bit for bit
        q = quantize(w, mf.E4M3, granularity="block" if block else "tensor")
        assert torch.equal(stored[f"{prefix}.weight"].view(torch.uint8), q.data.view(torch.uint8))
        # dequantized = weight · scale (per 128×128 block): within E4M3's rounding of the original
        s = q.expanded_scale()
        approx = stored[f"{prefix}.weight"].float() * s
        assert torch.all((approx - w).abs() <= E4M3_REL_ERROR * w.abs() + E4M3_SUBNORMAL_ERROR * s), name
    high = [n for n in stored if not n.endswith(("weight_scale", "weight_scale_inv"))
            and minifloat_name(n).removesuffix(".weight") not in layers]
    assert {stored[n].dtype for n in high} == {torch.bfloat16}  # embeddings, norms and kept linears


# the block layout has dynamic activations only (test_static_needs_a_source)
@pytest.mark.parametrize("fmt, activations, n_kv_head", [
    ("hf-fp8", "dynamic", None), ("hf-fp8", "static", None), ("hf-fp8-block", "dynamic", None),
    ("hf-fp8-block", "dynamic", 2)], ids=["fp8-dynamic", "fp8-static", "block", "block-gqa"])
def test_fp8_export_reloads_as_the_fp8_model(tmp_path, fmt, activations, n_kv_head):
    model = tiny(n_kv_head=n_kv_head)
    batches = [TOKENS[:, :16], TOKENS[:, 4:]]
    calibration = batches if activations == "static" else None
    export_hf(model, tmp_path / "out", format=fmt, dtype="float32", calibration=calibration, activations=activations)
    export = read_hf_export(tmp_path / "out")
    assert bool(export.input_scales) == (activations == "static")

    # FP8 layers: the model prepare_inference builds from the same weights and calibration computes the same
    reloaded = load_hf_export(tmp_path / "out")
    assert {n for n, m in reloaded.named_modules() if isinstance(m, Fp8InferenceLinear)} == set(export.quantized)
    prepared = prepare_inference(copy.deepcopy(model), recipe=RECIPES[fmt], activations=activations,
                                 calibration=calibration)
    assert torch.equal(logits(reloaded), logits(prepared))

    # dequantized weights in plain layers: the model whose weights are quantize(W).dequantize()
    dequantized = load_hf_export(tmp_path / "out", fp8=False)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name in export.quantized:
            w = reference.get_submodule(name).weight
            w.copy_(quantize(w, mf.E4M3, granularity=RECIPES[fmt].spec(Role.WEIGHT).granularity).dequantize())
    assert torch.equal(logits(dequantized), logits(reference))


def test_prepared_model_exports_its_stored_weights_and_static_scales(tmp_path):
    model = tiny()
    prepared = prepare_inference(copy.deepcopy(model), recipe=mf.CurrentScaling(), activations="static",
                                 calibration=[TOKENS])
    export_hf(prepared, tmp_path / "out", format="hf-fp8", dtype="float32")
    assert json.loads((tmp_path / "out" / hf.CONFIG_FILE).read_text())["quantization_config"][
        "activation_scheme"] == "static"
    assert torch.equal(logits(load_hf_export(tmp_path / "out")), logits(prepared))
    export_hf(prepared, tmp_path / "bf16", dtype="float32")  # the hf layout holds the dequantized weights
    layer = prepared.blocks[1].mlp.up_proj
    assert torch.equal(load_hf_export(tmp_path / "bf16").blocks[1].mlp.up_proj.weight, layer.dequantized_weight())


@pytest.mark.parametrize("fmt", FP8)
def test_a_tied_model_prepared_with_its_head_quantized_exports_that_head(tmp_path, fmt):
    # keep_first_last=False quantizes the head of a tied Llama: hf-fp8-block raised a KeyError, hf-fp8 wrote the
    # tie (the full-precision embedding as head) and neither the quantized head nor its name under ignored_layers
    prepared = prepare_inference(tiny(), recipe=RECIPES[fmt], keep_first_last=False)
    export_hf(prepared, tmp_path / "out", format=fmt, dtype="float32")
    config = json.loads((tmp_path / "out" / hf.CONFIG_FILE).read_text())
    assert config["tie_word_embeddings"] is False and "lm_head" not in config["quantization_config"]["ignored_layers"]
    stored = load_file(tmp_path / "out" / hf.WEIGHTS_FILE)
    assert stored["lm_head.weight"].dtype == torch.float8_e4m3fn
    assert f"lm_head.{hf.FORMATS[fmt].scale_name}" in stored
    assert torch.equal(logits(load_hf_export(tmp_path / "out")), logits(prepared))


def test_a_per_channel_weight_scale_is_refused_in_one_line(tmp_path):
    export_hf(tiny(), tmp_path / "out", format="hf-fp8", dtype="float32")
    path = tmp_path / "out" / hf.WEIGHTS_FILE
    stored = load_file(path)
    name = "model.layers.1.self_attn.q_proj.weight_scale"
    stored[name] = stored[name].reshape(1, 1).expand(stored[name.replace("_scale", "")].shape[0], 1).contiguous()
    save_file(stored, path)
    with pytest.raises(ValueError, match=rf"{name} has shape \(64, 1\), but this layout's scales are one per "
                                         rf"tensor \(a per-channel"):
        load_hf_export(tmp_path / "out")  # torch's "shape '[]' is invalid for input of size 64"


# ---- run folders and static scales -----------------------------------------------------------------------------


def test_run_export_keeps_the_delayed_input_scales(fp8_run, tmp_path):
    export_hf(fp8_run, tmp_path / "out", format="hf-fp8", dtype="float32")
    trained = load_run(fp8_run)
    export = read_hf_export(tmp_path / "out")
    assert export.format.name == "hf-fp8" and set(export.input_scales) == set(export.quantized)
    for name, scale in export.input_scales.items():  # what the FP8 forward quantized its input with
        assert torch.equal(scale, 1.0 / trained.get_submodule(name).fp8_state.scale_for(Role.INPUT)), name
    prepared = prepare_inference(trained, recipe=mf.CurrentScaling(), activations="static")
    assert torch.equal(logits(load_hf_export(tmp_path / "out")), logits(prepared))


def test_a_run_exports_in_fp8_exactly_the_layers_it_trained_in_fp8(tmp_path):
    """A run whose --keep-blocks kept its last block in BF16 (so do the 4-bit presets) exported that block in FP8
    anyway: the export followed prepare_inference's choice, not the run's."""
    out = tmp_path / "kept"
    config = TrainConfig(model="tiny", preset="fp8-delayed", keep_blocks=(0, 1), steps=1, batch_size=2, seq_len=32,
                         warmup=1, eval_every=100, eval_batches=1, max_bytes=50_000, out=str(out))
    with eager_kernels():
        train(config, progress=False)
    trained = load_run(str(out))
    fp8 = [name for name, m in trained.named_modules() if isinstance(m, mf.Fp8Linear)]
    assert fp8 and not any(name.startswith("blocks.1.") for name in fp8)
    assert quantized_layers(trained) == fp8
    export_hf(str(out), tmp_path / "export", format="hf-fp8", activations="static")  # the delayed input scales
    assert set(read_hf_export(tmp_path / "export").quantized) == set(fp8)


def test_the_command_line_says_how_to_get_static_scales(tmp_path, capsys):
    """A bf16 run has no activation scales: `export --activations static` says so in the command line's terms
    (--calibrate N, --activations dynamic), not the Python argument's."""
    out = tmp_path / "run"
    config = TrainConfig(model="tiny", preset="bf16", steps=1, batch_size=2, seq_len=32, warmup=1, eval_every=100,
                         eval_batches=1, max_bytes=50_000, out=str(out))
    train(config, progress=False)
    status = main(["export", "--run", str(out), "--out", str(tmp_path / "export"), "--format", "hf-fp8",
                   "--activations", "static"])
    lines = capsys.readouterr().err.splitlines()
    assert status == 2 and len(lines) == 1, lines
    assert "--calibrate N" in lines[0] and "--activations dynamic" in lines[0] and "calibration=" not in lines[0]
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("command", ["export", "generate"])
def test_an_hf_checkpoint_given_as_a_run_is_named_as_one(tmp_path, capsys, command):
    """`--run` of a Hugging Face checkpoint folder (an export, a downloaded model) said the folder had no checkpoint
    and to train the run first."""
    export_hf(tiny(), tmp_path / "exp")
    args = ["--out", str(tmp_path / "out")] if command == "export" else ["--prompt", "hi"]
    status = main([command, "--run", str(tmp_path / "exp"), *args])
    lines = capsys.readouterr().err.splitlines()
    assert status == 2 and len(lines) == 1, lines
    assert "is a Hugging Face checkpoint (config.json), not a run folder" in lines[0]
    assert "from_pretrained" in lines[0] and "load_hf_export" in lines[0]


def test_static_needs_a_source(tmp_path):
    with pytest.raises(ValueError, match="static activation scales need calibration"):
        export_hf(tiny(), tmp_path / "a", format="hf-fp8", activations="static")
    with pytest.raises(ValueError, match="asks for static activation scales, which format 'hf-fp8-block' does not"):
        export_hf(tiny(), tmp_path / "b", format="hf-fp8-block", activations="static")
    with pytest.raises(ValueError, match="only 'hf-fp8'"):
        export_hf(tiny(), tmp_path / "c", format="hf-fp8-block", calibration=[TOKENS])
    with pytest.raises(ValueError, match="calibration gives static activation scales, which activations='dynamic' "
                                         "does not write"):  # read and silently ignored before
        export_hf(tiny(), tmp_path / "e", format="hf-fp8", activations="dynamic", calibration=[TOKENS])
    assert not (tmp_path / "e").exists()
    export_hf(tiny(), tmp_path / "d", format="hf-fp8")  # auto: no scales to be had, so dynamic
    assert not read_hf_export(tmp_path / "d").input_scales
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_an_existing_export_is_refused_untouched_and_replaced_only_on_request(tmp_path, caplog):
    """A non-empty folder is refused; with overwrite=True the new export's files replace the earlier export's, and
    every other file stays: the user's own, and a tokenizer the new export does not write (an earlier export's, or
    one the user copied there), which a warning names."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_hf(tiny(), out)
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    (out / hf.TOKENIZER_FILE).write_text("{}")  # an earlier export's tokenizer, or the user's own
    (out / hf.WEIGHTS_FILE).write_bytes(b"old weights")
    with caplog.at_level(logging.WARNING, logger="minifloat"):
        export_hf(tiny(), out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(["mine.txt", hf.CONFIG_FILE, hf.GENERATION_FILE,
                                                             hf.WEIGHTS_FILE, hf.TOKENIZER_FILE])
    assert (out / "mine.txt").read_text() == "keep me" and (out / hf.TOKENIZER_FILE).read_text() == "{}"
    assert f"keeps {hf.TOKENIZER_FILE}, which this export does not write" in caplog.text
    assert read_hf_export(out) and (out / hf.WEIGHTS_FILE).read_bytes() != b"old weights"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left behind
    with pytest.raises(ValueError, match=r"reference Llama or a transformers model, got a Linear; "
                                         r".*save_pretrained.*mf\.save_quantized"):
        export_hf(torch.nn.Linear(16, 16), tmp_path / "other")
    mine = tmp_path / "mine"  # files under an export's names, but no earlier export: overwrite replaced them
    mine.mkdir()
    (mine / hf.CONFIG_FILE).write_text('{"mine": 1}')
    with pytest.raises(FileExistsError, match=f"holds {hf.CONFIG_FILE} but no {hf.WEIGHTS_FILE}, so not an earlier"):
        export_hf(tiny(), mine, overwrite=True)
    assert (mine / hf.CONFIG_FILE).read_text() == '{"mine": 1}'


def test_a_run_that_kept_every_layer_in_bf16_exports_none_in_fp8(tmp_path):
    # --fp8-layers auto kept all of the tiny model's layers in BF16 (none pays at 64 tokens): with no Fp8Linear
    # left, the export fell back to prepare_inference's plan and quantized 11 layers the run never trained in FP8
    out = tmp_path / "run"
    config = TrainConfig(model="tiny", preset="fp8-delayed", fp8_layers="auto", steps=2, batch_size=2, seq_len=32,
                         warmup=1, eval_every=100, eval_batches=1, max_bytes=50_000, out=str(out))
    with eager_kernels():
        train(config, progress=False)
    assert quantized_layers(load_run(out)) == []
    export_hf(out, tmp_path / "export", format="hf-fp8", dtype="float32")
    export = read_hf_export(tmp_path / "export")
    assert export.quantized == {} and "blocks.1.attn.q_proj.weight" in export.tensors


def test_an_export_never_replaces_a_run_or_a_checkpoint(fp8_run, tmp_path):
    """overwrite=True replaces an earlier export, never a training run (its folder) or a checkpoint in it: both are
    refused and left byte for byte as they were."""
    def snapshot(folder):
        return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}

    run = pathlib.Path(fp8_run)
    before = snapshot(run)
    for out in (run, run / "ckpt"):
        with pytest.raises(FileExistsError, match="training run or checkpoint"):
            export_hf(fp8_run, out, overwrite=True)
    assert snapshot(run) == before


# ---- transformers and the FP8 layouts ------------------------------------------------------------------------
# What transformers' from_pretrained does with each FP8 layout on a CPU, asserted exactly: these tests record
# TESTED_TRANSFORMERS (pyproject's dev pin); under another release a failure names what changed, and
# docs/inference.md ("What transformers loads") is updated with the test.


@pytest.fixture(scope="module")
def transformers_fp8(transformers):
    """transformers, with accelerate: without it from_pretrained refuses every FP8 checkpoint (an ImportError)."""
    pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints only with accelerate")
    return transformers


def changed(transformers) -> str:
    return (f"transformers {transformers.__version__} reads this export otherwise than {TESTED_TRANSFORMERS} did: "
            f"update docs/inference.md ('What transformers loads'), the export's warnings and this test")


def minifloat_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "minifloat" and r.levelno == logging.WARNING]


def transformers_block_dequantized(q) -> torch.Tensor:
    """transformers' CPU dequantization of a block FP8 weight (its Fp8Dequantize): the block is size // blocks, not
    the 128 of weight_block_size; fp32 products rounded to bf16."""
    (rows, cols), (blocks_out, blocks_in) = q.data.shape, q.scale.shape
    w = q.data.float().reshape(blocks_out, rows // blocks_out, blocks_in, cols // blocks_in)
    return (w * q.scale[:, None, :, None]).reshape(rows, cols).to(torch.bfloat16)


def test_transformers_dequantizes_the_block_export(transformers_fp8, tmp_path, caplog):
    model = tiny(**ALIGNED)
    with caplog.at_level(logging.WARNING, logger="minifloat"):
        export_hf(model, tmp_path / "out", format="hf-fp8-block")
    assert minifloat_warnings(caplog) == []  # nothing transformers would load wrong
    theirs = transformers_fp8.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ours = load_hf_export(tmp_path / "out", fp8=False)  # dequantized weights, high-precision activations
    for name in quantized_layers(model):  # on a CPU: plain bf16 linears holding weight · weight_scale_inv
        layer = theirs.get_submodule(hf_name(name))
        assert type(layer) is torch.nn.Linear, changed(transformers_fp8)
        assert torch.equal(layer.weight, ours.get_submodule(name).weight.to(torch.bfloat16)), \
            f"{name}: {changed(transformers_fp8)}"
    assert sqnr_db(logits(ours), transformers_logits(theirs)) >= BF16_LOGITS_SQNR_FLOOR_DB


def test_transformers_misplaces_partial_blocks_and_the_export_says_so(transformers_fp8, tmp_path, caplog):
    model = tiny()  # the tiny preset: 64-wide, MLP 176 wide (over 128, not a multiple of it)
    with caplog.at_level(logging.WARNING, logger="minifloat"):
        export_hf(model, tmp_path / "out", format="hf-fp8-block")
    export = read_hf_export(tmp_path / "out")
    ragged = {n for n, q in export.quantized.items() if any(d > 128 and d % 128 for d in q.data.shape)}
    assert ragged == {f"blocks.{i}.mlp.{p}_proj" for i in range(2) for p in ("gate", "up", "down")}
    [warning] = minifloat_warnings(caplog)
    assert f"{len(ragged)} layer(s)" in warning and "misplaces" in warning
    theirs = transformers_fp8.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    for name, q in export.quantized.items():
        weight, right = theirs.get_submodule(hf_name(name)).weight, q.dequantize(torch.float32).to(torch.bfloat16)
        assert torch.equal(weight, transformers_block_dequantized(q)), f"{name}: {changed(transformers_fp8)}"
        assert torch.equal(weight, right) == (name not in ragged), f"{name}: {changed(transformers_fp8)}"


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_transformers_refuses_hf_fp8_in_one_line_and_still_reads_its_config(transformers_fp8, tmp_path, caplog,
                                                                            activations):
    """vLLM's per-tensor names (weight_scale, input_scale) are not transformers' (weight_scale_inv,
    activation_scale): it loaded the E4M3 values unscaled as the weights, without an error (logits -2.4 dB from
    ours). The export's quantization_config carries hf.TRANSFORMERS_REFUSAL as expert_dtype, which transformers'
    FP8 config checks and vLLM's does not read: from_pretrained now stops, naming what to do; AutoConfig, which
    vLLM reads the config with, still loads it; minifloat reads the export back."""
    model = tiny(**ALIGNED)
    calibration = [TOKENS] if activations == "static" else None
    with caplog.at_level(logging.WARNING, logger="minifloat"):
        export_hf(model, tmp_path / "out", format="hf-fp8", activations=activations, calibration=calibration)
    assert minifloat_warnings(caplog) == []
    with pytest.raises(ValueError) as refused:
        transformers_fp8.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert hf.TRANSFORMERS_REFUSAL in str(refused.value), changed(transformers_fp8)
    assert "export hf or hf-fp8-block" in hf.TRANSFORMERS_REFUSAL
    config = transformers_fp8.AutoConfig.from_pretrained(tmp_path / "out")
    assert config.quantization_config["quant_method"] == "fp8" and config.quantization_config["weight_block_size"] is None
    assert bool(read_hf_export(tmp_path / "out").input_scales) == (activations == "static")


# ---- the command ----------------------------------------------------------------------------------------------


def test_cli_formats_are_the_librarys():
    assert cli_export.FORMATS == tuple(hf.FORMATS)


# (format, words of the one warning line on stderr: what transformers would load wrong; None: no line)
CLI_WARNINGS = [
    ("hf", None),
    ("hf-fp8", None),  # transformers refuses it in one line of its own (test_transformers_refuses_hf_fp8_...)
    ("hf-fp8-block", "misplaces"),  # the tiny run's MLP is 176 wide: partial 128×128 blocks
]


@pytest.mark.parametrize("fmt, words", CLI_WARNINGS, ids=[c[0] for c in CLI_WARNINGS])
def test_cli_exports_a_run_and_warns_what_transformers_would_misread(fp8_run, tmp_path, capsys, fmt, words):
    assert main(["export", "--run", fp8_run, "--format", fmt, "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert "wrote" in out
    assert read_hf_export(tmp_path / "out").format.name == fmt
    lines = err.splitlines()
    if words is None:
        assert lines == [], err
    else:
        assert len(lines) == 1 and words in lines[0] and "transformers" in lines[0], err


def test_cli_calibrates_static_input_scales_on_the_runs_validation_batches(fp8_run, tmp_path, capsys):
    batches = run_calibration(fp8_run, 2)
    config = json.loads((pathlib.Path(fp8_run) / "run.json").read_text())["config"]
    corpus = ByteCorpus.load(DataConfig(path=config["data"], max_bytes=config["max_bytes"]))
    expected = [x for x, _ in val_batches(corpus.val, batch_size=2, seq_len=32, max_batches=2)]
    assert len(batches) == 2 and all(torch.equal(a, b) for a, b in zip(batches, expected))
    argv = ["export", "--run", fp8_run, "--format", "hf-fp8", "--calibrate", "2", "--out", str(tmp_path / "cli")]
    assert main(argv) == 0 and "static activations" in capsys.readouterr().out
    export_hf(fp8_run, tmp_path / "api", format="hf-fp8", calibration=batches)
    delayed = export_hf(fp8_run, tmp_path / "delayed", format="hf-fp8")  # the run's own delayed scales
    cli, api = (load_file(tmp_path / d / hf.WEIGHTS_FILE) for d in ("cli", "api"))
    own = load_file(delayed / hf.WEIGHTS_FILE)
    scales = [k for k in cli if k.endswith("input_scale")]
    assert scales and all(torch.equal(cli[k], api[k]) for k in cli)
    assert any(not torch.equal(cli[k], own[k]) for k in scales)  # calibrated, not the training scales
    # more batches than the run's validation split holds: said, not capped silently
    held = len(run_calibration(fp8_run, 10_000))
    argv = ["export", "--run", fp8_run, "--format", "hf-fp8", "--calibrate", "10000", "--out", str(tmp_path / "more")]
    assert main(argv) == 0 and f"holds {held} batch(es)" in capsys.readouterr().out


def one_error_line(capsys, argv) -> str:
    status = main(argv)
    err = capsys.readouterr().err
    assert status == USER_ERROR and err.count("\n") == 1 and err.startswith("minifloat: error:"), err
    assert "Traceback" not in err
    return err


# (name, argv after `export`, words of the error line); {run} and {tmp} are filled in
CLI_ERRORS = [
    ("missing run", ["--run", "{tmp}/nope", "--out", "{tmp}/o"], ["run folder", "does not exist"]),
    ("no checkpoint", ["--run", "{tmp}", "--out", "{tmp}/o"], ["no checkpoint 'latest'"]),
    ("named checkpoint", ["--run", "{run}", "--out", "{tmp}/o", "--checkpoint", "step_9"], ["no checkpoint 'step_9'"]),
    ("existing out", ["--run", "{run}", "--out", "{tmp}/mine"], ["not empty", "pass --overwrite to replace"]),
    ("run as out", ["--run", "{run}", "--out", "{run}", "--overwrite"], ["training run or checkpoint"]),
    ("bad format", ["--run", "{run}", "--out", "{tmp}/o", "--format", "gguf"], ["--format", "'gguf'"]),
    ("bad dtype", ["--run", "{run}", "--out", "{tmp}/o", "--dtype", "fp8"], ["--dtype", "'fp8'"]),
    ("static blocks", ["--run", "{run}", "--out", "{tmp}/o", "--format", "hf-fp8-block", "--activations", "static"],
     ["--activations static asks for static activation scales", "does not store"]),
    ("calibrate zero", ["--run", "{run}", "--out", "{tmp}/o", "--format", "hf-fp8", "--calibrate", "0"],
     ["--calibrate", ">= 1"]),
    ("calibrate blocks", ["--run", "{run}", "--out", "{tmp}/o", "--format", "hf-fp8-block", "--calibrate", "1"],
     ["does not store"]),
    ("calibrate dynamic", ["--run", "{run}", "--out", "{tmp}/o", "--format", "hf-fp8", "--calibrate", "2",
                           "--activations", "dynamic"],
     ["calibration gives static activation scales", "--activations dynamic does not write", "--activations auto"]),
]


@pytest.mark.parametrize("name, argv, words", CLI_ERRORS, ids=[c[0] for c in CLI_ERRORS])
def test_cli_bad_input_is_one_line(fp8_run, tmp_path, capsys, name, argv, words):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    line = one_error_line(capsys, ["export", *[a.format(run=fp8_run, tmp=tmp_path) for a in argv]])
    assert all(w in line for w in words), line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("fmt, activations", [("hf", "auto"), ("hf-fp8", "dynamic")])
def test_cli_refuses_calibrate_before_reading_batches(fp8_run, tmp_path, capsys, monkeypatch, fmt, activations):
    """--calibrate is refused by one rule for every format and scheme that writes no static scales, before the
    run's validation batches are read."""
    def read(*args, **kwargs):
        raise AssertionError("calibration batches were read")

    monkeypatch.setattr("minifloat.inference.export.run_calibration", read)
    line = one_error_line(capsys, ["export", "--run", fp8_run, "--out", str(tmp_path / "o"), "--format", fmt,
                                   "--activations", activations, "--calibrate", "2"])
    assert "calibration gives static activation scales" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("damage", ["weights", "config"])
def test_a_damaged_export_is_one_error_naming_the_file(tmp_path, damage):
    """load_hf_export of a truncated model.safetensors or a garbled config.json raised safetensors' or json's own
    error, naming neither the file nor the fix."""
    export_hf(tiny(), tmp_path / "e", format="hf")
    path = tmp_path / "e" / (hf.WEIGHTS_FILE if damage == "weights" else hf.CONFIG_FILE)
    if damage == "weights":
        path.write_bytes(path.read_bytes()[:1000])
    else:
        path.write_text("{not json")
    with pytest.raises(ValueError, match=rf"{path.name} is .*; export it again \(minifloat export --overwrite\)"):
        load_hf_export(tmp_path / "e")


def test_a_checkpoint_that_is_an_export_names_its_reader(fp8_run, tmp_path):
    # `minifloat generate --checkpoint EXPORT` said the checkpoint was incomplete and offered train --overwrite
    export_hf(tiny(), tmp_path / "exp")
    with pytest.raises(ValueError, match="is a Hugging Face export .*, not a checkpoint of the run.*load_hf_export"):
        load_run(fp8_run, checkpoint=str(tmp_path / "exp"))
