"""minifloat.inference.hf_generate and `minifloat generate --hf DIR`: a Hugging Face model folder continues a prompt
in its own dtype or with FP8 weights. The tokens must be transformers' own generate's for the same model (greedy,
or sampled under the same seed), the FP8 ones those of the model prepare_inference makes; bad folders and options
get one line."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

import minifloat as mf
from minifloat.inference import hf_models
from minifloat.inference.generate import FP8_RECIPES
from minifloat.inference.hf_generate import generate_pretrained, load_generator
from minifloat.inference.layers import Fp8InferenceLinear

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

PROMPT = "def dumps(obj"


def save_tokenizer(folder: Path) -> int:
    """A byte-level BPE trained on the standard library's json package, saved as transformers reads it."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "encoder.py").read_text(encoding="utf-8")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(folder)
    return len(fast)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gen") / "model"
    folder.mkdir()
    vocab = save_tokenizer(folder)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      eos_token_id=vocab + 10, bos_token_id=0)  # no early stop: every run is as long
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


def theirs(model, tokenizer, **options) -> list[int]:
    ids = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, pad_token_id=tokenizer.eos_token_id, **options)
    return out[0, ids["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("fp8", [None, "tensor", "block"])
def test_greedy_tokens_are_transformers_own(folder, fp8):
    model, tokenizer = load_generator(folder, fp8=fp8, device="cpu")
    layers = [m for m in model.modules() if isinstance(m, Fp8InferenceLinear)]
    assert bool(layers) == (fp8 is not None)
    result = generate_pretrained(model, tokenizer, PROMPT, max_new_tokens=12)
    reference = hf_models.load_pretrained(folder)
    if fp8 is not None:
        reference = mf.prepare_inference(reference, recipe=FP8_RECIPES[fp8])
    assert result.tokens == theirs(reference, tokenizer, do_sample=False)
    assert result.text == tokenizer.decode(result.tokens, skip_special_tokens=True)
    stats = result.stats
    assert stats.new_tokens == 12 and stats.prompt_tokens == len(tokenizer(PROMPT)["input_ids"])
    assert stats.kv_cache_bytes > 0 and stats.peak_memory_bytes == stats.weight_bytes + stats.kv_cache_bytes


def test_an_encoder_decoder_generates_its_decoder_tokens(tmp_path):
    """T5: the continuation is the decoder's tokens after its start token, the cache both attention caches'."""
    folder = tmp_path / "t5"
    folder.mkdir()
    vocab = save_tokenizer(folder)
    config = transformers.T5Config(vocab_size=vocab, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(config).save_pretrained(folder)
    model, tokenizer = load_generator(folder, fp8="block")
    result = generate_pretrained(model, tokenizer, PROMPT, max_new_tokens=6)
    with torch.no_grad():
        full = model.generate(**tokenizer(PROMPT, return_tensors="pt"), max_new_tokens=6, do_sample=False)[0]
    assert result.tokens == full[1:].tolist() and result.stats.kv_cache_bytes > 0


def test_a_moe_folder_generates_with_fp8_experts(tmp_path):
    """Mixtral: --fp8 stores the experts in FP8 too (minifloat.inference.experts), and the tokens are transformers'
    generate's on the model prepare_inference makes."""
    from minifloat.inference.experts import Fp8InferenceExperts

    folder = tmp_path / "mixtral"
    folder.mkdir()
    vocab = save_tokenizer(folder)
    config = transformers.MixtralConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=256, eos_token_id=vocab + 10)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    model, tokenizer = load_generator(folder, fp8="block", device="cpu")
    assert sum(isinstance(m, Fp8InferenceExperts) for m in model.modules()) == 2
    result = generate_pretrained(model, tokenizer, PROMPT, max_new_tokens=8)
    reference = mf.prepare_inference(hf_models.load_pretrained(folder), recipe=FP8_RECIPES["block"])
    ids = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = reference.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert result.tokens == out[0, ids["input_ids"].shape[1]:].tolist()
    bf16 = generate_pretrained(*load_generator(folder), PROMPT, max_new_tokens=2).stats.weight_bytes
    assert result.stats.weight_bytes < 0.7 * bf16  # the experts are most of this model's weights


def test_fp8_weights_take_about_half_the_bytes(folder):
    bf16 = generate_pretrained(*load_generator(folder), PROMPT, max_new_tokens=2).stats.weight_bytes
    fp8 = generate_pretrained(*load_generator(folder, fp8="block"), PROMPT, max_new_tokens=2).stats.weight_bytes
    assert fp8 < 0.8 * bf16  # the embedding and head stay bf16 in this tiny model: far from 0.5


def test_sampling_is_seeded_and_leaves_the_global_generator_alone(folder):
    model, tokenizer = load_generator(folder)
    state = torch.random.get_rng_state()
    runs = [generate_pretrained(model, tokenizer, PROMPT, max_new_tokens=12, temperature=1.5, top_k=50, seed=s).tokens
            for s in (1, 1, 2)]
    assert torch.equal(torch.random.get_rng_state(), state)
    assert runs[0] == runs[1] and runs[0] != runs[2]
    torch.manual_seed(1)
    assert runs[0] == theirs(model, tokenizer, do_sample=True, temperature=1.5, top_k=50)


def test_non_finite_logits_are_one_clear_error(folder):
    model, tokenizer = load_generator(folder)
    with torch.no_grad():
        model.lm_head.weight[5, 0] = float("nan")
    with pytest.raises(ValueError, match="logits were NaN or infinite at 12 step"):
        generate_pretrained(model, tokenizer, PROMPT, max_new_tokens=12)


# ---- minifloat generate --hf ----------------------------------------------------------------------------------------

def test_cli_continues_the_prompt(folder, capsys):
    from minifloat.cli import main
    from minifloat.cli.generate import printable

    assert main(["generate", "--hf", str(folder), "--prompt", PROMPT, "--max-new-tokens", "5", "--fp8", "row"]) == 0
    out, err = capsys.readouterr()
    model, tokenizer = load_generator(folder, fp8="row")
    expected = generate_pretrained(model, tokenizer, PROMPT, max_new_tokens=5).text
    assert out.rstrip("\n") == printable(expected)
    assert err.strip().splitlines()[-1].startswith("1×5 tokens after a")


@pytest.mark.parametrize("case", ["both", "neither", "kv-cache", "not-generative", "no-tokenizer", "fp8"])
def test_cli_refuses_in_one_line(folder, tmp_path, capsys, case):
    from minifloat.cli import main

    if case == "not-generative":
        config = transformers.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2)
        transformers.BertForMaskedLM(config).save_pretrained(tmp_path / "bert")
    if case == "no-tokenizer":
        transformers.AutoModelForCausalLM.from_pretrained(folder).save_pretrained(tmp_path / "bare")
    capsys.readouterr()
    args = {"both": ["--hf", str(folder), "--run", str(tmp_path)], "neither": [],
            "kv-cache": ["--hf", str(folder), "--kv-cache", "fp8"],
            "not-generative": ["--hf", str(tmp_path / "bert")], "no-tokenizer": ["--hf", str(tmp_path / "bare")],
            "fp8": ["--hf", str(folder), "--fp8", "nvfp4"]}[case]
    expected = {"both": "name one model", "neither": "name one model", "kv-cache": "--kv-cache is for --run",
                "not-generative": "does not generate text", "no-tokenizer": "no tokenizer transformers can read",
                "fp8": "--fp8 must be one of"}[case]
    assert main(["generate", *args, "--prompt", PROMPT]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], lines


def test_cli_generates_from_a_hub_id_in_the_local_cache(folder, tmp_path, capsys, monkeypatch):
    from minifloat.cli import main
    from test_hf_stream import cache_snapshot

    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache_snapshot(tmp_path / "cache", "someone/tiny-llama", folder)
    assert main(["generate", "--hf", "someone/tiny-llama", "--prompt", PROMPT, "--max-new-tokens", "3"]) == 0
    out, _ = capsys.readouterr()
    from minifloat.cli.generate import printable

    assert out.rstrip("\n") == printable(generate_pretrained(*load_generator(folder), PROMPT, max_new_tokens=3).text)
