"""Tests for minifloat.fp8.convert: which layers `convert` keeps in high precision (by role, not module order), and
that PrecisionPolicy and the audit use the same rules.

Hugging Face models are in tests/test_hf_convert.py; convert's filter / recipe / odd-shape cases in test_modules.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import minifloat as mf
from minifloat.numerics.fp4 import pack_e2m1, quantize_nvfp4
from minifloat.numerics.hadamard import rht, rht_signs
from minifloat.amp.policy import PrecisionPolicy
from minifloat.core import roles
from minifloat.fp8.convert import fp8_plan
from minifloat.safety.audit import audit
from minifloat.training.demo import ByteMLP
from minifloat.training.model import Llama, LlamaConfig

LLAMA_KEPT = {"blocks.0.attn.q_proj", "blocks.0.attn.k_proj", "blocks.0.attn.v_proj", "lm_head"}


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


class Attention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q = nn.Linear(d, d)

    def forward(self, x):  # (B, T, C)
        probs = (self.q(x) @ x.transpose(-1, -2)).float().softmax(-1)  # (B, T, T), softmax in fp32
        return probs.to(x.dtype) @ x


class TinyLM(nn.Module):
    """No block stack: embedding, one attention with a single projection, an MLP layer, the head."""

    def __init__(self, vocab=64, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.attn = Attention(d)
        self.mlp = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, idx):
        h = self.emb(idx)
        h = h + self.attn(h)
        return self.lm_head(h + self.mlp(h))


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(),
                         nn.Linear(48, 16))


# (name, model factory, names keep_first_last keeps in high precision)
KEPT = [
    ("reference-llama", lambda: Llama(LlamaConfig.preset("tiny")), LLAMA_KEPT),
    ("reference-llama-untied", lambda: Llama(LlamaConfig.preset("tiny", tie_embeddings=False)), LLAMA_KEPT),
    ("mlp", mlp, {"0", "6"}),
    ("byte-mlp", ByteMLP, {"mlp.0", "mlp.6"}),
    ("tiny-lm", TinyLM, {"attn.q", "lm_head"}),
]


def linear_names(model: nn.Module) -> set[str]:
    return {n for n, _ in roles.named_linears(model)}


@pytest.mark.parametrize("name, build, kept", KEPT, ids=[c[0] for c in KEPT])
def test_convert_keeps_input_projections_and_head(name, build, kept):
    model = build()
    plan = fp8_plan(model)
    assert set(plan.kept) == kept and not plan.misshapen
    mf.convert(model, recipe=mf.CurrentScaling())
    converted = {m.fp8_name for m in mf.fp8_layers(model)}
    assert converted == linear_names(model) - kept == set(plan.convert)


@pytest.mark.parametrize("name, build, kept", KEPT, ids=[c[0] for c in KEPT])
def test_policy_plans_what_convert_does(name, build, kept):
    policy = PrecisionPolicy.preset("fp8-current")
    model = build()
    planned = {n for n, kind in policy.plan(model).items() if kind == "fp8"}
    assert planned == linear_names(model) - kept
    policy.apply(model)
    assert {m.fp8_name for m in mf.fp8_layers(model)} == planned
    head = roles.output_head(model)
    assert getattr(model.get_submodule(head), "minifloat_fp32_island") == "head"


def test_convert_twice_keeps_the_same_layers():
    model = mf.convert(Llama(LlamaConfig.preset("tiny")), recipe=mf.CurrentScaling())
    before = {m.fp8_name for m in mf.fp8_layers(model)}
    mf.convert(model, recipe=mf.CurrentScaling())
    assert {m.fp8_name for m in mf.fp8_layers(model)} == before
    assert fp8_plan(model).convert == ()


def test_audit_head_is_the_head_convert_keeps():
    model = mf.convert(TinyLM(), recipe=mf.CurrentScaling())
    idx = torch.randint(0, 64, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = audit(model, idx)
    assert report.head == roles.output_head(model) == "lm_head"
    assert report.ok, report.violations
    assert {r.module for r in report.records if r.precision == "fp8"} == {"mlp"}


# ---- a model convert leaves in high precision, and a single linear layer -----------------------------------------

# E4M3 (3 mantissa bits) on both GEMM operands: ~25 dB for Gaussian data; a wrong scale or layout is far below
FP8_LINEAR_SQNR_FLOOR_DB = 20.0

class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x):
        return self.conv(x).relu()


# (name, model factory, convert's keyword arguments, words its one warning holds)
NOTHING_CONVERTED = [
    ("no nn.Linear", ConvNet, {}, ["converted nothing", "ConvNet has no nn.Linear"]),
    ("a lone linear: first and last", lambda: nn.Linear(64, 64), {},
     ["converted nothing", "1 kept as input projection or output head", "the model itself"]),
    ("a lone small linear", lambda: nn.Linear(10, 10), {"keep_first_last": False},
     ["converted nothing", "not multiples of 16", "the model itself (10->10)"]),
    ("filter refuses all", mlp, {"filter": lambda name, linear: False},
     ["converted nothing", "2 kept", "0, 6", "2 refused by `filter`"]),
]


@pytest.mark.parametrize("name, build, kwargs, words", NOTHING_CONVERTED, ids=[c[0] for c in NOTHING_CONVERTED])
def test_convert_warns_in_one_line_when_it_converts_nothing(caplog, name, build, kwargs, words):
    model = build()
    with caplog.at_level(logging.DEBUG, logger="minifloat"):
        assert mf.convert(model, **kwargs) is model
    (warning,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    text = warning.getMessage()
    assert "\n" not in text and all(w in text for w in words), text
    assert not mf.fp8_layers(model)


def test_convert_is_silent_when_layers_convert_or_already_have(caplog):
    with caplog.at_level(logging.WARNING, logger="minifloat"):
        model = mf.convert(mlp(), recipe=mf.CurrentScaling())
        mf.convert(model, recipe=mf.CurrentScaling())  # nothing left to convert, but FP8 layers: no warning
    assert mf.fp8_layers(model) and not caplog.records


def test_convert_returns_a_root_linear_converted():
    linear = nn.Linear(64, 32)
    x = torch.randn(4, 64)
    converted = mf.convert(linear, recipe=mf.CurrentScaling(), keep_first_last=False)
    assert isinstance(converted, mf.Fp8Linear) and converted is not linear
    assert converted.weight is linear.weight and converted.bias is linear.bias  # the parameters are shared
    out = converted(x)
    assert out.shape == (4, 32)
    assert mf.sqnr_db(out, linear(x)) > FP8_LINEAR_SQNR_FLOOR_DB


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


@pytest.mark.parametrize("second", [mf.MXScaling(), mf.CurrentScaling(), mf.DelayedScaling(amax_history_len=4)],
                         ids=["other-class", "current", "other-fields"])
def test_converting_again_under_another_recipe_is_refused(second):
    """convert leaves Fp8Linear layers as they are: a second convert under another recipe used to keep the first
    recipe silently, so the user trained with numerics they did not ask for."""
    model = mf.convert(mlp(), recipe=mf.DelayedScaling())
    with pytest.raises(ValueError, match=r"1 layer\(s\) are already Fp8Linear under DelayedScaling \('2'\).*"
                                         r"Start from the model before its FP8 conversion"):
        mf.convert(model, recipe=second)
    assert model[2].recipe == mf.DelayedScaling()


def test_a_recipe_per_part_of_the_model_stays_possible():
    """Converting layers a filter picks under one recipe, then others under another, is no conflict."""
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8))
    mf.convert(model, recipe=mf.DelayedScaling(), filter=lambda name, _: name == "1")
    mf.convert(model, recipe=mf.CurrentScaling(), filter=lambda name, _: name != "1")
    assert [type(model[i].recipe).__name__ for i in (1, 2, 3)] == ["DelayedScaling", "CurrentScaling",
                                                                    "CurrentScaling"]


@pytest.mark.parametrize("second, words", [("fp8-block", "would not run BlockScaling()"),
                                           ("bf16", "this policy has no FP8 recipe")])
def test_applying_another_policy_to_a_converted_model_is_refused(second, words):
    model = PrecisionPolicy.preset("fp8-delayed").apply(mlp())
    PrecisionPolicy.preset("fp8-delayed").apply(model)  # the same policy again: nothing to change
    with pytest.raises(ValueError, match=words):
        PrecisionPolicy.preset(second).apply(model)
    assert isinstance(model[2], mf.Fp8Linear) and model[2].recipe == mf.DelayedScaling()


BAD_CALLS = [
    ("convert-str", lambda: mf.convert("model"), TypeError, "minifloat.convert: model must be a torch nn.Module"),
    ("convert-filter", lambda: mf.convert(mlp(), filter="x"), TypeError, "filter must be a function"),
    ("apply-str", lambda: PrecisionPolicy.preset("bf16").apply("x"), TypeError, "model must be a torch nn.Module"),
    ("optimizer-params", lambda: PrecisionPolicy.preset("bf16").optimizer(torch.optim.AdamW, list(mlp().parameters())),
     TypeError, "PrecisionPolicy.optimizer: model must be a torch nn.Module, got list"),
    ("autocast-device", lambda: PrecisionPolicy.preset("bf16").autocast("tpu"), ValueError,
     "device_type must be a device type with torch.autocast"),
    ("fp8-step-str", lambda: mf.fp8_step("model"), TypeError, "fp8_step: model must be a torch nn.Module"),
    ("linear-0d", lambda: mf.Fp8Linear(32, 32)(torch.tensor(1.0)), ValueError,
     r"takes a tensor whose last dimension is 32, got a tensor of shape \(\)"),
    ("linear-list", lambda: mf.Fp8Linear(32, 32)([[1.0] * 32]), ValueError, "got a list"),
    ("linear-width", lambda: mf.Fp8Linear(32, 32)(torch.ones(4, 16)), ValueError, r"shape \(4, 16\)"),
    ("linear-int", lambda: mf.Fp8Linear(32, 32, dtype=torch.int32), ValueError, "dtype must be a floating-point"),
    ("cast-list", lambda: mf.cast([1.0, 2.0], mf.E4M3), TypeError, "torch.as_tensor"),
    ("sqnr-shapes", lambda: mf.sqnr_db(torch.randn(4), torch.randn(5)), ValueError, "one shape"),
    ("convert-keep-str", lambda: mf.convert(mlp(), keep_first_last="no"), ValueError, "keep_first_last must be a bool"),
    ("convert-backend", lambda: mf.convert(nn.Sequential(nn.Linear(3, 3)), backend="cuda"), ValueError,
     "backend must be one of"),  # refused even where no layer converts
    ("margin-bool", lambda: mf.DelayedScaling(margin=True), ValueError, "margin must be an int"),
    ("margin-huge", lambda: mf.DelayedScaling(margin=1000), ValueError, r"margin must be an int in \[0, 64\]"),
    ("history-huge", lambda: mf.DelayedScaling(amax_history_len=10**9), ValueError, "amax_history_len"),
    ("mm-int-out", lambda: mf.scaled_mm(*_operands(), out_dtype=torch.int32), ValueError, "out_dtype must be one of"),
    ("mm-bias-shape", lambda: mf.scaled_mm(*_operands(), bias=torch.ones(5)), ValueError, r"bias must be a \(3,\)"),
    ("rht-block", lambda: rht(torch.randn(4, 24), rht_signs(0, 12), block=12), ValueError, "power of two"),
    ("pack-0d", lambda: pack_e2m1(torch.tensor(1.0)), ValueError, "0-d tensor"),
    ("nvfp4-seed", lambda: quantize_nvfp4(torch.randn(4, 32), rounding="stochastic", seed=-5), ValueError, "seed"),
]


def _operands():
    """E4M3 operands a (2, 32) and b (3, 32) for scaled_mm."""
    return (mf.quantize(torch.randn(2, 32), mf.E4M3), mf.quantize(torch.randn(3, 32), mf.E4M3))


def test_a_one_dim_rht_is_one_row():
    x = torch.randn(32)
    assert torch.equal(rht(x, rht_signs(0)), rht(x[None], rht_signs(0))[0])


@pytest.mark.parametrize("name, call, error, words", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_gets_one_clear_error(name, call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_policy_autocast_takes_a_device_string_with_an_index():
    with PrecisionPolicy.preset("fp8-delayed").autocast("cpu:0"):
        assert torch.is_autocast_enabled("cpu")


def test_gpt2s_conv1d_projections_are_named_when_nothing_converts(caplog):
    """GPT-2's projections are transformers' Conv1D, not nn.Linear: the warning counted only the nn.Linear head and
    read as "working as configured"; it now names the Conv1D layers, the real reason."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32)
    for apply in (lambda m: mf.convert(m), lambda m: PrecisionPolicy.preset("fp8-delayed").apply(m)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="minifloat"):
            apply(transformers.GPT2LMHeadModel(config))
        assert any("8 transformers Conv1D projection(s) (transformer.h.0.attn.c_attn, ...) are not nn.Linear"
                   in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


class Router(nn.Linear):
    """An MoE router: a linear with a forward of its own, returning (weights, indices) as HF's Llama4 / PhiMoE do."""

    def forward(self, x):
        logits = super().forward(x)
        return logits.softmax(-1), logits.argmax(-1)


class RoutedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.router, self.down = nn.Linear(32, 64), Router(64, 16), nn.Linear(64, 32)

    def forward(self, x):
        h = self.up(x)
        weights, _ = self.router(h)
        return self.down(h * weights.sum(-1, keepdim=True))


def test_a_linear_subclass_with_its_own_forward_is_left_as_it_is(caplog):
    # it became an Fp8Linear, whose forward returned a tensor: "too many values to unpack" inside the model
    model = RoutedMLP()
    with caplog.at_level("WARNING", logger="minifloat"):
        mf.convert(model, keep_first_last=False)
    assert type(model.router) is Router and isinstance(model.up, mf.Fp8Linear)
    assert "kept 1 nn.Linear subclass(es) with a forward of their own" in caplog.text and "router" in caplog.text
    model(torch.randn(4, 32)).sum().backward()
    prepared = mf.prepare_inference(RoutedMLP(), recipe=mf.CurrentScaling(), keep_first_last=False)
    assert type(prepared.router) is Router
    prepared(torch.randn(4, 32))


@pytest.mark.parametrize("verdict", ["no", None, torch.tensor([True, False])], ids=["str", "none", "tensor"])
def test_a_filter_must_answer_with_a_bool(verdict):
    # "no" converted every layer (truthy), None none, and a tensor raised torch's "Boolean value ... is ambiguous"
    with pytest.raises(TypeError, match="filter\\(name, layer\\) must return a bool"):
        mf.convert(RoutedMLP(), filter=lambda name, layer: verdict, keep_first_last=False)


def test_a_policy_keeps_non_persistent_buffers_in_their_dtype():
    # HF's RoPE inv_freq (a non-persistent buffer) went to bf16 with param_dtype=bfloat16: phases off by 0.7 rad at
    # position 4096; a persistent buffer is state and follows param_dtype
    import dataclasses

    model = RoutedMLP()
    model.register_buffer("inv_freq", torch.rand(8), persistent=False)
    model.register_buffer("running", torch.rand(8))
    policy = dataclasses.replace(mf.PrecisionPolicy.preset("bf16"), param_dtype=torch.bfloat16)
    policy.apply(model)
    assert model.inv_freq.dtype == torch.float32 and model.running.dtype == torch.bfloat16
    assert model.up.weight.dtype == torch.bfloat16


class StackedExperts(nn.Module):
    """Experts' weights stacked as (experts, out, in), multiplied by the module's own forward (transformers 5's
    MixtralExperts layout)."""

    def __init__(self, n=4, d=32, f=64):
        super().__init__()
        self.up = nn.Parameter(torch.randn(n, f, d) / d**0.5)
        self.down = nn.Parameter(torch.randn(n, d, f) / f**0.5)

    def forward(self, x, expert):
        return torch.nn.functional.linear(torch.nn.functional.linear(x, self.up[expert]).relu(), self.down[expert])


class MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.experts, self.conv = nn.Linear(32, 32), StackedExperts(), nn.Conv2d(3, 16, 3)

    def forward(self, x):
        return self.experts(self.proj(x), 0)


def test_stacked_expert_weights_are_named_as_staying_in_high_precision(caplog):
    # MoE experts held as 3-D parameters (Mixtral in transformers 5) stayed in high precision with no word of it;
    # a convolution's 4-D weight is not a stacked matmul weight
    model = MoEBlock()
    assert roles.stacked_weights(model) == {"experts": (("up", (4, 64, 32)), ("down", (4, 32, 64)))}
    assert fp8_plan(model, keep_first_last=False).stacked == ("experts",)
    with caplog.at_level("WARNING", logger="minifloat"):
        mf.convert(model, keep_first_last=False)
    share = round(100 * (2 * 4 * 64 * 32) / sum(p.numel() for p in model.parameters()))
    assert "1 module(s) multiply stacked weights of their own" in caplog.text
    assert (f"{share}% of the model's parameters: experts (up 4x64x32, down 4x32x64: not a transformers experts "
            f"module (use_experts_implementation))") in caplog.text
    assert isinstance(model.proj, mf.Fp8Linear) and "conv (" not in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="minifloat"):
        mf.prepare_inference(MoEBlock(), recipe=mf.CurrentScaling(), keep_first_last=False)
    assert "minifloat.prepare_inference: 1 module(s) multiply stacked weights" in caplog.text


def test_a_hugging_face_mixtral_names_its_experts():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    model = transformers.MixtralForCausalLM(config)
    plan = fp8_plan(model)  # run in FP8 since 2026-12-02 (minifloat.fp8.experts; tests/test_moe.py)
    assert plan.experts == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts") and plan.stacked == ()


def test_a_layer_registered_under_two_names_is_replaced_under_both():
    # only its first name was replaced: the forward kept calling the nn.Linear under the other names
    model = nn.Module()
    shared = nn.Linear(32, 32)
    model.enc, model.dec = nn.Sequential(shared), nn.Sequential(nn.ReLU(), shared)
    mf.convert(model, keep_first_last=False)
    assert isinstance(model.enc[0], mf.Fp8Linear) and model.enc[0] is model.dec[1]


def test_hooks_on_a_converted_layer_still_fire_and_still_remove():
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    seen = []
    handle = model[2].register_forward_hook(lambda mod, args, out: seen.append(type(mod).__name__))
    model[2].register_forward_pre_hook(lambda mod, args: seen.append("pre"))
    model[2].register_full_backward_hook(lambda mod, grad_in, grad_out: seen.append("backward"))
    mf.convert(model, keep_first_last=False)
    model(torch.randn(4, 32)).sum().backward()
    assert seen == ["pre", "Fp8Linear", "backward"]
    handle.remove()
    model(torch.randn(4, 32))
    assert seen == ["pre", "Fp8Linear", "backward", "pre"]


class Tracked(nn.Linear):
    """An nn.Linear subclass with state of its own and nn.Linear's forward."""

    def __init__(self, *args):
        super().__init__(*args)
        self.register_buffer("usage", torch.zeros(self.out_features))


def _weight_norm(m):
    return nn.utils.parametrizations.weight_norm(m)


def _prune(m):
    from torch.nn.utils import prune

    return prune.l1_unstructured(m, "weight", amount=0.5)


# (name, make a layer, the reason named)
UNSUPPORTED = [
    ("parametrized", lambda: _weight_norm(nn.Linear(32, 32)), "its weight is computed"),
    ("pruned", lambda: _prune(nn.Linear(32, 32)), "its weight is computed"),
    ("own-state", lambda: Tracked(32, 32), "Tracked holds state of its own (usage)"),
]


@pytest.mark.parametrize("make, reason", [c[1:] for c in UNSUPPORTED], ids=[c[0] for c in UNSUPPORTED])
def test_a_layer_an_fp8_linear_cannot_stand_in_for_is_left_as_it_is(make, reason, caplog):
    # a parametrized or pruned layer raised torch's "cannot assign 'torch.FloatTensor' as parameter 'weight'"
    # half-way through the model; a subclass lost its own buffers
    layer = make()
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), layer, nn.ReLU(), nn.Linear(32, 32))
    keys = set(model.state_dict())
    with caplog.at_level("WARNING", logger="minifloat"):
        mf.convert(model, keep_first_last=False)
    assert model[2] is layer and isinstance(model[0], mf.Fp8Linear) and isinstance(model[4], mf.Fp8Linear)
    assert f"2 ({reason}" in caplog.text
    assert keys <= set(model.state_dict())
    model(torch.randn(4, 32)).sum().backward()


def test_multihead_attentions_out_proj_is_left_and_said():
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.Linear(32, 32), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                          nn.Linear(32, 8))
    plan = fp8_plan(model)
    assert [n for n, _ in plan.unsupported] == ["1.layers.0.self_attn.out_proj", "1.layers.1.self_attn.out_proj"]
    assert "1.layers.0.linear1" in plan.convert


def test_scaling_state_saved_for_a_layer_now_kept_in_high_precision_loads_strictly(caplog):
    # an earlier minifloat converted MultiheadAttention's out_proj: its checkpoint's fp8_state keys failed a strict
    # load (a resume across the upgrade)
    def build():
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    old = build()
    old.layers[0].self_attn.out_proj = mf.Fp8Linear.from_linear(old.layers[0].self_attn.out_proj)
    saved = mf.convert(old, keep_first_last=False).state_dict()
    assert "layers.0.self_attn.out_proj.fp8_state.scale" in saved
    new = mf.convert(build(), keep_first_last=False)
    with caplog.at_level("WARNING", logger="minifloat"):
        new.load_state_dict(saved)  # strict
    assert "FP8 scaling state for 1 layer(s) this model keeps in high precision" in caplog.text
    assert torch.equal(new.layers[0].linear1.fp8_state.scale, saved["layers.0.linear1.fp8_state.scale"])
    with pytest.raises(RuntimeError, match="Unexpected key"):  # any other unexpected key still fails
        new.load_state_dict({**saved, "layers.0.linear1.bogus": torch.zeros(1)})
