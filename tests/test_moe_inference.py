"""FP8 inference for transformers' stacked MoE experts (minifloat.inference.experts): prepare_inference stores each
expert matrix (gate, up, down) as an Fp8InferenceLinear, and an FP8 export writes those very bytes in the checkpoint
layout (minifloat.inference.hf_experts).

The reference for the bits: the same routing written out by hand with one Fp8InferenceLinear per matrix, made from
the expert's weights: the outputs must be equal, bit for bit."""

from __future__ import annotations

import copy
import io
import json
import logging

import pytest
import torch
from safetensors.torch import load_file

import minifloat as mf
from minifloat.inference import hf
from minifloat.inference.experts import Fp8InferenceExperts
from minifloat.inference.export import export_hf
from minifloat.inference.layers import Activations, Fp8InferenceLinear, LayerSpec
from minifloat.numerics.quantize import sqnr_db
import moe_models
from moe_models import MODELS, routing

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints only with accelerate")

RECIPES = {"block": mf.BlockScaling(), "current": mf.CurrentScaling(), "row": mf.CurrentScaling(granularity="row")}
# the prepared experts' output against the fp32 module (E4M3 weights and activations: ~28 dB a cast; measured
# 23.7-24.2 dB) and the prepared model's logits against the fp32 model's (measured 24.7 dB on the Mixtral)
EXPERTS_SQNR_FLOOR_DB = 20.0
LOGITS_SQNR_FLOOR_DB = 20.0


def build(arch: str = "mixtral"):
    return moe_models.build(arch).eval()


def ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))


def experts_of(model) -> list:
    return [m for m in model.modules() if isinstance(m, Fp8InferenceExperts)]


def by_hand(plain, recipe, x, index, weights):
    """The experts' output with one Fp8InferenceLinear per gate, up and down matrix of each expert."""
    spec = LayerSpec.from_recipe(recipe, Activations.DYNAMIC)
    first, down = plain.gate_up_proj.detach(), plain.down_proj.detach()
    half = first.shape[1] // 2

    def layer(weight):
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight = torch.nn.Parameter(weight.clone())
        return Fp8InferenceLinear.from_linear(linear, spec, recipe=recipe)

    out = torch.zeros_like(x)
    for e in range(plain.num_experts):
        gate, up, dn = layer(first[e, :half]), layer(first[e, half:]), layer(down[e])
        slot, token = torch.where((index == e).t())  # slot-major, as transformers' routing orders them
        if token.numel():
            h = plain._apply_gate(torch.cat([gate(x[token]), up(x[token])], dim=-1))
            out.index_add_(0, token, dn(h) * weights[token, slot, None])
    return out


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_prepared_experts_compute_what_one_fp8_inference_linear_per_matrix_computes(arch, recipe):
    model = build(arch)
    plain = copy.deepcopy(model.model.layers[1].mlp.experts)
    prepared = mf.prepare_inference(model, recipe=RECIPES[recipe])
    module = prepared.model.layers[1].mlp.experts
    assert isinstance(module, Fp8InferenceExperts) and isinstance(module, type(plain))
    assert not any(True for _ in module.parameters(recurse=False))  # the stacked high-precision weights are gone
    assert len(module.fp8_experts) == 3 * module.num_experts
    x, index, weights = routing()
    with torch.no_grad():
        ours = module(x, index, weights)
        assert torch.equal(ours, by_hand(plain, RECIPES[recipe], x, index, weights))
        assert sqnr_db(plain(x, index, weights), ours) >= EXPERTS_SQNR_FLOOR_DB


def test_a_prepared_moe_model_is_close_to_the_original_and_copies():
    model = build()
    prepared = mf.prepare_inference(copy.deepcopy(model), recipe=mf.BlockScaling())
    with torch.no_grad():
        assert sqnr_db(model(ids()).logits, prepared(ids()).logits) >= LOGITS_SQNR_FLOOR_DB
        twin = copy.deepcopy(prepared)
        buffer = io.BytesIO()
        torch.save(prepared, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        for other in (twin, loaded):
            assert torch.equal(other(ids()).logits, prepared(ids()).logits)
    assert len(experts_of(loaded)) == 2
    x = torch.randn(24, 128, requires_grad=True)  # the input's gradient flows, as through Fp8InferenceLinear
    module = experts_of(prepared)[0]
    module(x, *routing()[1:]).sum().backward()
    assert x.grad is not None and bool(x.grad.abs().sum() > 0)


def test_static_activations_and_keep_leave_the_experts_in_high_precision(caplog):
    with caplog.at_level(logging.WARNING, logger="minifloat"):
        static = mf.prepare_inference(build(), recipe=mf.CurrentScaling(), activations="static",
                                      calibration=[ids(2)])
    assert not experts_of(static) and static.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    assert any("stay in high precision" in r.getMessage() and "dynamic activations" in r.getMessage()
               for r in caplog.records)
    kept = mf.prepare_inference(build(), recipe=mf.BlockScaling(), keep=["*.experts"])
    assert not experts_of(kept) and any(isinstance(m, Fp8InferenceLinear) for m in kept.modules())


def test_nonfinite_expert_weights_are_refused_before_anything_changes():
    model = build()
    with torch.no_grad():
        model.model.layers[0].mlp.experts.down_proj[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts \(1 non-finite\)"):
        mf.prepare_inference(model, recipe=mf.BlockScaling())
    assert not experts_of(model) and not any(isinstance(m, Fp8InferenceLinear) for m in model.modules())


def test_save_quantized_refuses_fp8_experts_in_one_line(tmp_path):
    prepared = mf.prepare_inference(build(), recipe=mf.BlockScaling())
    with pytest.raises(ValueError, match="save_quantized does not hold FP8 MoE experts") as err:
        mf.save_quantized(prepared, tmp_path / "q")
    assert "\n" not in str(err.value) and not (tmp_path / "q").exists()


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_the_export_writes_the_prepared_experts_bytes_that_transformers_reads(tmp_path, arch):
    prepared = mf.prepare_inference(build(arch), recipe=mf.BlockScaling())
    out = export_hf(prepared, tmp_path / "block", format="hf-fp8-block")
    tensors = load_file(out / hf.WEIGHTS_FILE)
    assert not any("fp8_experts" in k for k in tensors)
    prefix = "model.layers.1.block_sparse_moe.experts" if arch == "mixtral" else "model.layers.1.mlp.experts"
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    module = prepared.model.layers[1].mlp.experts
    for e in range(module.num_experts):
        for name, layer in zip(names, module.expert_layers(e)):  # gate, up, down: the stored bytes, as they are
            key = f"{prefix}.{e}.{name}.weight"
            assert torch.equal(tensors[key].view(torch.uint8), layer.weight.view(torch.uint8)), key
            assert torch.equal(tensors[key.replace(".weight", ".weight_scale_inv")], layer.weight_scale.float())
    quant = json.loads((out / hf.CONFIG_FILE).read_text())["quantization_config"]
    assert not any("experts" in n for n in quant["ignored_layers"] + quant["modules_to_not_convert"])
    theirs = type(prepared).from_pretrained(out).eval()
    plain = type(prepared).from_pretrained(export_hf(prepared, tmp_path / "plain", format="hf")).eval()
    loaded = theirs.model.layers[1].mlp.experts
    for e in range(module.num_experts):
        gate, up, down = (m.dequantized_weight().to(torch.bfloat16) for m in module.expert_layers(e))
        assert torch.equal(loaded.gate_up_proj[e], torch.cat([gate, up])), e
        assert torch.equal(loaded.down_proj[e], down), e
        assert torch.equal(plain.model.layers[1].mlp.experts.gate_up_proj[e], torch.cat([gate, up])), e
