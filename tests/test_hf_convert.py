"""convert() and PrecisionPolicy on Hugging Face transformers models (optional dependency: skipped when transformers
is absent).

Models are built from small configs with random weights (no download). `keep_first_last` keeps, by role, the first
block's attention input projections (q, k and v together) and the output head: lm_head, classifier, a decoder tied
to the word embedding, or (BertModel, whose pooler sentence embeddings never use) the last encoder projection.
"""

from __future__ import annotations

import pytest
import torch

import minifloat as mf
from minifloat.amp.policy import PrecisionPolicy
from minifloat.core import roles
from minifloat.fp8.convert import fp8_plan

transformers = pytest.importorskip("transformers")

# FP8 (E4M3 forward) logits against the high-precision model with the same weights; the first and last layers stay
# in high precision, so the floor sits near E4M3's ~28 dB single-cast SQNR minus accumulated error
LOGITS_SQNR_FLOOR_DB = 15.0
VOCAB, HIDDEN = 128, 64


def bert_config():
    return transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=128, max_position_embeddings=64)


def llama_config(**overrides):
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                    **overrides)


def tiny_llama(**overrides):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama_config(**overrides)).eval()


BERT_QKV = {f"encoder.layer.0.attention.self.{p}" for p in ("query", "key", "value")}
LLAMA_QKV = {f"model.layers.0.self_attn.{p}_proj" for p in "qkv"}

# (name, model factory, output head, layers keep_first_last keeps)
KEPT = [
    ("bert", lambda: transformers.BertModel(bert_config()),
     "encoder.layer.1.output.dense", BERT_QKV | {"encoder.layer.1.output.dense"}),
    ("bert-masked-lm", lambda: transformers.BertForMaskedLM(bert_config()),
     "cls.predictions.decoder", {f"bert.{n}" for n in BERT_QKV} | {"cls.predictions.decoder"}),
    ("bert-classifier", lambda: transformers.BertForSequenceClassification(bert_config()),
     "classifier", {f"bert.{n}" for n in BERT_QKV} | {"classifier"}),
    ("llama", tiny_llama, "lm_head", LLAMA_QKV | {"lm_head"}),
    ("llama-tied", lambda: tiny_llama(tie_word_embeddings=True), "lm_head", LLAMA_QKV | {"lm_head"}),
    ("gpt2-conv1d-ignored", lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64)), "lm_head", {"lm_head"}),
]


@pytest.mark.parametrize("name, build, head, kept", KEPT, ids=[c[0] for c in KEPT])
def test_convert_keeps_first_block_qkv_and_head(name, build, head, kept):
    model = build()
    linears = {n for n, _ in roles.named_linears(model)}
    assert roles.output_head(model) == head
    assert set(fp8_plan(model).kept) == kept
    mf.convert(model, recipe=mf.CurrentScaling())
    assert {m.fp8_name for m in mf.fp8_layers(model)} == linears - kept


@pytest.mark.parametrize("name, build, head, kept", KEPT, ids=[c[0] for c in KEPT])
def test_policy_plans_the_layers_convert_converts(name, build, head, kept):
    model = build()
    linears = {n for n, _ in roles.named_linears(model)}
    kinds = PrecisionPolicy.preset("fp8-current").plan(model)
    assert {n for n, k in kinds.items() if k == "fp8"} == linears - kept
    assert [n for n, k in kinds.items() if k == "head"] == [head]


def test_policy_recognises_hf_norms():
    model = tiny_llama()
    kinds = PrecisionPolicy.preset("bf16").plan(model)
    norms = {n for n, k in kinds.items() if k == "norm"}  # LlamaRMSNorm is no torch class: a norm by its name
    assert norms == {"model.norm"} | {f"model.layers.{i}.{n}" for i in range(2)
                                      for n in ("input_layernorm", "post_attention_layernorm")}


def test_convert_llama_trains_and_matches_high_precision():
    ref = tiny_llama()
    model = tiny_llama()
    model.load_state_dict(ref.state_dict())
    mf.convert(model, recipe=mf.CurrentScaling())
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        sqnr = mf.sqnr_db(ref(ids).logits, model(ids).logits)
    assert sqnr >= LOGITS_SQNR_FLOOR_DB
    model.train()
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_a_prepared_model_refuses_save_pretrained_and_save_quantized_round_trips(tmp_path):
    """save_pretrained of a model prepared for FP8 inference wrote its E4M3 codes as plain weights, which
    from_pretrained loaded without an error as another model (-3 dB against the original): it is refused in one
    line naming save_quantized, which round-trips bitwise; the unprepared model still saves."""
    model = tiny_llama()
    model.save_pretrained(tmp_path / "plain")  # before prepare_inference: transformers' own save
    prepared = mf.prepare_inference(model, recipe=mf.CurrentScaling())
    with pytest.raises(ValueError, match=r"prepared for FP8 inference: save_pretrained .* mf\.save_quantized") as info:
        prepared.save_pretrained(tmp_path / "fp8")
    assert "\n" not in str(info.value) and "LlamaForCausalLM(config)" in str(info.value)
    assert not (tmp_path / "fp8").exists()
    mf.save_quantized(prepared, tmp_path / "q")
    loaded = mf.load_quantized(tmp_path / "q", model=transformers.LlamaForCausalLM(llama_config()))
    ids = torch.randint(VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, prepared(ids).logits)
    with pytest.raises(ValueError, match="prepared for FP8 inference"):
        loaded.save_pretrained(tmp_path / "fp8")


def test_transformers_trainer_ends_one_fp8_step_per_optimizer_step(tmp_path):
    """Under transformers' Trainer (accelerate wraps the optimizer) with 2 micro-batches per step: each of its 3
    optimizer steps ends exactly one FP8 step of every converted layer (3 history rows rolled, not 6)."""
    model = mf.convert(tiny_llama().train())
    layers = [m for m in model.modules() if isinstance(m, mf.Fp8Linear)]
    assert layers
    generator = torch.Generator().manual_seed(4)
    data = [{"input_ids": row, "labels": row} for row in torch.randint(0, VOCAB, (12, 16), generator=generator)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                                          gradient_accumulation_steps=2, learning_rate=1e-3, report_to=[],
                                          save_strategy="no", use_cpu=True, logging_strategy="no", disable_tqdm=True)
    transformers.Trainer(model=model, args=args, train_dataset=data).train()
    for layer in layers:
        assert int((layer.fp8_state.amax_history != 0).any(dim=1).sum()) == 3, layer.fp8_name
