"""Tests for minifloat.training.model: config validation and sizes, shapes, causality, RoPE, tying, QK-norm, the loss, and
the model under mf.convert, PrecisionPolicy and the precision audit."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

import minifloat as mf
from minifloat.safety.audit import audit
from minifloat.training.model import SIZES, Llama, LlamaConfig, apply_rope, rope_tables, swiglu_hidden
from minifloat.amp.policy import ISLAND_ATTR, PrecisionPolicy

# fp32 maths on identical inputs; only summation order may differ
FP32_RTOL, FP32_ATOL = 1e-5, 1e-5
# an untrained model's logits are near zero, so its loss is near ln(vocab) (uniform prediction)
UNTRAINED_LOSS_TOL = 0.3
# init std estimated from a few thousand samples: relative standard error about 1/sqrt(2n) ≈ 1%
INIT_STD_RTOL = 0.1
VOCAB = 256


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


@pytest.fixture
def tiny():
    return Llama(LlamaConfig.preset("tiny"))


def tokens(b: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def expected_params(c: LlamaConfig) -> int:
    """Parameters counted by hand: embeddings, per block 4 attention matrices (q, o: d × d; k, v: d × n_kv_head·hd)
    + 3 MLP matrices and two norm gains (+ QK-norm gains), the final norm."""
    attn = 2 * c.d_model ** 2 + 2 * c.d_model * c.kv_heads * c.head_dim
    block = attn + 3 * c.d_model * c.ffn_dim + 2 * c.d_model + (2 * c.head_dim if c.qk_norm else 0)
    embeddings = c.vocab_size * c.d_model * (1 if c.tie_embeddings else 2)
    return embeddings + c.n_layer * block + c.d_model


def block_linears(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("blocks.")]


# ------------------------------------------------------------------------------------------------ config and sizes

# (name, lowest and highest parameter count)
SIZE_TABLE = [
    ("tiny", 0.1e6, 0.3e6),
    ("small", 1e6, 2e6),
    ("10m", 8e6, 12e6),
    ("100m", 90e6, 110e6),
    ("350m", 250e6, 300e6),
    ("1b", 900e6, 1000e6),
]
# (name, parameters at vocab 256, at vocab 32,000): the counts SIZES' comment states
PRESET_COUNTS = [
    ("tiny", 117_056, 2_148_672),
    ("small", 1_238_656, 5_301_888),
    ("10m", 10_720_128, 22_909_824),
    ("100m", 99_309_312, 123_688_704),
    ("350m", 283_681_792, 348_693_504),
    ("1b", 974_194_688, 1_104_218_112),
]


@pytest.mark.parametrize("name,low,high", SIZE_TABLE, ids=[c[0] for c in SIZE_TABLE])
def test_param_counts(name, low, high):
    config = LlamaConfig.preset(name)
    with torch.device("meta"):  # no memory, no init: 100m is fine here
        model = Llama(config)
    assert all(p.is_meta for p in model.parameters())
    assert low <= model.num_params() <= high
    assert model.num_params() == expected_params(config)


@pytest.mark.parametrize("name, at_256, at_32k", PRESET_COUNTS, ids=[c[0] for c in PRESET_COUNTS])
def test_preset_counts_at_two_vocabularies(name, at_256, at_32k):
    for vocab, expected in ((256, at_256), (32_000, at_32k)):
        with torch.device("meta"):
            model = Llama(LlamaConfig.preset(name, vocab_size=vocab))
        assert model.num_params() == expected, (name, vocab)


# (name, the fields that make it Llama-3-shaped)
GPU_PRESETS = [("350m", dict(d_model=1024, n_layer=20, n_head=16, n_kv_head=8, d_ff=3584)),
               ("1b", dict(d_model=2048, n_layer=16, n_head=32, n_kv_head=8, d_ff=8192))]


@pytest.mark.parametrize("name, fields", GPU_PRESETS, ids=[c[0] for c in GPU_PRESETS])
def test_gpu_presets_are_llama3_shaped(name, fields):
    c = SIZES[name]
    assert {f: getattr(c, f) for f in fields} == fields
    assert (c.tie_embeddings, c.rope_theta, c.max_seq_len, c.head_dim) == (False, 500000.0, 2048, 64)
    with torch.device("meta"):  # untied: lm_head has its own weight
        model = Llama(c)
    assert model.lm_head.weight is not model.wte.weight
    assert model.blocks[0].attn.k_proj.weight.shape == (c.n_kv_head * c.head_dim, c.d_model)


def test_sizes_are_the_presets():
    assert list(SIZES) == [c[0] for c in SIZE_TABLE]
    assert LlamaConfig.preset("tiny") == SIZES["tiny"]


@pytest.mark.parametrize("name", ["tiny", "small", "10m"])
def test_forward_shapes(name):
    model = Llama(LlamaConfig.preset(name))
    idx = tokens(2, 8)
    logits, loss = model(idx)
    assert logits.shape == (2, 8, VOCAB) and loss is None
    _, loss = model(idx, tokens(2, 8, seed=2))
    assert loss.shape == () and loss.dtype == torch.float32


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError, match="'huge'.*tiny.*small.*10m.*100m"):
        LlamaConfig.preset("huge")


def test_preset_overrides_and_frozen():
    c = LlamaConfig.preset("small", qk_norm=True, max_seq_len=64)
    assert c.qk_norm and c.max_seq_len == 64 and c.d_model == SIZES["small"].d_model
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.n_layer = 3


# (d_model, default d_ff): 8/3·d rounded up to a multiple of 16
SWIGLU_HIDDEN = [(64, 176), (128, 352), (384, 1024), (768, 2048), (4096, 10928)]


@pytest.mark.parametrize("d,hidden", SWIGLU_HIDDEN, ids=[f"d{c[0]}" for c in SWIGLU_HIDDEN])
def test_swiglu_hidden(d, hidden):
    assert swiglu_hidden(d) == hidden
    assert LlamaConfig(d_model=d, n_head=4).ffn_dim == hidden
    assert LlamaConfig(d_model=d, n_head=4, d_ff=32).ffn_dim == 32


INVALID = [
    ("vocab-zero", dict(vocab_size=0), "vocab_size"),
    ("vocab-not-16", dict(vocab_size=50257), "vocab_size.*50257.*50272"),
    ("vocab-float", dict(vocab_size=256.0), "vocab_size"),
    ("n-layer-zero", dict(n_layer=0), "n_layer"),
    ("n-layer-bool", dict(n_layer=True), "n_layer"),
    ("n-head-negative", dict(n_head=-4), "n_head"),
    ("d-model-not-16", dict(d_model=72, n_head=4), "d_model"),
    ("d-model-not-divisible", dict(d_model=64, n_head=3), "n_head.*3"),
    ("head-dim-odd", dict(d_model=48, n_head=16), "n_head.*16"),
    ("d-ff-not-16", dict(d_ff=100), "d_ff.*100"),
    ("d-ff-zero", dict(d_ff=0), "d_ff"),
    ("max-seq-len-zero", dict(max_seq_len=0), "max_seq_len"),
    ("rope-theta-one", dict(rope_theta=1.0), "rope_theta"),
    ("rope-theta-nan", dict(rope_theta=float("nan")), "rope_theta"),
    ("rope-theta-str", dict(rope_theta="10000"), "rope_theta"),
    ("norm-eps-negative", dict(norm_eps=-1e-5), "norm_eps"),
    ("qk-norm-int", dict(qk_norm=1), "qk_norm"),
    ("tie-none", dict(tie_embeddings=None), "tie_embeddings"),
    ("n-kv-head-zero", dict(n_kv_head=0), "n_kv_head"),
    ("n-kv-head-float", dict(n_kv_head=2.0), "n_kv_head"),
    ("n-kv-head-not-a-divisor", dict(n_head=4, n_kv_head=3), "n_kv_head.*3"),
    ("n-kv-head-above-n-head", dict(n_head=4, n_kv_head=8), "n_kv_head.*8"),
    ("kv-width-not-16", dict(d_model=64, n_head=8, n_kv_head=1), "n_kv_head.*multiple of 16"),
    ("attention-unknown", dict(attention="flash"), "attention.*flash"),
]


@pytest.mark.parametrize("name,kwargs,message", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_config(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**kwargs)


def test_model_needs_a_config():
    with pytest.raises(ValueError, match="LlamaConfig"):
        Llama({"n_layer": 2})


# (name, idx shape, targets shape or None, text the message must contain)
BAD_INPUTS = [
    ("too-long", (1, 129), None, "T=129"),
    ("empty", (1, 0), None, "T=0"),
    ("one-dimensional", (16,), None, r"\(16,\)"),
    ("targets-shape", (2, 8), (2, 7), r"\(2, 7\)"),
]


@pytest.mark.parametrize("name,shape,target_shape,message", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs(tiny, name, shape, target_shape, message):
    idx = torch.zeros(shape, dtype=torch.long)
    targets = None if target_shape is None else torch.zeros(target_shape, dtype=torch.long)
    with pytest.raises(ValueError, match=message):
        tiny(idx, targets)


def test_longest_sequence_runs(tiny):
    t = tiny.config.max_seq_len
    assert tiny(tokens(1, t))[0].shape == (1, t, VOCAB)


# ------------------------------------------------------------------------------------------------ init and structure


def test_init_std(tiny):
    residual_std = 0.02 / math.sqrt(2 * tiny.config.n_layer)
    block = tiny.blocks[0]
    for w, std in [(tiny.wte.weight, 0.02), (block.attn.q_proj.weight, 0.02), (block.mlp.gate_proj.weight, 0.02),
                   (block.attn.o_proj.weight, residual_std), (block.mlp.down_proj.weight, residual_std)]:
        assert w.std().item() == pytest.approx(std, rel=INIT_STD_RTOL)
    assert torch.equal(block.attn_norm.weight, torch.ones(64))


def test_tied_head_shares_storage(tiny):
    assert tiny.lm_head.weight is tiny.wte.weight
    assert tiny.lm_head.weight.data_ptr() == tiny.wte.weight.data_ptr()


def test_untied_head_has_its_own_storage():
    tied = Llama(LlamaConfig.preset("tiny"))
    untied = Llama(LlamaConfig.preset("tiny", tie_embeddings=False))
    assert untied.lm_head.weight is not untied.wte.weight
    assert untied.lm_head.weight.data_ptr() != untied.wte.weight.data_ptr()
    assert untied.num_params() - tied.num_params() == VOCAB * 64
    _, loss = untied(tokens(2, 8), tokens(2, 8, seed=2))
    loss.backward()
    assert untied.lm_head.weight.grad is not None and untied.wte.weight.grad is not None


# ------------------------------------------------------------------------------------------------ causality and RoPE


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
def test_causal(qk_norm):
    model = Llama(LlamaConfig.preset("tiny", qk_norm=qk_norm))
    idx, t = tokens(2, 16), 9
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % VOCAB
    with torch.no_grad():
        before, after = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(after[:, :t], before[:, :t], rtol=FP32_RTOL, atol=FP32_ATOL)
    assert not torch.allclose(after[:, t:], before[:, t:], rtol=FP32_RTOL, atol=FP32_ATOL)


def test_rope_scores_depend_on_relative_position():
    hd, shift = 16, 37
    q, k = torch.randn(2, 8, hd), torch.randn(2, 8, hd)
    pos = torch.arange(8)

    def scores(offset):
        cos, sin = rope_tables(pos + offset, hd, theta=10000.0)
        return apply_rope(q, cos, sin) @ apply_rope(k, cos, sin).transpose(-2, -1)  # (2, 8, 8)

    torch.testing.assert_close(scores(shift), scores(0), rtol=1e-4, atol=1e-4)  # angles up to 44 rad in fp32
    assert not torch.allclose(scores(0), q @ k.transpose(-2, -1), atol=1e-2)  # it does rotate


def test_rope_is_a_rotation():
    hd = 16
    x = torch.randn(3, 10, hd)
    cos, sin = rope_tables(torch.arange(10), hd, theta=10000.0)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=FP32_RTOL, atol=FP32_ATOL)
    torch.testing.assert_close(y[:, 0], x[:, 0])  # position 0: angle 0
    # golden: feature pair (0, hd/2) of position 1 turns by exactly 1 radian (θ_0 = theta^0 = 1)
    e0 = torch.zeros(2, hd)
    e0[:, 0] = 1
    out = apply_rope(e0, cos[:2], sin[:2])[1]
    assert out[0].item() == pytest.approx(math.cos(1.0)) and out[hd // 2].item() == pytest.approx(math.sin(1.0))


def test_rope_keeps_bf16_dtype():
    cos, sin = rope_tables(torch.arange(4), 8, theta=10000.0)
    assert cos.dtype == torch.float32
    assert apply_rope(torch.randn(4, 8, dtype=torch.bfloat16), cos, sin).dtype == torch.bfloat16


def test_qk_norm():
    model = Llama(LlamaConfig.preset("tiny", qk_norm=True))
    attn = model.blocks[0].attn
    assert isinstance(attn.q_norm, mf.RMSNorm) and isinstance(attn.k_norm, mf.RMSNorm)
    assert attn.q_norm.normalized_shape == (model.config.head_dim,)
    assert model.num_params() == expected_params(model.config)
    idx = tokens(2, 16)
    _, loss = model(idx, tokens(2, 16, seed=2))
    loss.backward()
    assert attn.q_norm.weight.grad.abs().sum() > 0
    # normalized queries forget their scale: scaling q_proj changes nothing (up to eps)
    with torch.no_grad():
        before = model(idx)[0]
        attn.q_proj.weight.mul_(10)
        torch.testing.assert_close(model(idx)[0], before, rtol=1e-4, atol=1e-4)


def test_no_qk_norm_by_default(tiny):
    assert isinstance(tiny.blocks[0].attn.q_norm, nn.Identity)
    with torch.no_grad():
        before = tiny(tokens(2, 16))[0]
        tiny.blocks[0].attn.q_proj.weight.mul_(10)
        assert not torch.allclose(tiny(tokens(2, 16))[0], before, atol=1e-4)


# ------------------------------------------------------------------------------------------------ loss and training


def test_untrained_loss_is_uniform(tiny):
    _, loss = tiny(tokens(4, 64), tokens(4, 64, seed=2))
    assert loss.item() == pytest.approx(math.log(VOCAB), abs=UNTRAINED_LOSS_TOL)


def test_loss_ignores_minus_one(tiny):
    idx, targets = tokens(2, 8), tokens(2, 8, seed=2)
    logits, _ = tiny(idx)
    masked = targets.clone()
    masked[:, 4:] = -1
    _, loss = tiny(idx, masked)
    expected = torch.nn.functional.cross_entropy(logits[:, :4].reshape(-1, VOCAB), targets[:, :4].reshape(-1))
    torch.testing.assert_close(loss, expected, rtol=FP32_RTOL, atol=FP32_ATOL)


def test_adamw_steps_reduce_loss(tiny):
    idx = tokens(4, 32)
    x, y = idx[:, :-1], idx[:, 1:]
    opt = torch.optim.AdamW(tiny.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        _, loss = tiny(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


def test_bf16_autocast_loss_is_fp32(tiny):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = tiny(tokens(2, 16), tokens(2, 16, seed=2))
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32


def test_bf16_params_loss_is_fp32(tiny):
    tiny.to(torch.bfloat16)  # pure bf16, no autocast to upcast the cross-entropy
    logits, loss = tiny(tokens(2, 16), tokens(2, 16, seed=2))
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert loss.item() == pytest.approx(math.log(VOCAB), abs=UNTRAINED_LOSS_TOL)


# ------------------------------------------------------------------------------------------------ FP8 and precision


FIRST_QKV = {"blocks.0.attn.q_proj", "blocks.0.attn.k_proj", "blocks.0.attn.v_proj"}  # read the embedding output


def test_convert_takes_gqa_kv_projections_and_keeps_the_first_blocks():
    """Grouped-query k/v projections (d → n_kv_head·hd = 16 features) are FP8 layers as every other block linear;
    the first block's q/k/v stay high precision by role whatever their width."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny", n_kv_head=1, attention="sdpa"))
    mf.convert(model, recipe=mf.CurrentScaling())
    converted = {n for n, m in model.named_modules() if isinstance(m, mf.Fp8Linear)}
    assert converted == set(block_linears(model)) - FIRST_QKV
    assert model.blocks[1].attn.k_proj.out_features == model.config.head_dim == 16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(tokens(2, 16), tokens(2, 16, seed=2))
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_convert_takes_block_linears_but_first_and_head(tiny):
    linears = block_linears(tiny)
    assert len(linears) == 7 * tiny.config.n_layer
    mf.convert(tiny, recipe=mf.DelayedScaling())
    converted = {n for n, m in tiny.named_modules() if isinstance(m, mf.Fp8Linear)}
    assert converted == set(linears) - FIRST_QKV
    assert type(tiny.lm_head) is nn.Linear
    assert all(type(tiny.get_submodule(n)) is nn.Linear for n in FIRST_QKV)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = tiny(tokens(2, 16), tokens(2, 16, seed=2))
    loss.backward()
    assert loss.item() == pytest.approx(math.log(VOCAB), abs=UNTRAINED_LOSS_TOL)
    for name, p in tiny.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_policy_fp8_current_keeps_head_fp32(tiny):
    policy = PrecisionPolicy.preset("fp8-current")
    policy.apply(tiny)
    assert type(tiny.lm_head) is nn.Linear and tiny.lm_head.weight.dtype == torch.float32
    assert getattr(tiny.lm_head, ISLAND_ATTR) == "head"
    assert {n for n, m in tiny.named_modules() if isinstance(m, mf.Fp8Linear)} == set(block_linears(tiny)) - FIRST_QKV
    with policy.autocast("cpu"):
        logits, loss = tiny(tokens(2, 16), tokens(2, 16, seed=2))
    assert logits.dtype == torch.float32  # the head island returns fp32 logits
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in tiny.parameters())


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "bf16+fp8"])
def test_audit_finds_no_violations(tiny, fp8):
    if fp8:
        mf.convert(tiny, recipe=mf.DelayedScaling())
    idx, targets = tokens(2, 16), tokens(2, 16, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = audit(tiny, (idx, targets), loss_fn=lambda out, batch: out[1])
    assert report.violations == [] and report.head == "lm_head"
    softmax = [r for r in report.records if r.op.startswith("aten._softmax")]
    assert softmax and all(r.precision == "float32" for r in softmax)  # the audit saw the attention, in fp32
    assert any(r.precision == "fp8" for r in report.records) == fp8


@pytest.mark.parametrize("name, attention", [("1b", "fp32"), ("1b", "sdpa"), ("350m", "auto")])
def test_gpu_presets_forward_on_the_meta_device(name, attention):
    with torch.device("meta"):
        model = Llama(LlamaConfig.preset(name, attention=attention))
        logits, _ = model(torch.zeros(2, 16, dtype=torch.long))
    assert logits.shape == (2, 16, 256) and logits.device.type == "meta"


def test_100m_forward_runs_on_the_meta_device():
    # shapes of the largest size without allocating it: the fp32 islands must work where autocast does not exist
    with torch.device("meta"):
        model = Llama(LlamaConfig.preset("100m"))
        logits, _ = model(torch.zeros(2, 16, dtype=torch.long))
    assert logits.shape == (2, 16, 256) and logits.device.type == "meta"


# ------------------------------------------------------------------ attention implementation, grouped-query attention

def _logits(config: LlamaConfig, idx: torch.Tensor, state: dict | None = None) -> torch.Tensor:
    torch.manual_seed(0)
    model = Llama(config)
    if state is not None:
        model.load_state_dict(state)
    return model(idx)[0]


def test_auto_attention_is_the_fp32_path_on_cpu_bitwise():
    idx = tokens(2, 32)
    auto = _logits(LlamaConfig.preset("tiny"), idx)  # attention="auto", the default
    assert torch.equal(auto, _logits(LlamaConfig.preset("tiny", attention="fp32"), idx))


@pytest.mark.parametrize("n_kv_head", [None, 2], ids=["mha", "gqa"])
def test_sdpa_model_matches_the_fp32_model(n_kv_head):
    idx = tokens(2, 32)
    fp32 = _logits(LlamaConfig.preset("tiny", n_kv_head=n_kv_head, attention="fp32"), idx)
    sdpa = _logits(LlamaConfig.preset("tiny", n_kv_head=n_kv_head, attention="sdpa"), idx)
    torch.testing.assert_close(sdpa, fp32, rtol=FP32_RTOL, atol=FP32_ATOL)


@pytest.mark.parametrize("attention", ["fp32", "sdpa"])
def test_as_many_kv_heads_as_heads_is_multi_head_attention_bitwise(attention):
    idx = tokens(2, 32)
    mha = _logits(LlamaConfig.preset("tiny", attention=attention), idx)
    assert torch.equal(_logits(LlamaConfig.preset("tiny", n_kv_head=4, attention=attention), idx), mha)


@pytest.mark.parametrize("attention", ["fp32", "sdpa"])
@pytest.mark.parametrize("n_kv_head", [1, 2])
def test_gqa_is_multi_head_attention_with_repeated_kv_heads(attention, n_kv_head):
    """A GQA model computes what a multi-head model computes whose k/v projections repeat each kv head's rows for
    its n_head / n_kv_head query heads (Hugging Face's repeat_kv, on the weights)."""
    torch.manual_seed(0)
    gqa = Llama(LlamaConfig.preset("tiny", n_kv_head=n_kv_head, attention=attention))
    c = gqa.config
    state = gqa.state_dict()
    for key in [k for k in state if k.endswith(("k_proj.weight", "v_proj.weight"))]:
        w = state[key].view(n_kv_head, c.head_dim, c.d_model)  # (H_kv, hd, C)
        state[key] = w.repeat_interleave(c.n_head // n_kv_head, dim=0).reshape(c.d_model, c.d_model)
    idx = tokens(2, 32)
    mha = _logits(LlamaConfig.preset("tiny", attention=attention), idx, state)
    torch.testing.assert_close(gqa(idx)[0], mha, rtol=FP32_RTOL, atol=FP32_ATOL)
    assert gqa.num_params() == expected_params(c) < Llama(LlamaConfig.preset("tiny")).num_params()


def test_sdpa_model_under_bf16_autocast_passes_the_audit():
    model = Llama(LlamaConfig.preset("tiny", n_kv_head=2, attention="sdpa"))
    idx, targets = tokens(2, 16), tokens(2, 16, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = audit(model, (idx, targets), loss_fn=lambda out, batch: out[1])
    assert report.violations == []
    fused = [r for r in report.records if "scaled_dot_product" in r.op]
    # forward and backward of each block's fused kernel, judged by its fp32 softmax statistics (logsumexp)
    assert len(fused) == 2 * model.config.n_layer and {r.precision for r in fused} == {"float32"}
    forward = {r.module for r in fused if r.phase == "forward"}
    assert forward == {f"blocks.{i}.attn" for i in range(model.config.n_layer)}


@pytest.mark.slow  # ~20 s of inductor compile on a CPU
@pytest.mark.parametrize("attention", ["fp32", "sdpa"])
def test_compiled_gqa_model_matches_eager(attention):
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny", n_kv_head=2, attention=attention))
    idx, targets = tokens(2, 32), tokens(2, 32, seed=2)
    eager_logits, eager_loss = model(idx, targets)
    logits, loss = torch.compile(model)(idx, targets)
    torch.testing.assert_close(logits, eager_logits, rtol=FP32_RTOL, atol=FP32_ATOL)
    torch.testing.assert_close(loss, eager_loss, rtol=FP32_RTOL, atol=FP32_ATOL)
