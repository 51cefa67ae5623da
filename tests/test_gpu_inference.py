"""GPU tier: FP8 inference on the device. `prepare_inference` on the device stores the CPU's FP8 weights and scales bit
for bit and computes the CPU's logits up to the GEMMs' rounding; `save_quantized` / `load_quantized` round-trip a
device model bit for bit; generation with FP8 weights and the FP8 KV cache runs on the device, greedy decoding is
the argmax of its own logits, and the cache's logits stay within the FP8 cache's floor of the full forward.

The device and the switch: tests/gpu_device.py (MINIFLOAT_GPU_TESTS_DEVICE=cpu runs the tier without a GPU).
"""

from __future__ import annotations

import copy

import pytest
import torch

import minifloat as mf
from gpu_device import device  # noqa: F401  (the module's device fixture)
from gpu_device import assert_same_bits, assert_same_state, native_gemm_calls
from minifloat.fp8.gemm import native_fp8_available
from minifloat.inference.generate import CUDA_PEAK, HELD_TENSORS, generate
from minifloat.inference.kvcache import KVCache
from minifloat.inference.layers import inference_layers
from minifloat.numerics.compiling import eager_kernels
from minifloat.training.model import Llama, LlamaConfig

pytestmark = pytest.mark.gpu

SEED = 0
RECIPES = {"tensor": mf.CurrentScaling(), "row": mf.CurrentScaling(granularity="row"), "block": mf.BlockScaling(),
           "mx": mf.MXScaling()}
NATIVE_EVERYWHERE = {"tensor", "row"}  # cuBLASLt per-tensor / row-wise scaling on every SM 8.9+ GPU
# Logits of the prepared (bf16) tiny Llama on the device against the same model prepared on the CPU. The stored
# weights are the same bits (asserted); the activations' casts see inputs that differ only by the GEMMs' rounding
# in earlier layers, which can flip an E4M3 rounding (2^-4 relative) of a few elements. Measured on an H100: tensor
# 40.9 dB, row 41.7 dB (native GEMMs), block and mx inf; the floor is the one tests/test_inference.py holds the FP8
# model to against fp32.
CROSS_DEVICE_LOGITS_SQNR_DB = 32.0
# The FP8 model against the fp32 model, tests/test_inference.py's floor for the tiny Llama (measured 34.5-35.2 dB
# on an H100)
FP8_VS_FP32_SQNR_DB = 32.0
# E4M3 keys and values against the full forward, tests/test_generate.py's floor (measured 35.2 dB on an H100)
FP8_KV_SQNR_FLOOR_DB = 30.0
PROMPT_LEN, NEW_TOKENS = 8, 12


def tiny_llama() -> Llama:
    torch.manual_seed(SEED)
    return Llama(LlamaConfig.preset("tiny")).eval()  # fp32, on the CPU


def tokens(batch: int = 2, length: int = 16, seed: int = SEED + 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def prepared(reference: Llama, name: str, device: str, **options) -> Llama:
    """A copy of `reference` on `device` with FP8 weights, everything else in bfloat16 (as `minifloat generate`)."""
    model = copy.deepcopy(reference).to(device)
    return mf.prepare_inference(model, recipe=RECIPES[name], **options).to(torch.bfloat16)


def storage_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


@torch.no_grad()
def logits(model: Llama, idx: torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(idx.to(device))[0].float().cpu()


@pytest.mark.parametrize("name", list(RECIPES))
def test_prepare_inference_on_the_device_stores_the_cpu_weights(device, name):
    reference = tiny_llama()
    with eager_kernels():
        on_cpu = prepared(reference, name, "cpu")
        cpu_logits = logits(on_cpu, tokens())
    on_device = prepared(reference, name, device)
    layers = inference_layers(on_device)
    assert layers and all(layer.weight.device.type == torch.device(device).type
                          and layer.weight.dtype == torch.float8_e4m3fn for _, layer in layers)
    assert_same_state(storage_state(on_device), storage_state(on_cpu))  # FP8 codes, scales, bf16 tensors
    with native_gemm_calls() as calls:
        device_logits = logits(on_device, tokens())
    if native_fp8_available() and name in NATIVE_EVERYWHERE:
        assert len(calls) == len(layers), f"{len(calls)} native GEMMs for {len(layers)} FP8 layers"
    if name == "mx" or not native_fp8_available():
        assert calls == []
    assert mf.sqnr_db(cpu_logits, device_logits) >= CROSS_DEVICE_LOGITS_SQNR_DB
    assert mf.sqnr_db(logits(reference.to(device), tokens()), device_logits) >= FP8_VS_FP32_SQNR_DB


@pytest.mark.parametrize("name, options", [("row", dict(activations="static", calibration=None)),
                                           ("block", dict(smooth=0.5, calibration=None))], ids=["row-static",
                                                                                              "block-smooth"])
def test_save_and_load_quantized_round_trip_a_device_model_bit_for_bit(device, tmp_path, name, options):
    """Saved from the device, loaded (rebuilt on the CPU from the saved config), moved back: the same codes, scales
    and logits, bit for bit."""
    calibration = [tokens(seed=s).to(device) for s in (10, 11)]
    model = prepared(tiny_llama(), name, device, **{**options, "calibration": calibration})
    before = logits(model, tokens())
    path = mf.save_quantized(model, tmp_path / "q")
    loaded = mf.load_quantized(path).to(device)
    assert_same_state(storage_state(loaded), storage_state(model))
    assert_same_bits(logits(loaded, tokens()), before, "logits after the round trip")


@torch.no_grad()
def incremental_logits(model: Llama, idx: torch.Tensor, kv_cache: str, prefill: int = PROMPT_LEN) -> torch.Tensor:
    """Logits of every position from `prefill` on: the prompt in one call, then one token per call (as generate)."""
    device = next(model.parameters()).device
    idx = idx.to(device)
    cache = KVCache(model.config, batch=idx.shape[0], max_len=idx.shape[1], dtype=kv_cache, device=device)
    out = [model(idx[:, :prefill], cache=cache)[0][:, -1:]]
    out += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(prefill, idx.shape[1])]
    return torch.cat(out, dim=1).float().cpu()  # (B, T - prefill + 1, vocab)


def test_generation_with_fp8_weights_and_the_fp8_kv_cache_on_the_device(device):
    model = prepared(tiny_llama(), "row", device)
    prompt = tokens(length=PROMPT_LEN)
    out = generate(model, prompt.to(device), max_new_tokens=NEW_TOKENS, kv_cache="fp8")
    assert out.tokens.shape == (2, NEW_TOKENS) and out.tokens.device.type == torch.device(device).type
    assert out.stats.kv_cache == "fp8"
    assert out.stats.peak_memory_source == (CUDA_PEAK if torch.device(device).type == "cuda" else HELD_TENSORS)
    assert torch.equal(generate(model, prompt.to(device), max_new_tokens=NEW_TOKENS, kv_cache="fp8").tokens,
                       out.tokens)  # greedy decoding repeats on the device
    sequence = torch.cat([prompt, out.tokens.cpu()], dim=1)
    cached = incremental_logits(model, sequence[:, :-1], "fp8")  # the calls generate made, in the same shapes
    assert torch.equal(cached.argmax(-1), out.tokens.cpu())  # each new token is the argmax of its logits
    with torch.no_grad():
        full = model(sequence[:, :-1].to(device))[0][:, PROMPT_LEN - 1:].float().cpu()  # no cache
    assert mf.sqnr_db(full, cached) >= FP8_KV_SQNR_FLOOR_DB


# NVFP4 (E2M1, E4M3 block scales, an fp32 tensor scale): the tiny Llama's logits against fp32 measured 22.5 / 22.8 dB
# on the CPU (dynamic / static, tests/test_inference_input.py, whose floor this is); not yet run on a GPU, where the
# activations' casts see inputs that differ by the GEMMs' rounding (as the FP8 recipes' above)
NVFP4_VS_FP32_SQNR_DB = 20.0
NVFP4_CROSS_DEVICE_SQNR_DB = 20.0


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_nvfp4_inference_on_the_device_stores_the_cpu_weights(device, activations):
    """NVFP4 layers prepared on the device hold the CPU's weight codes and scales, and their logits stay within
    NVFP4's own noise of the CPU model's and of fp32's (the per-token global scales run through torch.ldexp)."""
    reference = tiny_llama()
    calibration = [tokens(seed=SEED + 2)] if activations == "static" else None

    def prepare(on: str) -> Llama:
        batches = None if calibration is None else [t.to(on) for t in calibration]
        model = copy.deepcopy(reference).to(on)
        return mf.prepare_inference(model, recipe=mf.NVFP4Scaling(), activations=activations,
                                    calibration=batches).to(torch.bfloat16)
    with eager_kernels():
        on_cpu = prepare("cpu")
        cpu_logits = logits(on_cpu, tokens())
    on_device = prepare(device)
    weights = lambda model: {k: v for k, v in storage_state(model).items() if ".weight" in k}  # noqa: E731
    assert weights(on_device).keys() == weights(on_cpu).keys() and weights(on_cpu)
    assert_same_state(weights(on_device), weights(on_cpu))
    device_logits = logits(on_device, tokens())
    assert mf.sqnr_db(cpu_logits, device_logits) >= NVFP4_CROSS_DEVICE_SQNR_DB
    assert mf.sqnr_db(logits(reference.to(device), tokens()), device_logits) >= NVFP4_VS_FP32_SQNR_DB


def test_a_hugging_face_folder_generates_with_fp8_weights_on_the_device(device, tmp_path):
    """`minifloat generate --hf DIR --fp8 tensor` on the device: the folder's Llama prepared for FP8 inference runs
    its linears on the device (through torch._scaled_mm where the GPU has FP8 GEMMs), greedy decoding repeats, and
    the stats come from the device's allocator."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from test_hf_generate import PROMPT, save_tokenizer

    from minifloat.inference.hf_generate import generate_pretrained, load_generator

    folder = tmp_path / "model"
    folder.mkdir()
    vocab = save_tokenizer(folder)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      eos_token_id=vocab + 10, bos_token_id=0)
    torch.manual_seed(SEED)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    model, tokenizer = load_generator(folder, fp8="tensor", device=device)
    assert inference_layers(model) and next(model.parameters()).device.type == torch.device(device).type
    with native_gemm_calls() as calls:
        out = generate_pretrained(model, tokenizer, PROMPT, max_new_tokens=NEW_TOKENS)
    assert len(out.tokens) == NEW_TOKENS
    assert generate_pretrained(model, tokenizer, PROMPT, max_new_tokens=NEW_TOKENS).tokens == out.tokens
    assert out.stats.peak_memory_source == (CUDA_PEAK if torch.device(device).type == "cuda" else HELD_TENSORS)
    if torch.device(device).type == "cuda" and native_fp8_available():
        assert calls, "no native FP8 GEMM ran"


@pytest.mark.parametrize("name", ["tensor", "block"])
def test_fp8_moe_experts_on_the_device_store_the_cpu_weights(device, name):
    """prepare_inference of a Mixtral on the device: its FP8 experts (minifloat.inference.experts) hold the CPU's
    codes and scales bit for bit, and the experts' output is the CPU's up to the GEMMs' rounding (the cross-device
    floor of the dense model above; not yet measured on a GPU)."""
    pytest.importorskip("transformers")
    from moe_models import build, routing

    from minifloat.inference.experts import Fp8InferenceExperts

    reference = build().eval()
    with eager_kernels():
        on_cpu = mf.prepare_inference(copy.deepcopy(reference), recipe=RECIPES[name])
    on_device = mf.prepare_inference(copy.deepcopy(reference).to(device), recipe=RECIPES[name])
    cpu_experts, device_experts = (next(m for m in model.modules() if isinstance(m, Fp8InferenceExperts))
                                   for model in (on_cpu, on_device))
    assert_same_state(storage_state(device_experts), storage_state(cpu_experts))
    x, index, weights = routing()
    with torch.no_grad():
        with eager_kernels():
            expected = cpu_experts(x, index, weights)
        got = device_experts(x.to(device), index.to(device), weights.to(device))
    assert got.device.type == torch.device(device).type
    assert mf.sqnr_db(expected, got.cpu()) >= CROSS_DEVICE_LOGITS_SQNR_DB
