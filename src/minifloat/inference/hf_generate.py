"""Generation with a Hugging Face model folder, in its own dtype or with FP8 weights: `minifloat generate --hf DIR`.

    model, tokenizer = load_generator("path/to/model", fp8="block", device="cpu")   # prepare_inference(BlockScaling)
    result = generate_pretrained(model, tokenizer, "def fib(n):", max_new_tokens=64)
    print(result.text, result.stats.decode_tokens_per_s)

The model is `hf_models.load_pretrained`'s (the folder's class and dtype), moved to the device and, with `fp8`, prepared
for FP8 inference with one of minifloat.inference.generate.FP8_RECIPES (dynamic activations). Its own `generate`
runs the loop and its KV cache (transformers' cache for that architecture, in the model's dtype); the prompt is
encoded and the continuation decoded by the folder's tokenizer (AutoTokenizer: its tokenizer.json and
tokenizer_config.json, special tokens as the folder sets them; no chat template is applied). Greedy at temperature
0, else a draw from softmax(logits / T) over the top_k largest logits, seeded (the global generator is left as it
was). Generation stops early at the model's end-of-sequence token.

The stats are minifloat.inference.generate's GenerationStats: prefill (the prompt's forward and the first token)
and decode seconds from the time each token arrives, the weights' bytes, the KV cache's bytes as the returned cache
holds them, and the peak memory (CUDA's allocator on a GPU, else weights + KV cache). Logits that are NaN or infinite
(a damaged model or scale) stop nothing inside transformers but are counted, and raise one clear error at the end.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
from torch import nn

from minifloat.inference import hf_models
from minifloat.inference.generate import (CUDA_PEAK, FP8_RECIPES, HELD_TENSORS, GenerationStats, check_sampling,
                                          peak_rss_bytes)
from minifloat.training.memory import StorageLedger
from minifloat.training.throughput import resolve_device


@dataclasses.dataclass(frozen=True)
class PretrainedGeneration:
    """What generate_pretrained returns: the continuation's text and ids (prompt excluded), and the stats."""

    text: str
    tokens: list[int]
    stats: GenerationStats


def load_generator(folder: str | Path, *, fp8: str | None = None, device: str = "auto") -> tuple[nn.Module, object]:
    """(model, tokenizer) of a Hugging Face model folder for generation (see the module docstring). ValueError in
    one line: not a model folder, a model that cannot generate text, no tokenizer, an unknown `fp8` recipe."""
    from minifloat.inference.prepare import prepare_inference

    if fp8 is not None and fp8 not in FP8_RECIPES:
        raise ValueError(f"fp8 must be one of {', '.join(FP8_RECIPES)} (or None for the folder's dtype), got {fp8!r}")
    target = resolve_device(device)
    folder = hf_models.model_folder(folder)  # a Hub id: its snapshot in the local cache
    config, cls = hf_models.read_config(folder)
    if not _generates(cls):
        raise ValueError(f"{folder}: a {config.architectures[0] if config.architectures else type(config).__name__} "
                         f"does not generate text; give the folder of a causal or encoder-decoder language model")
    tokenizer = _tokenizer(folder)
    model = hf_models.load_pretrained(folder).to(target)
    if fp8 is not None:
        model = prepare_inference(model, recipe=FP8_RECIPES[fp8])
    return model, tokenizer


def _generates(cls: type) -> bool:
    try:
        return bool(cls.can_generate())
    except (AttributeError, TypeError):  # an auto class: its models decide
        return "CausalLM" in cls.__name__ or "Seq2Seq" in cls.__name__


def _tokenizer(folder: str | Path):
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(folder)
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds for a missing or damaged tokenizer
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{folder}: no tokenizer transformers can read ({text[:200]}); add the model's "
                         f"tokenizer.json and tokenizer_config.json to the folder") from None


class _Clock:
    """A streamer for transformers' generate: the time the prompt was taken and each new token arrived."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def put(self, value) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class _CountNonFinite:
    """A logits processor that counts the steps whose logits hold NaN or inf and zeroes them, so that sampling
    inside transformers does not fail on them (the count raises one clear error after)."""

    def __init__(self):
        self.steps = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        bad = ~torch.isfinite(scores)
        if bool(bad.any()):
            self.steps += 1
            return torch.where(bad, torch.zeros_like(scores), scores)
        return scores


def _cache_tensors(cache) -> list[torch.Tensor]:
    """The key and value tensors of a transformers cache: a DynamicCache's layers, an encoder-decoder cache's two
    caches (self-attention and cross-attention); none where it exposes neither."""
    parts = [getattr(cache, name, None) for name in ("self_attention_cache", "cross_attention_cache")]
    if any(part is not None for part in parts):
        return [t for part in parts if part is not None for t in _cache_tensors(part)]
    return [t for layer in getattr(cache, "layers", None) or [] for t in (getattr(layer, "keys", None),
                                                                          getattr(layer, "values", None))
            if isinstance(t, torch.Tensor)]


@torch.no_grad()
def generate_pretrained(model: nn.Module, tokenizer, prompt: str, *, max_new_tokens: int, temperature: float = 0.0,
                        top_k: int | None = None, seed: int = 0) -> PretrainedGeneration:
    """Continue `prompt` with a transformers model (see the module docstring). ValueError in one line: a bad
    option, a prompt that encodes to nothing, or logits that were NaN or infinite."""
    import transformers

    vocab = len(tokenizer)
    check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed, kv_cache="bf16",
                   vocab_size=vocab)
    device = next(model.parameters()).device
    encoded = tokenizer(prompt, return_tensors="pt")
    ids = encoded["input_ids"].to(device)
    if ids.numel() == 0:
        raise ValueError(f"the prompt {prompt!r} encodes to no tokens")
    clock, guard = _Clock(device), _CountNonFinite()
    sampling = dict(do_sample=True, temperature=temperature, top_k=top_k or 0) if temperature > 0 else \
        dict(do_sample=False, temperature=None, top_k=None, top_p=None)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    weight_bytes = StorageLedger().add([*model.parameters(), *model.buffers()])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss_before = peak_rss_bytes()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        out = model.generate(ids, attention_mask=encoded["attention_mask"].to(device), max_new_tokens=max_new_tokens,
                             streamer=clock, logits_processor=transformers.LogitsProcessorList([guard]),
                             pad_token_id=pad, return_dict_in_generate=True, **sampling)
    rss_after = peak_rss_bytes()
    if guard.steps:
        raise ValueError(f"the model's logits were NaN or infinite at {guard.steps} step(s), so its tokens mean "
                         f"nothing: its weights (or their FP8 scales) hold non-finite values; repair or reload them")
    sequences = out.sequences[0]
    new = sequences[ids.shape[1]:] if not model.config.is_encoder_decoder else sequences[1:]
    fields = getattr(out, "__dataclass_fields__", {})  # transformers 5.24 renamed past_key_values (now deprecated)
    cache = getattr(out, "cache" if "cache" in fields else "past_key_values", None)
    kv_bytes = StorageLedger().add(_cache_tensors(cache)) if cache is not None else 0
    times = clock.times  # the prompt (put first), then each new token
    prefill = times[1] - times[0] if len(times) > 1 else 0.0
    decode = times[-1] - times[1] if len(times) > 2 else 0.0
    if device.type == "cuda":
        peak, source = torch.cuda.max_memory_allocated(device), CUDA_PEAK
    else:
        peak, source = weight_bytes + kv_bytes, HELD_TENSORS
    dtype = next(model.parameters()).dtype
    stats = GenerationStats(batch=1, prompt_tokens=ids.shape[1], new_tokens=len(new), prefill_s=prefill,
                            decode_s=decode, kv_cache=f"transformers {str(dtype).removeprefix('torch.')}",
                            kv_cache_bytes=kv_bytes, weight_bytes=weight_bytes, peak_memory_bytes=peak,
                            peak_memory_source=source,
                            rss_peak_delta_bytes=None if rss_before is None else rss_after - rss_before)
    tokens = new.tolist()
    return PretrainedGeneration(tokenizer.decode(tokens, skip_special_tokens=True), tokens, stats)
