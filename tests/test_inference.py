"""FP8 inference (minifloat.inference): weights stored in FP8, outputs against the high-precision model per recipe and
activation mode, calibration, training scales reused, save/load and its validation, Hugging Face models.

SQNR floors are measured on randomly initialised models (seeded) and set a few dB under the measured value.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import minifloat as mf
from minifloat.amp.policy import ISLAND_ATTR, PrecisionPolicy
from minifloat.core import roles
from minifloat.inference import storage
from minifloat.inference.export import export_hf
from minifloat.inference.layers import Fp8InferenceLinear, inference_layers
from minifloat.inference.quantized_io import FORMAT_VERSION
from minifloat.numerics.compiling import eager_kernels
from minifloat.training.checkpoint import MANIFEST_FILE, TENSORS_FILE, save_checkpoint
from minifloat.training.jsonstate import CheckpointError
from minifloat.training.model import Llama, LlamaConfig

RECIPES = {"tensor": mf.CurrentScaling(), "row": mf.CurrentScaling(granularity="row"), "block": mf.BlockScaling(),
           "mx": mf.MXScaling()}
# Logits (Llama) / outputs (MLP) of the FP8 inference model against the same model in fp32, for the inputs below.
# Measured (dynamic / static activations): Llama tiny tensor 34.8 / 34.7, row 35.2 / 34.8, block 35.1 / 35.1,
# mx 35.1 / 35.1; MLP tensor 38.0 / 39.0, row 38.7 / 38.3, block 37.8 / 37.8, mx 37.8 / 37.8 dB. (Power-of-two
# scales, block and mx, leave E4M3's relative rounding unchanged, so their static and dynamic results agree.)
SQNR_FLOOR_DB = {"llama": 32.0, "mlp": 35.0}
# Hugging Face models, per-row recipe: BertModel's last hidden state measured 57.0 / 57.1 dB (the post-norm
# residual stream dominates it), LlamaForCausalLM's logits 29.9 / 29.1 dB (dynamic / static).
HF_SQNR_FLOOR_DB = {"bert": 54.0, "llama": 26.0}
# Weight bytes of the converted layers against bfloat16: 1 byte per element + scales (row: 4 bytes per 256-wide
# row, 0.508; mx: 1 E8M0 byte per 32, 0.516; tensor and block: ~0.500)
MEMORY_RATIO_MAX = 0.52
SEED = 0


@pytest.fixture(autouse=True)
def eager():
    torch.manual_seed(SEED)
    with eager_kernels():  # compiled and eager kernels agree bit for bit (tests/test_quantize.py); skip compile time
        yield


def tiny_llama() -> Llama:
    torch.manual_seed(SEED)
    return Llama(LlamaConfig.preset("tiny")).eval()


def mlp(width: int = 64) -> nn.Sequential:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                         nn.Linear(width, width), nn.GELU(), nn.Linear(width, 16)).eval()


def tokens(n: int = 2) -> list[torch.Tensor]:
    return [torch.randint(0, 256, (2, 16)) for _ in range(n)]


def features(n: int = 2) -> list[torch.Tensor]:
    return [torch.randn(8, 32) for _ in range(n)]


def output(model, x):
    out = model(x)
    return out[0] if isinstance(out, tuple) else out


def storage_state(model) -> dict[str, torch.Tensor]:
    """The state dict with 1-byte tensors as their bytes (torch.equal on float8 compares NaN codes as unequal)."""
    return {k: v.view(torch.uint8) if v.element_size() == 1 else v for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------------------ storage


@pytest.mark.parametrize("name", list(RECIPES))
def test_weights_are_stored_in_fp8_at_half_the_bytes_of_bf16(name):
    model = mlp(width=256)
    shapes = {n: tuple(m.weight.shape) for n, m in roles.named_linears(model)}
    mf.prepare_inference(model, recipe=RECIPES[name])
    layers = inference_layers(model)
    assert [n for n, _ in layers] == ["2", "4"]  # first and last layers kept, as mf.convert keeps them
    fp8_bytes = bf16_bytes = 0
    for n, layer in layers:
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.element_size() == 1
        assert tuple(layer.weight.shape) == shapes[n]
        assert layer.weight_scale.dtype == (torch.float8_e8m0fnu if name == "mx" else torch.float32)
        numel = layer.weight.numel()
        # no high-precision copy of the weight anywhere in the layer
        assert [k for k, t in layer.state_dict().items() if t.numel() >= numel] == ["weight"]
        fp8_bytes += layer.nbytes()
        bf16_bytes += 2 * numel
    assert fp8_bytes / bf16_bytes <= MEMORY_RATIO_MAX


def test_dtype_casts_move_but_never_recast_the_stored_weight():
    model = mf.prepare_inference(mlp(), recipe=mf.MXScaling())
    before = storage_state(model)["2.weight"].clone()
    model.to(torch.bfloat16)
    layer = model[2]
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float8_e8m0fnu
    assert torch.equal(layer.weight.view(torch.uint8), before)
    assert layer.bias.dtype == torch.bfloat16
    assert output(model, torch.randn(4, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_code_tables_match_torch_and_fp4_packs_two_to_a_byte():
    for fmt in (mf.E4M3, mf.E5M2, mf.E8M0):
        torch_values = torch.arange(256, dtype=torch.uint8).view(fmt.torch_dtype).float()
        assert torch.equal(storage.code_values(fmt).nan_to_num(7.0), torch_values.nan_to_num(7.0)), fmt.name
    assert storage.code_values(mf.E2M1)[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    values = mf.cast(torch.randn(3, 7) * 3, mf.E2M1)
    stored = storage.encode(values, mf.E2M1)
    assert stored.dtype == torch.uint8 and stored.shape == (3, 4)
    assert torch.equal(storage.decode(stored, mf.E2M1, values.shape), values)
    with pytest.raises(ValueError, match="not on the e2m1 grid"):
        storage.encode(torch.tensor([0.7]), mf.E2M1)


# ------------------------------------------------------------------------------------------------ accuracy


@pytest.mark.parametrize("activations", ["dynamic", "static"])
@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("model_name", ["llama", "mlp"])
def test_outputs_match_the_high_precision_model(model_name, name, activations):
    build, data = (tiny_llama, tokens) if model_name == "llama" else (mlp, features)
    reference = build()
    x = data(1)[0]
    model = mf.prepare_inference(copy.deepcopy(reference), recipe=RECIPES[name], activations=activations,
                                 calibration=data(2) if activations == "static" else None)
    assert inference_layers(model)
    assert mf.sqnr_db(output(reference, x), output(model, x)) >= SQNR_FLOOR_DB[model_name]


def test_fp32_islands_and_kept_layers_stay_high_precision():
    model = tiny_llama()
    PrecisionPolicy.preset("bf16").apply(model)
    islands = {n: getattr(m, ISLAND_ATTR) for n, m in model.named_modules() if hasattr(m, ISLAND_ATTR)}
    mf.prepare_inference(model, recipe=mf.BlockScaling(), keep="blocks.1.mlp.*")
    assert {n: getattr(m, ISLAND_ATTR) for n, m in model.named_modules() if hasattr(m, ISLAND_ATTR)} == islands
    assert set(islands.values()) == {"embedding", "norm", "head"}
    for name in islands:
        assert all(p.dtype == torch.float32 for p in model.get_submodule(name).parameters())
    kept = {"blocks.0.attn.q_proj", "blocks.0.attn.k_proj", "blocks.0.attn.v_proj", "lm_head",
            "blocks.1.mlp.gate_proj", "blocks.1.mlp.up_proj", "blocks.1.mlp.down_proj"}
    assert {n for n, m in roles.named_linears(model)} == kept
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(tokens(1)[0])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()  # the head island's fp32 logits


class Scaled(nn.Module):
    """A model taking two inputs, to feed calibration a tensor, a tuple and a dict."""

    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x, gain=None):
        return self.net(x if gain is None else x * gain)


def test_calibration_takes_tensors_tuples_and_dicts():
    data, one = features(2), torch.ones(())
    forms = {"tensor": data, "tuple": [(x, one) for x in data], "dict": [{"x": x, "gain": one} for x in data]}
    scales = {}
    for form, batches in forms.items():
        model = mf.prepare_inference(Scaled(), recipe=mf.CurrentScaling(), activations="static",
                                     calibration=iter(batches))  # a generator works: it is read once
        scales[form] = [float(layer.input_scale) for _, layer in inference_layers(model)]
    assert len(scales["tensor"]) == 2
    assert scales["tuple"] == scales["tensor"] and scales["dict"] == scales["tensor"]


def test_clip_rules_never_exceed_the_maximum():
    calibration = features(2)
    scales = {clip: [float(layer.input_scale) for _, layer in inference_layers(mf.prepare_inference(
        mlp(), recipe=mf.CurrentScaling(), activations="static", calibration=calibration, clip=clip,
        percentile=99.0))] for clip in ("max", "percentile", "mse")}
    for clip in ("percentile", "mse"):
        assert all(s <= m for s, m in zip(scales[clip], scales["max"])), clip
    assert all(s < m for s, m in zip(scales["percentile"], scales["max"]))  # the top 1% saturates


def test_smoothquant_folds_into_norms_and_keeps_accuracy():
    reference = tiny_llama()
    x = tokens(1)[0]
    model = mf.prepare_inference(copy.deepcopy(reference), recipe=mf.CurrentScaling(), activations="static",
                                 calibration=tokens(2), smooth=0.5)
    smoothed = {n for n, layer in inference_layers(model) if layer.spec.smooth}
    # layers reading a norm (block 1's q/k/v, the gate and up projections) had s folded into the norm's gain;
    # o_proj and down_proj read attention and SwiGLU outputs, so they divide their input by s themselves
    assert smoothed == {f"blocks.{i}.{p}" for i in (0, 1) for p in ("attn.o_proj", "mlp.down_proj")}
    assert not torch.equal(model.blocks[1].attn_norm.weight, reference.blocks[1].attn_norm.weight)
    assert torch.equal(model.blocks[0].attn_norm.weight, reference.blocks[0].attn_norm.weight)  # feeds kept q/k/v
    assert mf.sqnr_db(output(reference, x), output(model, x)) >= SQNR_FLOOR_DB["llama"]


def test_training_scales_are_reused_and_calibration_reproduces_them():
    torch.manual_seed(SEED)
    model = mlp()
    model[0].requires_grad_(False)  # kept in high precision: layer 2's input does not change while training
    mf.convert(model, recipe=mf.DelayedScaling())
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    batches = features(6)  # fewer steps than the amax history holds: the scales span every batch
    for x in batches:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    trained = {n: 1.0 / m.fp8_state.scale[0] for n, m in model.named_modules() if isinstance(m, mf.Fp8Linear)}
    reused = mf.prepare_inference(copy.deepcopy(model), recipe=mf.DelayedScaling(), activations="static")
    calibrated = mf.prepare_inference(copy.deepcopy(model), recipe=mf.DelayedScaling(), activations="static",
                                      calibration=batches)
    assert list(trained) == ["2", "4"]
    for n in trained:
        assert torch.equal(reused.get_submodule(n).input_scale, trained[n])
    # layer 2 reads the frozen layer: the same amaxes, so the same scale bit for bit (fp8_max / max(history));
    # layer 4 reads layer 2, which trained, so its calibrated amax differs by what the last steps changed
    assert torch.equal(calibrated.get_submodule("2").input_scale, trained["2"])
    assert calibrated.get_submodule("4").input_scale / trained["4"] == pytest.approx(1.0, rel=0.05)


# (name, keyword arguments, pattern of the one-line ValueError)
BAD_ARGUMENTS = [
    ("activations", dict(activations="int8"), r"activations must be one of \['dynamic', 'static'\], got 'int8'"),
    ("recipe", dict(recipe="fp8"), r"recipe must be one of .*got str"),
    ("clip", dict(clip="kl", activations="static", calibration=[torch.randn(2, 32)]), r"clip must be one of"),
    ("clip with dynamic", dict(clip="mse", calibration=[torch.randn(2, 32)]), r"needs activations='static'"),
    ("percentile", dict(percentile=0, activations="static"), r"percentile must be a finite number in \(0, 100\]"),
    ("smooth range", dict(smooth=1.5, calibration=[torch.randn(2, 32)]), r"smooth must be a finite number in"),
    ("smooth without data", dict(smooth=0.5), r"smooth needs calibration"),
    ("static without data", dict(activations="static"), r"'static' needs calibration: layer '2' has no training"),
    ("keep typo", dict(keep=["blocks.*"]), r"keep pattern 'blocks\.\*' matches no linear layer"),
    ("one batch", dict(calibration=torch.randn(2, 32), smooth=0.5), r"not a single Tensor; wrap it in a list"),
    ("no batches", dict(calibration=[], smooth=0.5), r"calibration yielded no batches"),
    ("backend", dict(backend="cuda"), r"backend must be one of"),
]


@pytest.mark.parametrize("name, kwargs, pattern", BAD_ARGUMENTS, ids=[c[0] for c in BAD_ARGUMENTS])
def test_bad_arguments_raise_one_clear_line(name, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern) as err:
        mf.prepare_inference(mlp(), **{"recipe": mf.CurrentScaling(), **kwargs})
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------------ save / load


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A static, smoothed BlockScaling Llama saved, with an input and its output."""
    with eager_kernels():
        torch.manual_seed(SEED)
        model = mf.prepare_inference(tiny_llama(), recipe=mf.BlockScaling(), activations="static",
                                     calibration=tokens(2), smooth=0.5)
        x = tokens(1)[0]
        path = mf.save_quantized(model, tmp_path_factory.mktemp("quantized") / "q")
        return path, model, x, output(model, x)


def test_save_load_is_bitwise(saved):
    path, model, x, y = saved
    for into in (None, tiny_llama()):  # rebuilt from the saved LlamaConfig, or a fresh unquantized model filled
        loaded = mf.load_quantized(path, model=into)
        assert torch.equal(output(loaded, x), y)
        assert storage_state(loaded).keys() == storage_state(model).keys()
        assert all(torch.equal(a, b) for a, b in zip(storage_state(loaded).values(), storage_state(model).values()))
        assert loaded.lm_head.weight is loaded.wte.weight  # tied, stored once
    config = json.loads((path / MANIFEST_FILE).read_text())["extra"]["quantized"]
    assert config["format_version"] == FORMAT_VERSION and config["recipe"]["type"] == "BlockScaling"
    assert config["layers"]["blocks.1.attn.q_proj"]["weight"]["granularity"] == "block"


def _edit_config(change):
    def damage(path):
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        change(manifest["extra"]["quantized"])
        (path / MANIFEST_FILE).write_text(json.dumps(manifest))
    return damage


def _cut(path):
    data = (path / TENSORS_FILE).read_bytes()
    (path / TENSORS_FILE).write_bytes(data[: len(data) // 2])


def _flip(path):
    data = bytearray((path / TENSORS_FILE).read_bytes())
    data[-100] ^= 0xFF
    (path / TENSORS_FILE).write_bytes(bytes(data))


# (name, damage to the saved folder, model to load into, pattern of the one-line CheckpointError)
DAMAGE = [
    ("truncated tensors", _cut, None, r"tensors\.safetensors is truncated"),
    ("tampered tensors", _flip, None, r"tensors\.safetensors is corrupt: sha256"),
    ("manifest not JSON", lambda p: (p / MANIFEST_FILE).write_text("{"), None, r"manifest\.json is not valid JSON"),
    ("format version", _edit_config(lambda c: c.update(format_version=99)), None,
     rf"manifest\.json: FP8 inference format version 99, but this minifloat reads format version {FORMAT_VERSION}"),
    ("layer spec", _edit_config(lambda c: c["layers"]["blocks.1.attn.q_proj"]["weight"].update(granularity="x")),
     None, r"manifest\.json is corrupt: its FP8 layer config is malformed \(ValueError: granularity must be"),
    ("wider model", lambda p: None, lambda: Llama(LlamaConfig.preset("tiny", d_model=128)),
     r"quantized 'blocks\.0\.attn\.o_proj' as a linear layer 64->64"),
    ("extra tensors in the model", lambda p: None, lambda: Llama(LlamaConfig.preset("tiny", qk_norm=True)),
     r"missing from the checkpoint: blocks\.0\.attn\.q_norm\.weight"),
    ("untied model", lambda p: None, lambda: Llama(LlamaConfig.preset("tiny", tie_embeddings=False)),
     r"tied weights differ"),
    ("bf16 model", lambda p: None, lambda: Llama(LlamaConfig.preset("tiny")).to(torch.bfloat16),
     r"/q \(\d+ tensors\) does not fit the model.*wte\.weight: dtype torch\.float32 in the checkpoint, torch\.bfloat16 in the model"),
    # getattr(torch, "nn") is a module: torch's TypeError from .to() reached the user
    ("model dtype", _edit_config(lambda c: c["model"].update(dtype="nn")), None,
     r"model config is malformed \(ValueError: dtype 'nn' is not a floating-point torch dtype"),
    # the sizes match: the message named them and not the difference
    ("prepared otherwise", lambda p: None,
     lambda: mf.prepare_inference(tiny_llama(), recipe=mf.CurrentScaling()),
     r"quantized 'blocks\.\d\.\w+\.\w+' with another recipe or activation mode than the model's"),
]


@pytest.mark.parametrize("name, damage, build, pattern", DAMAGE, ids=[c[0] for c in DAMAGE])
def test_damaged_or_mismatched_files_raise_one_clear_line(saved, tmp_path, name, damage, build, pattern):
    path = tmp_path / "q"
    mf.save_quantized(saved[1], path)
    damage(path)
    model = build() if build is not None else None
    linears = None if model is None else {n for n, _ in roles.named_linears(model)}
    with pytest.raises(CheckpointError, match=pattern) as err:
        mf.load_quantized(path, model=model)
    assert "\n" not in str(err.value)
    if model is not None and name != "prepared otherwise":  # the model given is left as it was: none converted
        assert {n for n, _ in roles.named_linears(model)} == linears and not inference_layers(model)


@pytest.mark.parametrize("recipe", [mf.CurrentScaling(), mf.NVFP4Scaling()], ids=["current", "nvfp4"])
def test_a_tied_llama_with_its_head_quantized_saves_and_loads(recipe, tmp_path):
    # keep_first_last=False quantizes the head of a tied Llama; the load tied the embedding over the head's FP8
    # weight again and refused its own save ("tied weights differ")
    with eager_kernels():
        torch.manual_seed(SEED)
        model = mf.prepare_inference(tiny_llama(), recipe=recipe, keep_first_last=False)
        x = tokens(1)[0]
        first = mf.save_quantized(model, tmp_path / "a")
        loaded = mf.load_quantized(first)
        assert torch.equal(output(loaded, x), output(model, x))
        assert isinstance(loaded.lm_head, Fp8InferenceLinear)
        # no generator states in the folder: the same model saves to the same bytes
        torch.rand(3)
        second = mf.save_quantized(loaded, tmp_path / "b")
    for name in (TENSORS_FILE, MANIFEST_FILE):
        assert (first / name).read_bytes() == (second / name).read_bytes()


def test_save_never_replaces_a_training_checkpoint_and_load_names_the_folder_to_use(tmp_path):
    save_checkpoint(tmp_path / "ckpt", model=tiny_llama())
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    model = mf.prepare_inference(tiny_llama(), recipe=mf.CurrentScaling())
    with pytest.raises(FileExistsError, match="holds a checkpoint that save_quantized did not write"):
        mf.save_quantized(model, tmp_path / "ckpt")  # it replaced the run's weights and optimizer state
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before
    path = mf.save_quantized(model, tmp_path / "q")
    assert mf.save_quantized(model, path) == path  # an earlier save is replaced
    with pytest.raises(FileNotFoundError, match="load_quantized takes its folder"):
        mf.load_quantized(path / TENSORS_FILE)  # said the folder does not exist
    export_hf(tiny_llama(), tmp_path / "hf")
    with pytest.raises(CheckpointError, match="is a Hugging Face export .* read it with .*load_hf_export"):
        mf.load_quantized(tmp_path / "hf")  # said manifest.json is missing: restore the folder from a copy


def test_load_needs_a_quantized_folder_and_a_model_for_other_architectures(tmp_path):
    save_checkpoint(tmp_path / "ckpt", model=mlp())
    with pytest.raises(CheckpointError, match=r"holds no FP8 inference model \(a training checkpoint\?\)"):
        mf.load_quantized(tmp_path / "ckpt")
    model = mf.prepare_inference(mlp(), recipe=mf.CurrentScaling())
    mf.save_quantized(model, tmp_path / "mlp")
    with pytest.raises(CheckpointError, match=r"was a torch\.nn\.modules\.container\.Sequential, not minifloat's"):
        mf.load_quantized(tmp_path / "mlp")
    x = torch.randn(4, 32)
    assert torch.equal(output(mf.load_quantized(tmp_path / "mlp", model=mlp()), x), output(model, x))
    with pytest.raises(ValueError, match="no FP8 inference layers: call prepare_inference first"):
        mf.save_quantized(mlp(), tmp_path / "plain")


# ------------------------------------------------------------------------------------------------ Hugging Face


def hf_models():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install "
                                                              "minifloat[hf])")
    torch.manual_seed(SEED)
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64))
    return {"bert": (bert.eval(), "last_hidden_state"), "llama": (llama.eval(), "logits")}


def hf_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (2, 16))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}  # what a tokenizer returns


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_hugging_face_models(activations, tmp_path):
    for name, (reference, key) in hf_models().items():
        head = roles.output_head(reference)
        kept = roles.first_and_last(reference)
        x = hf_batch()
        model = mf.prepare_inference(copy.deepcopy(reference), recipe=mf.CurrentScaling(granularity="row"),
                                     activations=activations, calibration=[hf_batch(), hf_batch()])
        assert {n for n, _ in roles.named_linears(model)} == kept and head in kept
        for n, m in model.named_modules():
            if roles.is_norm(m) or roles.is_embedding(m):
                assert type(m) is type(reference.get_submodule(n)), n
                assert all(p.dtype == torch.float32 for p in m.parameters())
        y = model(**x)[key]
        assert mf.sqnr_db(reference(**x)[key], y) >= HF_SQNR_FLOOR_DB[name], name
        if activations == "static":
            mf.save_quantized(model, tmp_path / name)
            loaded = mf.load_quantized(tmp_path / name, model=type(reference)(reference.config))
            assert torch.equal(loaded(**x)[key], y), name


def test_preparing_a_prepared_model_under_another_recipe_is_refused(caplog):
    # it returned the model unchanged under its first recipe, with "no linear layer left to convert"
    model = mf.prepare_inference(mlp(), recipe=mf.DelayedScaling(), keep_first_last=False)
    with caplog.at_level("WARNING", logger="minifloat"):
        assert mf.prepare_inference(model, recipe=mf.DelayedScaling(), keep_first_last=False) is model
    assert "(it is prepared already)" in caplog.text
    with pytest.raises(ValueError, match="prepared for FP8 inference already, under another recipe .* prepare the "
                                         "unprepared model"):
        mf.prepare_inference(model, recipe=mf.MXScaling(), keep_first_last=False)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("recipe", [mf.CurrentScaling(), mf.CurrentScaling(granularity="row"), mf.BlockScaling()],
                         ids=["tensor", "row", "block"])
def test_prepare_refuses_weights_fp8_cannot_store(recipe, value):
    """A NaN weight was stored as a NaN code (every logit NaN), an inf one saturated at 448 under scale 1 (a model
    that computes something else), both without a word: one ValueError naming the layer, and the model unchanged."""
    model = tiny_llama()
    with torch.no_grad():
        model.blocks[0].mlp.down_proj.weight[0, 0] = value
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"hold NaN or infinity, which FP8 cannot store: blocks\.0\.mlp\.down_proj "
                                         r"\(1 non-finite\).*keep="):
        mf.prepare_inference(model, recipe=recipe)
    assert not any(isinstance(m, Fp8InferenceLinear) for m in model.modules())
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k].nan_to_num(), v.nan_to_num()) for k, v in before.items())
    # kept in high precision, the layer is no obstacle
    mf.prepare_inference(model, recipe=recipe, keep=["blocks.0.mlp.down_proj"])
