"""Tests for minifloat.core.roles: norms, embeddings, the output head and the input projections, recognised by role.

Hugging Face models are in tests/test_hf_convert.py (transformers is optional).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minifloat.amp.norms import LayerNorm, RMSNorm
from minifloat.core import roles
from minifloat.training.demo import ByteMLP
from minifloat.training.model import Llama, LlamaConfig

D = 32


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


class ManualNorm(nn.Module):
    def forward(self, x):
        return x / x.square().mean(-1, keepdim=True).add(1e-6).sqrt()


class OddlyNamedLayerNorm(nn.LayerNorm):  # a subclass keeps its parent's role whatever its name
    pass


class _WeightNorm(nn.Module):  # torch's weight-norm parametrization is named like this: not an activation norm
    pass


class NormalizedAttention(nn.Module):  # "norm" inside a name does not make a norm
    pass


# (name, module, is a norm)
NORMS = [
    ("layer-norm", nn.LayerNorm(D), True),
    ("rms-norm", nn.RMSNorm(D), True),
    ("batch-norm-1d", nn.BatchNorm1d(D), True),
    ("group-norm", nn.GroupNorm(4, D), True),
    ("instance-norm-2d", nn.InstanceNorm2d(D), True),
    ("minifloat-rms-norm", RMSNorm(D), True),
    ("minifloat-layer-norm", LayerNorm(D), True),
    ("hand-written", ManualNorm(), True),
    ("subclass", OddlyNamedLayerNorm(D), True),
    ("weight-norm-parametrization", _WeightNorm(), False),
    ("norm-in-the-middle", NormalizedAttention(), False),
    ("linear", nn.Linear(D, D), False),
]


@pytest.mark.parametrize("name, module, expected", NORMS, ids=[c[0] for c in NORMS])
def test_is_norm(name, module, expected):
    assert roles.is_norm(module) == expected


def test_embeddings_and_tied_weights():
    model = nn.ModuleDict({"wte": nn.Embedding(64, D), "bag": nn.EmbeddingBag(64, D), "out": nn.Linear(D, 64)})
    model["out"].weight = model["wte"].weight
    assert roles.is_embedding(model["wte"]) and roles.is_embedding(model["bag"])
    assert not roles.is_embedding(model["out"])
    assert roles.embedding_param_ids(model) == {id(model["wte"].weight), id(model["bag"].weight)}


class HeadFirst(nn.Module):
    """Registers its head before its layers: module order is not execution order."""

    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(D, 64)
        self.inp = nn.Linear(D, D)
        self.mid = nn.Linear(D, D)


class TiedDecoder(nn.Module):
    """BERT-style masked-LM head: a transform, then a decoder tied to the word embedding (no head-like name)."""

    def __init__(self):
        super().__init__()
        self.words = nn.Embedding(64, D)
        self.layer = nn.ModuleDict({"query": nn.Linear(D, D), "key": nn.Linear(D, D), "value": nn.Linear(D, D),
                                    "dense": nn.Linear(D, D)})
        self.transform = nn.Linear(D, D)
        self.decoder = nn.Linear(D, 64)
        self.decoder.weight = self.words.weight


class WithPooler(nn.Module):
    """BertModel's shape: blocks, then a pooler that sentence embeddings never use."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"q": nn.Linear(D, D), "k": nn.Linear(D, D), "v": nn.Linear(D, D),
                                                   "out": nn.Linear(D, D)}) for _ in range(2))
        self.pooler = nn.ModuleDict({"dense": nn.Linear(D, D)})


class FusedQKV(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"qkv": nn.Linear(D, 3 * D), "proj": nn.Linear(D, D)})
                                    for _ in range(2))
        self.head = nn.Linear(D, 10)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))


def llama(**overrides) -> Llama:
    return Llama(LlamaConfig.preset("tiny", **overrides))


LLAMA_QKV = {"blocks.0.attn.q_proj", "blocks.0.attn.k_proj", "blocks.0.attn.v_proj"}

# (name, model factory, output head, input projections)
ROLE_CASES = [
    ("reference-llama", llama, "lm_head", LLAMA_QKV),
    ("reference-llama-untied", lambda: llama(tie_embeddings=False), "lm_head", LLAMA_QKV),
    ("reference-llama-one-block", lambda: llama(n_layer=1), "lm_head", LLAMA_QKV),
    ("mlp", mlp, "4", {"0"}),
    ("byte-mlp", ByteMLP, "mlp.6", {"mlp.0"}),
    ("head-registered-first", HeadFirst, "lm_head", {"inp"}),
    ("tied-decoder", TiedDecoder, "decoder", {"layer.query", "layer.key", "layer.value"}),
    ("pooler-not-the-head", WithPooler, "blocks.1.out", {"blocks.0.q", "blocks.0.k", "blocks.0.v"}),
    ("fused-qkv", FusedQKV, "head", {"layers.0.qkv"}),
    ("single-linear", lambda: nn.Sequential(nn.Linear(D, D)), "0", set()),
    ("no-linear", lambda: nn.Sequential(nn.ReLU()), None, set()),
]


@pytest.mark.parametrize("name, build, head, first", ROLE_CASES, ids=[c[0] for c in ROLE_CASES])
def test_head_and_input_projections(name, build, head, first):
    model = build()
    assert roles.output_head(model) == head
    assert set(roles.input_projections(model)) == first
    assert roles.first_and_last(model) == first | ({head} if head is not None else set())


def test_head_names_in_priority_order():
    model = nn.ModuleDict({"head": nn.Linear(D, D), "lm_head": nn.Linear(D, 64), "output": nn.Linear(64, 64)})
    assert roles.output_head(model) == "lm_head"
    assert roles.output_head(model, names=("output", "lm_head")) == "output"


@pytest.mark.parametrize("name, expected", [
    ("blocks.0.attn.q_proj", True), ("encoder.layer.0.attention.self.key", True), ("h.0.attn.c_attn", True),
    ("layers.0.self_attention.query_key_value", True), ("blocks.0.attn.o_proj", False),
    ("encoder.layer.0.attention.output.dense", False), ("blocks.0.mlp.up_proj", False), ("lm_head", False),
])
def test_is_attention_input(name, expected):
    assert roles.is_attention_input(name) == expected


@pytest.mark.parametrize("features, ok", [((16, 32), True), ((32, 48), True), ((10, 32), False), ((32, 30), False)])
def test_fp8_shape_ok(features, ok):
    assert roles.fp8_shape_ok(nn.Linear(*features)) == ok


class TwoStacks(nn.Module):
    """A short list of blocks beside a longer one, and a list of mixed types: the longest uniform list wins."""

    def __init__(self):
        super().__init__()
        self.adapters = nn.ModuleList([nn.Sequential(nn.Linear(D, D)) for _ in range(2)])
        self.mixed = nn.ModuleList([nn.Linear(D, D), nn.Sequential(nn.Linear(D, D)), nn.Linear(D, D),
                                    nn.Linear(D, D), nn.Linear(D, D)])
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(D, D), nn.GELU()) for _ in range(3)])


# (name, model, blocks)
BLOCKS = [
    ("llama", lambda: Llama(LlamaConfig.preset("tiny")), ["blocks.0", "blocks.1"]),
    ("two-stacks", TwoStacks, ["layers.0", "layers.1", "layers.2"]),
    ("mlp", lambda: nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, D)), []),
    ("norms-only", lambda: nn.ModuleList([nn.LayerNorm(D) for _ in range(4)]), []),  # no linear in a block
]


@pytest.mark.parametrize("make, blocks", [c[1:] for c in BLOCKS], ids=[c[0] for c in BLOCKS])
def test_transformer_blocks(make, blocks):
    assert roles.transformer_blocks(make()) == blocks


@pytest.mark.parametrize("first, last, kept", [(0, 0, []), (1, 0, ["0"]), (0, 1, ["2"]), (1, 1, ["0", "2"]),
                                                (2, 2, ["0", "1", "2"]), (0, 9, ["0", "1", "2"])])
def test_linears_in_first_and_last_blocks(first, last, kept):
    assert roles.linears_in_blocks(TwoStacks(), first, last) == {f"layers.{i}.0" for i in kept}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)


class EncoderDecoder(nn.Module):
    """T5's layout: an encoder stack and a shorter decoder stack of the same block type; each block's experts form a
    longer list inside it."""

    def __init__(self, encoder=3, decoder=2):
        super().__init__()
        self.encoder = nn.ModuleList([Block() for _ in range(encoder)])
        self.decoder = nn.ModuleList([Block() for _ in range(decoder)])
        for block in self.decoder:
            block.experts = nn.ModuleList([nn.Sequential(nn.Linear(D, D)) for _ in range(6)])


def test_every_stack_of_an_encoder_decoder_keeps_its_own_first_and_last_blocks():
    # the encoder's blocks alone were taken: nvfp4's "last block in BF16" kept the encoder's, not the decoder block
    # that feeds the head
    model = EncoderDecoder()
    assert roles.block_stacks(model) == [["encoder.0", "encoder.1", "encoder.2"], ["decoder.0", "decoder.1"]]
    kept = roles.linears_in_blocks(model, 0, 1)
    assert kept == {"encoder.2.proj", "decoder.1.proj"} | {f"decoder.1.experts.{i}.0" for i in range(6)}
    assert roles.linears_in_blocks(model, 0.5, 0) == {"encoder.0.proj", "encoder.1.proj", "decoder.0.proj"} | {
        f"decoder.0.experts.{i}.0" for i in range(6)}


def test_a_hugging_face_t5_has_two_stacks():
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=2,
                                   num_heads=4)
    stacks = roles.block_stacks(transformers.T5ForConditionalGeneration(config))
    assert stacks == [[f"encoder.block.{i}" for i in range(3)], [f"decoder.block.{i}" for i in range(2)]]


class OutputInBlocks(nn.Module):
    """A transformer whose attention out-projection is called `output` and whose head has no head name."""

    def __init__(self, vocab=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, D)
        self.layers = nn.ModuleList(nn.ModuleDict({"qkv": nn.Linear(D, 3 * D), "output": nn.Linear(D, D)})
                                    for _ in range(3))
        self.to_logits = nn.Linear(D, vocab)


def test_a_blocks_output_projection_is_not_the_head():
    # layers.2.output was taken as the head (fp32 island) and the real head, to_logits, ran in FP8
    model = OutputInBlocks()
    assert roles.output_head(model) == "to_logits"
    model.output = nn.Linear(64, 8)  # named so outside the blocks, it is the head again
    assert roles.output_head(model) == "output"


def test_an_encoder_decoder_of_unequal_stacks_has_both():
    # Whisper's encoder and decoder layers are classes of their own, 4 and 2 here (distil-whisper: 32 and 2)
    transformers = pytest.importorskip("transformers")
    config = transformers.WhisperConfig(vocab_size=128, d_model=64, encoder_layers=4, decoder_layers=2,
                                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                        decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=32,
                                        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                        decoder_start_token_id=1)
    stacks = roles.block_stacks(transformers.WhisperForConditionalGeneration(config))
    assert [len(s) for s in stacks] == [4, 2] and stacks[1][0] == "model.decoder.layers.0"


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, D), nn.Linear(D, D)


class MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(Expert() for _ in range(4))


def test_experts_in_a_list_of_mixed_blocks_are_no_stack():
    # a hybrid (attention and MoE blocks in one list, not uniform): each block's experts were taken as a stack, and
    # keep_blocks kept the first and last experts
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Sequential(nn.Linear(D, D)), MoEBlock(), nn.Sequential(nn.Linear(D, D)),
                                  MoEBlock()])
    assert roles.block_stacks(model) == []
    assert roles.linears_in_blocks(model, 1, 1) == set()


def test_embedding_tables_and_conv_parametrizations_are_no_stacked_weights():
    model = nn.Module()
    model.cls_token, model.pos_embed = nn.Parameter(torch.zeros(1, 1, D)), nn.Parameter(torch.zeros(1, 17, D))
    model.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(D, D, 3), dim=2)
    assert roles.stacked_weights(model) == {}
