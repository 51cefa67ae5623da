"""Generation with the reference Llama (minifloat.inference.generate, .kvcache; `minifloat generate`): the KV cache
gives the full forward's logits, greedy decoding is the argmax of repeated full forwards, seeded sampling repeats and
never leaves the top-k, the FP8 cache's bytes and numerics, and the command end to end with its one-line errors."""

from __future__ import annotations

import pytest
import torch

from minifloat.cli import main
from minifloat.inference.generate import decode_bytes, generate, load_run_model, sample
from minifloat.inference.kvcache import KVCache
from minifloat.numerics.compiling import eager_kernels
from minifloat.numerics.quantize import quantize, sqnr_db
from minifloat.training.checkpoint import load_checkpoint
from minifloat.training.loop import TrainConfig, train
from minifloat.training.model import Llama, LlamaConfig

# incremental fp32 decoding runs the same maths as the full forward in GEMMs of other shapes (rows of 1 instead of
# T), whose float32 sums may round differently: measured max |Δ| 2e-7 .. 8e-7 on logits up to 2.3 (tiny, small)
CACHE_FP32_ATOL = 1e-5
CACHE_FP32_RTOL = 1e-5
# a bf16 model with a bf16 cache stores exactly the keys and values its full forward uses; measured bitwise equal on
# one thread. The floor leaves room for other bf16 GEMM blockings (one bf16 ulp of relative noise is ~54 dB)
CACHE_BF16_SQNR_FLOOR_DB = 40.0
# E4M3 keys and values (3 mantissa bits, a scale per token and head) against the bf16 cache, logits after every
# layer: measured 45 dB (tiny), 40 dB (tiny, QK-norm, untied), 36 dB (small, 6 layers) with random weights
FP8_KV_SQNR_FLOOR_DB = 30.0
USER_ERROR = 2
CONFIGS = {"tiny": LlamaConfig.preset("tiny"),
           "tiny-qknorm-untied": LlamaConfig.preset("tiny", qk_norm=True, tie_embeddings=False),
           "tiny-gqa": LlamaConfig.preset("tiny", n_kv_head=2),  # grouped-query attention: 2 kv heads of 4
           "tiny-mqa-sdpa": LlamaConfig.preset("tiny", n_kv_head=1, attention="sdpa")}  # one kv head; SDPA
PROMPT_LEN, TOTAL_LEN = 8, 24


@pytest.fixture(autouse=True)
def _eager():
    with eager_kernels():  # the FP8 cache's quantize: compiled and eager agree bitwise; no compile time here
        yield


def _model(config: LlamaConfig, dtype=torch.float32) -> Llama:
    torch.manual_seed(0)
    return Llama(config).to(dtype).eval()


def _tokens(batch: int = 2, length: int = TOTAL_LEN, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _incremental_logits(model: Llama, idx: torch.Tensor, kv_cache: str, prefill: int = PROMPT_LEN) -> torch.Tensor:
    """Logits of every position: the first `prefill` in one call, then one token per call through the cache."""
    cache = KVCache(model.config, batch=idx.shape[0], max_len=idx.shape[1], dtype=kv_cache)
    out = [model(idx[:, :prefill], cache=cache)[0]]
    out += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(prefill, idx.shape[1])]
    assert cache.length == idx.shape[1]
    return torch.cat(out, dim=1).float()  # (B, T, vocab)


# ---- the KV cache ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("prefill", [1, PROMPT_LEN])
def test_cached_logits_equal_the_full_forward_fp32(name, prefill):
    model, idx = _model(CONFIGS[name]), _tokens()
    with torch.no_grad():
        full, _ = model(idx)
    torch.testing.assert_close(_incremental_logits(model, idx, "fp32", prefill), full, atol=CACHE_FP32_ATOL,
                               rtol=CACHE_FP32_RTOL)


@pytest.mark.parametrize("name", CONFIGS)
def test_bf16_cache_of_a_bf16_model_follows_its_full_forward(name):
    model, idx = _model(CONFIGS[name], torch.bfloat16), _tokens()
    with torch.no_grad():
        full = model(idx)[0].float()
    assert sqnr_db(full, _incremental_logits(model, idx, "bf16")) >= CACHE_BF16_SQNR_FLOOR_DB


@pytest.mark.parametrize("name", CONFIGS)
def test_fp8_cache_logits_stay_within_the_sqnr_floor_of_bf16(name):
    model, idx = _model(CONFIGS[name]), _tokens()
    bf16, fp8 = _incremental_logits(model, idx, "bf16"), _incremental_logits(model, idx, "fp8")
    assert sqnr_db(bf16, fp8) >= FP8_KV_SQNR_FLOOR_DB


@pytest.mark.parametrize("name", ["tiny-gqa", "tiny-mqa-sdpa"])
def test_chunks_longer_than_one_token_after_a_prefill_equal_the_full_forward(name):
    """q shorter than k and longer than one token: the causal mask aligns q's rows with the last positions (SDPA's
    is_causal would align them with the first)."""
    model, idx = _model(CONFIGS[name]), _tokens()
    cache = KVCache(model.config, batch=2, max_len=TOTAL_LEN, dtype="fp32")
    with torch.no_grad():
        full, _ = model(idx)
        chunks = [model(idx[:, a:b], cache=cache)[0] for a, b in ((0, PROMPT_LEN), (PROMPT_LEN, 13), (13, TOTAL_LEN))]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=CACHE_FP32_ATOL, rtol=CACHE_FP32_RTOL)


def test_gqa_cache_holds_n_kv_head_heads():
    gqa, mha = CONFIGS["tiny-gqa"], CONFIGS["tiny"]
    cache = KVCache(gqa, batch=2, max_len=8)
    assert cache.k.shape == (gqa.n_layer, 2, gqa.n_kv_head, 8, gqa.head_dim)
    assert cache.nbytes() * (gqa.n_head // gqa.n_kv_head) == KVCache(mha, batch=2, max_len=8).nbytes()


def test_fp8_cache_is_half_of_bf16_plus_a_scale_per_token_and_head():
    config, batch, length = CONFIGS["tiny"], 3, 50
    sizes = {dtype: KVCache(config, batch=batch, max_len=length, dtype=dtype).nbytes()
             for dtype in ("fp32", "bf16", "fp8")}
    scales = 2 * config.n_layer * batch * config.n_head * length * 4  # k and v: one fp32 per (layer, b, head, token)
    assert sizes["fp8"] == sizes["bf16"] // 2 + scales
    assert sizes["fp32"] == 2 * sizes["bf16"]


def test_fp8_cache_stores_e4m3_rows_through_quantize():
    config = CONFIGS["tiny"]
    cache = KVCache(config, batch=2, max_len=8, dtype="fp8")
    k, v = torch.randn(2, 2, config.n_head, 5, config.head_dim).unbind(0)  # (B, H, T, hd) each
    k_all, _ = cache.update(0, k, v)
    expected = quantize(k, "e4m3", granularity="row")  # one scale per (batch, head, token)
    assert cache.k.dtype == torch.float8_e4m3fn and cache.k_scale.shape[-1] == 1
    assert torch.equal(cache.k[0, :, :, :5], expected.data) and torch.equal(cache.k_scale[0, :, :, :5],
                                                                            expected.scale)
    assert k_all.dtype == torch.float32 and torch.equal(k_all, expected.dequantize())


def test_the_cache_refuses_positions_beyond_its_length():
    config = CONFIGS["tiny"]
    cache = KVCache(config, batch=1, max_len=4)
    k = torch.zeros(1, config.n_head, 5, config.head_dim)
    with pytest.raises(ValueError, match="holds 4 positions"):
        cache.update(0, k, k)
    with pytest.raises(ValueError, match="max_len must be an int in"):
        KVCache(config, batch=1, max_len=config.max_seq_len + 1)


def test_the_model_refuses_a_sequence_past_max_seq_len_after_the_cache():
    model = _model(CONFIGS["tiny"])
    cache = KVCache(model.config, batch=1)
    cache.advance(model.config.max_seq_len)
    with pytest.raises(ValueError, match="after 128 cached positions"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)


# ---- generate -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_generation_is_the_argmax_of_repeated_full_forwards(name):
    model, prompt = _model(CONFIGS[name]), _tokens(batch=2, length=PROMPT_LEN)
    out = generate(model, prompt, max_new_tokens=12, kv_cache="fp32")
    seq = prompt
    with torch.no_grad():
        for _ in range(12):
            seq = torch.cat([seq, model(seq)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out.tokens, seq[:, PROMPT_LEN:])
    assert out.stats.batch == 2 and out.stats.new_tokens == 12 and out.stats.prompt_tokens == PROMPT_LEN


def test_a_batch_generates_what_each_prompt_generates_alone():
    model, prompts = _model(CONFIGS["tiny"]), _tokens(batch=3, length=PROMPT_LEN)
    together = generate(model, prompts, max_new_tokens=8, kv_cache="fp32").tokens
    alone = torch.cat([generate(model, p, max_new_tokens=8, kv_cache="fp32").tokens for p in prompts])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("kv_cache", ["bf16", "fp8"])
def test_seeded_sampling_repeats_and_seeds_differ(kv_cache):
    model, prompt = _model(CONFIGS["tiny"]), _tokens(batch=2, length=PROMPT_LEN)
    options = dict(max_new_tokens=12, temperature=1.5, top_k=50, kv_cache=kv_cache)
    first, again = (generate(model, prompt, seed=7, **options).tokens for _ in range(2))
    assert torch.equal(first, again)
    assert not torch.equal(first, generate(model, prompt, seed=8, **options).tokens)


def test_sampling_never_leaves_the_top_k():
    logits = torch.randn(4096, 256, generator=torch.Generator().manual_seed(0))
    top_k = 5
    allowed = torch.topk(logits, top_k, dim=-1).indices  # (N, k)
    # a high temperature flattens the distribution, so every one of the k candidates is drawn somewhere
    drawn = sample(logits, temperature=10.0, top_k=top_k, generator=torch.Generator().manual_seed(1))  # (N, 1)
    hits = drawn == allowed
    assert hits.any(dim=-1).all()  # no token outside the row's top-k
    assert hits.any(dim=0).all()  # each rank of the top-k was drawn: the test can see a wrong mask


def test_a_tiny_temperature_samples_the_largest_logit():
    # logits / 1e-40 overflowed to inf and softmax gave NaN: torch's "probability tensor contains inf, nan"
    logits = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 4
    for top_k in (None, 5):
        drawn = sample(logits, temperature=1e-40, top_k=top_k, generator=torch.Generator().manual_seed(1))
        assert torch.equal(drawn, logits.argmax(dim=-1, keepdim=True))


def test_top_1_sampling_is_greedy():
    model, prompt = _model(CONFIGS["tiny"]), _tokens(batch=2, length=PROMPT_LEN)
    greedy = generate(model, prompt, max_new_tokens=10).tokens
    assert torch.equal(generate(model, prompt, max_new_tokens=10, temperature=2.0, top_k=1, seed=3).tokens, greedy)


def test_stats_count_weights_and_cache_on_cpu():
    model = _model(CONFIGS["tiny"])
    model.train()
    stats = generate(model, [1, 2, 3], max_new_tokens=4, kv_cache="fp8").stats
    assert model.training  # restored after the call
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: wte and lm_head once
    assert stats.weight_bytes == weights
    assert stats.kv_cache_bytes == KVCache(model.config, batch=1, max_len=6, dtype="fp8").nbytes()
    assert stats.peak_memory_bytes == weights + stats.kv_cache_bytes
    assert stats.peak_memory_source == "weights + KV cache"
    assert stats.prefill_tokens_per_s > 0 and stats.decode_tokens_per_s > 0
    assert set(stats.to_dict()) >= {"prefill_tokens_per_s", "decode_tokens_per_s", "peak_memory_bytes"}


# (name, generate's keyword arguments, words the ValueError holds)
BAD_OPTIONS = [
    ("no new tokens", dict(max_new_tokens=0), ["max_new_tokens", "got 0"]),
    ("negative temperature", dict(temperature=-0.5), ["temperature", "got -0.5"]),
    ("nan temperature", dict(temperature=float("nan")), ["temperature", "got nan"]),
    ("top_k 0", dict(top_k=0), ["top_k", "got 0"]),
    ("top_k past the vocabulary", dict(top_k=257), ["top_k", "[1, 256]", "got 257"]),
    ("top_k a float", dict(top_k=2.5), ["top_k", "got 2.5"]),
    ("negative seed", dict(seed=-1), ["seed", "got -1"]),
    ("seed past 64 bits", dict(seed=2**70), ["seed", "2^63", "got 1180591620717411303424"]),  # torch's overflow
    ("unknown cache", dict(kv_cache="fp4"), ["kv_cache", "'fp4'"]),
    ("past max_seq_len", dict(max_new_tokens=127), ["need 129 positions", "max_seq_len=128", "at most 126 new"]),
]


@pytest.mark.parametrize("name, options, words", BAD_OPTIONS, ids=[c[0] for c in BAD_OPTIONS])
def test_bad_options_are_one_clear_value_error(name, options, words):
    model = _model(CONFIGS["tiny"])
    with pytest.raises(ValueError) as err:
        generate(model, [1, 2, 3], **{"max_new_tokens": 4, **options})
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


@pytest.mark.parametrize("prompt, words", [([], ["non-empty"]), ([[1.5]], ["integer"]), ([300], ["[0, 256)"])],
                         ids=["empty", "floats", "out of vocabulary"])
def test_bad_prompts_are_refused(prompt, words):
    with pytest.raises(ValueError) as err:
        generate(_model(CONFIGS["tiny"]), prompt, max_new_tokens=2)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_decode_bytes_replaces_invalid_utf8():
    assert decode_bytes(torch.tensor([104, 105, 0xFF])) == "hi\ufffd"


# ---- run folders and the command ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 2-step FP8 run of the tiny Llama with its checkpoint (a few seconds on 2 cores)."""
    out = tmp_path_factory.mktemp("generate") / "run"
    with eager_kernels():
        train(TrainConfig(model="tiny", preset="fp8-delayed", steps=2, batch_size=4, seq_len=32, warmup=1,
                          eval_every=100, eval_batches=1, max_bytes=100_000, checkpoint_every=2, out=str(out)),
              progress=False)
    return out


def test_a_run_loads_as_a_plain_llama_with_its_trained_weights(run_dir):
    torch.manual_seed(0)
    model = load_run_model(run_dir)
    drawn = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(drawn, torch.rand(1))  # loading drew nothing from torch's generator
    assert type(model) is Llama and not model.training
    config = TrainConfig(model="tiny", preset="fp8-delayed")
    trained = config.policy().apply(Llama(LlamaConfig.preset("tiny")))
    load_checkpoint(run_dir / "ckpt", model=trained, restore_rng=False)
    expected = trained.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key


def _generate(capsys, run_dir, *flags) -> tuple[str, str]:
    assert main(["generate", "--run", str(run_dir), "--prompt", "def ", "--max-new-tokens", "6", *flags]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


@pytest.mark.parametrize("flags, words", [(("--kv-cache", "fp8", "--device", "cpu"), ["KV cache fp8"]),
                                          (("--fp8", "row"), ["KV cache bf16"])], ids=["fp8 cache", "fp8 weights"])
def test_cli_prints_the_continuation_and_one_stats_line(run_dir, capsys, flags, words):
    out, err = _generate(capsys, run_dir, *flags)
    assert out.endswith("\n") and len(out) >= 2
    assert err.count("\n") == 1 and "tok/s" in err and "peak memory" in err, err
    assert all(w in err for w in words), err


def test_cli_sampling_repeats_with_its_seed(run_dir, capsys):
    flags = ("--temperature", "1.0", "--top-k", "20", "--seed", "5", "--checkpoint", str(run_dir / "ckpt"))
    assert _generate(capsys, run_dir, *flags)[0] == _generate(capsys, run_dir, *flags)[0]


def test_cli_default_length_fits_the_models_context(run_dir, capsys):
    assert main(["generate", "--run", str(run_dir), "--prompt", "x" * 100]) == 0  # tiny: max_seq_len 128
    assert "1×29 tokens after a 100-token prompt" in capsys.readouterr().err


# (name, argv after `generate --run RUN`, words the error line holds); RUN is the run's folder
CLI_ERRORS = [
    ("missing run folder", ["--run", "{tmp}/nowhere", "--prompt", "x"], ["nowhere", "does not exist"]),
    ("no checkpoint", ["--run", "{tmp}", "--prompt", "x"], ["no checkpoint", "ckpt"]),
    ("empty prompt", ["--run", "{run}", "--prompt", ""], ["invalid option", "--prompt"]),
    ("max-new-tokens not a number", ["--run", "{run}", "--prompt", "x", "--max-new-tokens", "ten"],
     ["invalid option", "--max-new-tokens", "'ten'"]),
    ("max-new-tokens 0", ["--run", "{run}", "--prompt", "x", "--max-new-tokens", "0"],
     ["invalid option", "--max-new-tokens", "got 0"]),
    ("temperature negative", ["--run", "{run}", "--prompt", "x", "--temperature", "-1"],
     ["invalid option", "--temperature", "got -1"]),
    ("top-k past the vocabulary", ["--run", "{run}", "--prompt", "x", "--top-k", "1000"],
     ["invalid option", "--top-k", "got 1000"]),
    ("seed not an int", ["--run", "{run}", "--prompt", "x", "--seed", "1.5"], ["invalid option", "--seed", "'1.5'"]),
    ("unknown kv cache", ["--run", "{run}", "--prompt", "x", "--kv-cache", "fp4"], ["invalid option", "--kv-cache"]),
    ("unknown fp8 recipe", ["--run", "{run}", "--prompt", "x", "--fp8", "tile"], ["invalid option", "--fp8"]),
    ("prompt past max_seq_len", ["--run", "{run}", "--prompt", "x" * 200],
     ["prompt of 200 tokens is longer than", "max_seq_len=128", "shorten it"]),
    ("unknown device", ["--run", "{run}", "--prompt", "x", "--device", "tpu"], ["--device", "'tpu'", "cuda:N"]),
    ("meta device", ["--run", "{run}", "--prompt", "x", "--device", "meta"], ["--device meta", "cannot generate"]),
]


@pytest.mark.parametrize("name, argv, words", CLI_ERRORS, ids=[c[0] for c in CLI_ERRORS])
def test_cli_errors_are_one_line(run_dir, tmp_path, capsys, name, argv, words):
    argv = [a.format(tmp=tmp_path, run=run_dir) for a in argv]
    status = main(["generate", *argv])
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert status == USER_ERROR and len(lines) == 1 and lines[0].startswith("minifloat: error: "), captured.err
    assert "Traceback" not in captured.err and all(w in lines[0] for w in words), lines[0]
    assert captured.out == ""


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_logits_are_an_error_not_token_zero(value):
    """A model whose logits are NaN (a NaN weight; an inf weight gives inf - inf) "generated" token 0 at every step,
    the argmax of NaN, without a word: one ValueError saying how many steps and why."""
    model = _model(CONFIGS["tiny"])
    with torch.no_grad():
        model.blocks[0].mlp.down_proj.weight[0, 0] = value
    with pytest.raises(ValueError, match=r"logits were NaN or infinite at 3 of the 3 steps.*non-finite values"):
        generate(model, _tokens(batch=1, length=PROMPT_LEN), max_new_tokens=3)
    healthy = _model(CONFIGS["tiny"])  # and a finite model is untouched by the check
    assert generate(healthy, _tokens(batch=1, length=PROMPT_LEN), max_new_tokens=3).tokens.shape == (1, 3)
