"""Tests for minifloat.amp.policy: presets, validation, apply() on a plain nn.Module, autocast and describe()."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

import minifloat as mf
from minifloat.amp.master import MasterWeightOptimizer
from minifloat.amp.norms import LayerNorm, RMSNorm
from minifloat.amp.policy import ISLAND_ATTR, PRESETS, PrecisionPolicy

# fp32 islands against an fp32 copy of the same module: identical maths, only summation order may differ
FP32_RTOL, FP32_ATOL = 1e-5, 1e-6
VOCAB, D, T = 64, 32, 8

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16


class TinyLM(nn.Module):
    """Embedding → LayerNorm → MLP (three Linear) → RMSNorm → lm_head, with a BatchNorm and a Softmax on the side."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.ln = nn.LayerNorm(D)
        self.up = nn.Linear(D, 2 * D)
        self.mid = nn.Linear(2 * D, 2 * D)
        self.down = nn.Linear(2 * D, D)
        self.bn = nn.BatchNorm1d(D)
        self.norm = nn.RMSNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.probs = nn.Softmax(dim=-1)

    def forward(self, idx):
        x = self.embed(idx)  # (B, T, D)
        h = self.down(F.gelu(self.mid(F.gelu(self.up(self.ln(x))))))
        x = x + self.bn(h.transpose(1, 2)).transpose(1, 2)
        return self.lm_head(self.norm(x))  # (B, T, VOCAB)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return TinyLM()


@pytest.fixture
def idx():
    return torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(1))


# (name, param_dtype, compute_dtype, recipe type, autocast enabled)
PRESET_TABLE = [
    ("fp32", FP32, FP32, None, False),
    ("bf16", FP32, BF16, None, True),
    ("fp16", FP32, FP16, None, True),
    ("fp8-delayed", FP32, BF16, mf.DelayedScaling, True),
    ("fp8-current", FP32, BF16, mf.CurrentScaling, True),
    ("fp8-block", FP32, BF16, mf.BlockScaling, True),
    ("mxfp8", FP32, BF16, mf.MXScaling, True),
    ("nvfp4", FP32, BF16, mf.NVFP4Scaling, True),
    ("mxfp4", FP32, BF16, mf.MXScaling, True),
]


@pytest.mark.parametrize("name,param,compute,recipe,autocast", PRESET_TABLE, ids=[p[0] for p in PRESET_TABLE])
def test_presets(name, param, compute, recipe, autocast):
    p = PrecisionPolicy.preset(name)
    assert (p.param_dtype, p.compute_dtype, p.autocast_enabled) == (param, compute, autocast)
    assert (type(p.recipe) if p.recipe is not None else None) is recipe
    assert not p.master_weights and p.state_dtype == FP32 and p.reduce_dtype == FP32
    assert all((p.fp32_norms, p.fp32_softmax, p.fp32_cross_entropy, p.fp32_attention, p.fp32_embeddings,
                p.fp32_head))


def test_preset_table_is_complete():
    assert sorted(PRESETS) == sorted(p[0] for p in PRESET_TABLE)


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError, match="known: .*'bf16'.*'mxfp8'"):
        PrecisionPolicy.preset("fp4")


def test_replace_derives_pure_bf16_with_master_weights():
    p = dataclasses.replace(PrecisionPolicy.preset("bf16"), param_dtype=BF16, master_weights=True)
    assert p.state_dtype == FP32
    assert dataclasses.replace(p, master_weights=False).state_dtype == BF16
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.param_dtype = FP32


INVALID = [
    ("param-dtype", dict(param_dtype=torch.float64), "param_dtype"),
    ("param-dtype-str", dict(param_dtype="bf16"), "param_dtype"),
    ("compute-dtype", dict(compute_dtype=torch.int8), "compute_dtype"),
    ("compute-above-params", dict(param_dtype=BF16, compute_dtype=FP32), "compute_dtype"),
    ("compute-other-half", dict(param_dtype=FP16, compute_dtype=BF16), "compute_dtype"),
    ("reduce-dtype", dict(reduce_dtype=torch.float64), "reduce_dtype"),
    ("master-not-bool", dict(param_dtype=BF16, compute_dtype=BF16, master_weights=1), "master_weights"),
    ("master-fp32-params", dict(master_weights=True), "master_weights"),
    ("state-dtype", dict(param_dtype=BF16, compute_dtype=BF16, master_weights=True, optimizer_state_dtype=BF16),
     "optimizer_state_dtype"),
    ("state-format-unknown", dict(optimizer_state_dtype="e4m3,int3"), "optimizer_state_dtype"),
    ("state-format-empty", dict(optimizer_state_dtype=()), "optimizer_state_dtype"),
    ("state-format-type", dict(optimizer_state_dtype=8), "optimizer_state_dtype"),
    ("recipe", dict(recipe="delayed"), "recipe"),
    ("keep-blocks-one", dict(keep_blocks=(1,)), "keep_blocks"),
    ("keep-blocks-negative", dict(keep_blocks=(0, -1)), "keep_blocks"),
    ("keep-blocks-float", dict(keep_blocks=(0, 1.0)), "keep_blocks"),  # a fraction is below 1; 1 block is int 1
    ("keep-blocks-nan", dict(keep_blocks=(0, float("nan"))), "keep_blocks"),
    ("keep-blocks-bool", dict(keep_blocks=(True, 0)), "keep_blocks"),
    ("fp32-norms", dict(fp32_norms="yes"), "fp32_norms"),
    ("fp32-head", dict(fp32_head=None), "fp32_head"),
]


def _tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(64, 96), nn.Linear(96, 128), nn.LayerNorm(128), nn.Linear(128, 64))


@pytest.mark.parametrize("master", [False, True, "bf16-sr"])
def test_state_formats_build_a_blockwise_optimizer(master):
    from minifloat.optim import AdamW

    bf16 = master is not False
    policy = PrecisionPolicy(param_dtype=BF16 if bf16 else FP32, compute_dtype=BF16 if bf16 else FP32,
                             master_weights=master, optimizer_state_dtype="e4m3, bf16")
    assert policy.state_formats == ("e4m3", "bf16") and policy.state_dtype == (FP32 if master or not bf16 else BF16)
    out = io.StringIO()
    Console(file=out, width=200).print(policy.describe())
    assert "e4m3,bf16 (per block)" in out.getvalue()
    model = policy.apply(_tiny_model())
    opt = policy.optimizer(AdamW, model, lr=1e-3)
    x = torch.randint(0, 64, (4, 8))
    model(x).float().pow(2).mean().backward()
    opt.step()
    inner = getattr(opt, "optimizer", opt)  # the master wrappers hold the AdamW
    assert isinstance(inner, AdamW) and inner.state_formats == ("e4m3", "bf16")
    stored = {t.dtype for state in inner.state.values() for k, t in state.items() if k.startswith("exp_avg")}
    assert torch.float8_e4m3fn in stored and BF16 in stored  # the 128×96 and 64×128 weights: quantized states
    # the embedding (6144 elements, over the 4096 size rule) keeps fp32 state: the model reached the rule
    emb = model[0].weight
    assert emb.dtype == FP32 and any(p is emb for g in inner.param_groups for p in g["params"])
    assert inner.keeps_fp32_state(emb) and inner.state[emb]["exp_avg"].dtype == FP32


def test_state_formats_refuse_a_torch_optimizer():
    policy = PrecisionPolicy(optimizer_state_dtype=("int8-dynamic", "int4"))
    with pytest.raises(ValueError, match="minifloat.optim"):
        policy.optimizer(torch.optim.AdamW, _tiny_model(), lr=1e-3)


def test_optimizer_refuses_an_optimizer_instance():
    model = _tiny_model()
    with pytest.raises(TypeError, match=r"takes an optimizer class .* got an instance of AdamW"):
        PrecisionPolicy.preset("fp8-delayed").optimizer(torch.optim.AdamW(model.parameters()), model)


@pytest.mark.parametrize("name,kwargs,field", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_fields(name, kwargs, field):
    with pytest.raises(ValueError, match=field):
        PrecisionPolicy(**kwargs)


def test_apply_bf16_params(model, idx):
    p = dataclasses.replace(PrecisionPolicy.preset("bf16"), param_dtype=BF16, master_weights=True)
    p.apply(model)
    assert type(model.ln) is LayerNorm and type(model.norm) is RMSNorm
    fp32 = {"embed.weight", "ln.weight", "ln.bias", "bn.weight", "bn.bias", "norm.weight", "lm_head.weight"}
    for name, param in model.named_parameters():
        assert param.dtype == (FP32 if name in fp32 else BF16), name
    assert model.bn.running_mean.dtype == FP32
    with p.autocast("cpu"):
        logits = model(idx)
    assert logits.dtype == FP32  # the head returns fp32 logits
    assert model.embed(idx).dtype == BF16  # embeddings return param_dtype for the bf16 body
    loss = F.cross_entropy(logits.flatten(0, 1), idx.flatten())
    loss.backward()
    assert all(param.grad is not None and param.grad.dtype == param.dtype for param in model.parameters())
    opt = p.optimizer(torch.optim.SGD, model, lr=0.1)
    assert isinstance(opt, MasterWeightOptimizer) and len(opt.master.pairs) == 6  # up/mid/down weight and bias
    opt.step()


def test_islands_compute_in_fp32(model, idx):
    p = PrecisionPolicy.preset("bf16")
    p.apply(model)
    x = torch.randn(4, T, D, generator=torch.Generator().manual_seed(2))
    with p.autocast("cpu"):
        x16 = x.to(BF16)
        norm_out, head_out = model.norm(x16), model.lm_head(x16)
        plain_head = F.linear(x16, model.lm_head.weight)
    assert norm_out.dtype == BF16 and head_out.dtype == FP32 and plain_head.dtype == BF16
    ref_norm = F.rms_norm(x16.float(), (D,), model.norm.weight, model.norm.eps).to(BF16)
    torch.testing.assert_close(norm_out, ref_norm, rtol=0, atol=0)
    torch.testing.assert_close(head_out, F.linear(x16.float(), model.lm_head.weight), rtol=FP32_RTOL, atol=FP32_ATOL)
    probs = model.probs(x16)
    assert probs.dtype == BF16
    torch.testing.assert_close(probs, torch.softmax(x16.float(), -1).to(BF16), rtol=0, atol=0)


@pytest.mark.parametrize("preset", ["bf16", "fp8-delayed"])
def test_a_whole_model_with_islands_saves_and_loads(preset, model, idx):
    # torch.save(model) / torch.load: the islands' wrapped forwards come back bound to the loaded modules (a bound
    # method set on the instance could not be unpickled: "'Embedding' object has no attribute '_island_forward'")
    p = PrecisionPolicy.preset(preset)
    p.apply(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.lm_head.forward.args[0] is loaded.lm_head
    x = torch.randn(4, T, D, generator=torch.Generator().manual_seed(2))
    with p.autocast("cpu"):
        ours, theirs = model.lm_head(x.to(BF16)), loaded.lm_head(x.to(BF16))
    assert ours.dtype == theirs.dtype == FP32 and torch.equal(ours, theirs)


@pytest.mark.parametrize("preset", ["fp8-delayed", "fp8-current", "fp8-block", "mxfp8", "nvfp4", "mxfp4"])
def test_apply_fp8_converts_inner_linears(preset, model, idx):
    p = PrecisionPolicy.preset(preset)
    planned = sorted(n for n, k in p.plan(model).items() if k == "fp8")  # what describe() reports beforehand
    p.apply(model)
    assert planned == ["down", "mid"]
    # up is the first nn.Linear and lm_head the head: both stay high precision (mf.convert's rule and fp32_head)
    assert sorted(m.fp8_name for m in mf.fp8_layers(model)) == ["down", "mid"]
    assert type(model.up) is nn.Linear and type(model.lm_head) is nn.Linear
    with p.autocast("cpu"):
        logits = model(idx)
    assert logits.dtype == FP32 and torch.isfinite(logits).all()
    logits.sum().backward()
    assert model.mid.weight.grad is not None


def test_four_bit_presets_keep_the_last_block_of_a_transformer():
    from minifloat.training.model import Llama, LlamaConfig

    llama = Llama(LlamaConfig.preset("tiny"))  # two blocks
    for preset in ("nvfp4", "mxfp4"):
        kinds = PrecisionPolicy.preset(preset).plan(llama)
        low = sorted(n for n, k in kinds.items() if k == "fp8")
        # block 0 without its q/k/v (keep_first_last's input projections); block 1 kept whole; the head is fp32
        assert low == ["blocks.0.attn.o_proj", "blocks.0.mlp.down_proj", "blocks.0.mlp.gate_proj",
                       "blocks.0.mlp.up_proj"], preset
    keep_first = dataclasses.replace(PrecisionPolicy.preset("nvfp4"), keep_blocks=(1, 0)).plan(llama)
    low = [n for n, k in keep_first.items() if k == "fp8"]
    assert len(low) == 7 and all(n.startswith("blocks.1.") for n in low)  # block 1 whole, q/k/v included
    # fractions of the blocks round up to whole blocks: any fraction above 0 of two blocks keeps at least one
    for fractions, counts in [((0.01, 0), (1, 0)), ((0, 0.5), (0, 1)), ((0.0, 0.99), (0, 2))]:
        got = dataclasses.replace(PrecisionPolicy.preset("nvfp4"), keep_blocks=fractions).plan(llama)
        assert got == dataclasses.replace(PrecisionPolicy.preset("nvfp4"), keep_blocks=counts).plan(llama), fractions


def test_a_policy_that_keeps_every_block_says_so_in_its_own_terms(caplog):
    """keep_blocks covering every block leaves no linear in FP8: one warning, which names keep_blocks (what the user
    set), and no word of convert's `filter` (which the user never wrote); the model stays wholly high precision."""
    from minifloat.training.model import Llama, LlamaConfig

    llama = Llama(LlamaConfig.preset("tiny"))  # two blocks
    policy = dataclasses.replace(PrecisionPolicy.preset("fp8-delayed"), keep_blocks=(1, 1))
    with caplog.at_level("WARNING", logger="minifloat"):
        policy.apply(llama)
    assert not any(isinstance(m, mf.Fp8Linear) for m in llama.modules())
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages
    assert "no linear layer runs in DelayedScaling" in messages[0] and "keep_blocks=(1, 1)" in messages[0]
    assert "filter" not in messages[0]


@pytest.mark.parametrize("keep, n_blocks, want", [
    (0.15, 6, 1), (0.15, 20, 3), (0.15, 62, 10), (0.5, 6, 3), (0.0, 62, 0), (0.99, 4, 4), (2, 62, 2), (0, 6, 0),
])
def test_block_count_rounds_fractions_up(keep, n_blocks, want):
    from minifloat.core.roles import block_count

    assert block_count(keep, n_blocks) == want  # 0.15 · 20 is 3.0000000000000004 in binary: still 3 blocks


def test_apply_twice_is_idempotent(model, idx):
    p = PrecisionPolicy.preset("bf16")
    p.apply(model)
    with p.autocast("cpu"):
        once = model(idx)
    p.apply(model)
    with p.autocast("cpu"):
        twice = model(idx)
    assert torch.equal(once, twice)
    assert model.lm_head.minifloat_fp32_island == "head"


HEADS = [
    ("named-lm_head", "auto", "lm_head"),
    ("override", "mid", "mid"),
    ("none", None, None),
]


@pytest.mark.parametrize("name,head,expected", HEADS, ids=[h[0] for h in HEADS])
def test_head_choice(name, head, expected, model):
    kinds = PrecisionPolicy.preset("bf16").plan(model, head=head)
    assert [n for n, k in kinds.items() if k == "head"] == ([expected] if expected else [])


def test_head_falls_back_to_last_linear():
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert PrecisionPolicy().plan(seq)["2"] == "head"


def test_unknown_head_raises(model):
    with pytest.raises(ValueError, match="head"):
        PrecisionPolicy().apply(model, head="decoder")


def test_islands_off_leave_modules_alone(model):
    p = dataclasses.replace(PrecisionPolicy.preset("bf16"), param_dtype=BF16, fp32_norms=False, fp32_embeddings=False,
                            fp32_head=False, fp32_softmax=False)
    p.apply(model)
    assert type(model.ln) is nn.LayerNorm
    assert all(param.dtype == BF16 for param in model.parameters())
    assert not any(hasattr(m, ISLAND_ATTR) for m in model.modules())


def render(table) -> str:
    buf = io.StringIO()
    Console(file=buf, width=200).print(table)
    return buf.getvalue()


def test_describe_model_mentions_each_module(model):
    text = render(PrecisionPolicy.preset("fp8-delayed").describe(model))
    for name in ("embed", "ln", "up", "mid", "down", "bn", "norm", "lm_head", "probs"):
        assert f"│ {name} " in text, name
    assert "DelayedScaling" in text


def test_describe_policy():
    text = render(PrecisionPolicy.preset("fp16").describe())
    for part in ("parameters", "fp16 (torch.autocast)", "master weights", "optimizer state", "norms", "softmax",
                 "cross-entropy", "attention", "embeddings", "output head", "gradient reduction"):
        assert part in text, part


def test_fp32_autocast_is_off(model, idx):
    p = PrecisionPolicy.preset("fp32")
    p.apply(model)
    with p.autocast("cpu"):
        assert not torch.is_autocast_enabled("cpu")
        assert model(idx).dtype == FP32
