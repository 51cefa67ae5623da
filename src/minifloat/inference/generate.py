"""Text generation with the reference Llama: prefill the prompt once, then one token a step through a KV cache.

    out = generate(model, prompt_ids, max_new_tokens=64, temperature=0.8, top_k=40, seed=0, kv_cache="fp8")
    out.tokens            # (B, 64) int64: the new tokens only
    out.stats             # prefill / decode tokens/s, peak memory (GenerationStats)

Sampling: temperature 0 is greedy (argmax); otherwise the logits (fp32) are divided by the temperature, all but the
`top_k` largest dropped (top_k None keeps the whole vocabulary) and one token drawn per sequence from the softmax with
a `torch.Generator` seeded by `seed` on the model's device: the same call gives the same tokens.

Context: the prompt and the new tokens must fit the model's max_seq_len (positions it was trained on); a longer
request is refused before any work with one ValueError line, never silently shortened (no sliding window: the cache
would have to forget the prompt's start, and RoPE positions past max_seq_len were never trained).

A batch of B prompts of equal length generates B continuations in one pass (they share positions, so no padding or
masks are needed).

`load_run_model(run_dir)` rebuilds a run folder's model (minifloat.inference.export.load_run) from its checkpoint as a
plain Llama: FP8 layers and their scaling state are training's, and inference chooses its own precision. Its text in
and out goes through `minifloat.inference.tokenizer.run_tokenizer(run_dir)` (bytes for a run on text without one).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys
import time
from collections.abc import Sequence

import torch

from minifloat.core.rng import restoring_rng
from minifloat.core.validate import check_choice, check_int, check_number, check_seed
from minifloat.fp8.recipes import BlockScaling, CurrentScaling, MXScaling, Recipe
from minifloat.inference.runs import load_run
from minifloat.inference.kvcache import KV_DTYPES, KVCache
from minifloat.inference.tokenizer import ByteTokenizer
from minifloat.training.memory import StorageLedger
from minifloat.training.model import Llama, LlamaConfig
from minifloat.training.rundir import RUN_FILE
from minifloat.training.throughput import compute_device

# FP8 weights by name (`minifloat generate --fp8`, benchmarks/generate.py): prepare_inference's recipe for each weight
# granularity, activations scaled per token (tensor, row), per 1×128 tile (block) or per 32-element block (mx)
FP8_RECIPES: dict[str, Recipe] = {"tensor": CurrentScaling(), "row": CurrentScaling(granularity="row"),
                                  "block": BlockScaling(), "mx": MXScaling()}
CUDA_PEAK = "cuda.max_memory_allocated"  # GenerationStats.peak_memory_source on a GPU
HELD_TENSORS = "weights + KV cache"  # ... elsewhere: bytes of the tensors generation holds


@dataclasses.dataclass(frozen=True)
class GenerationStats:
    """What one `generate` call took.

    Attributes:
        batch, prompt_tokens, new_tokens: B, the prompt length T and the tokens generated per sequence.
        prefill_s: seconds of the prompt's forward (and the first token's sampling).
        decode_s: seconds of the new_tokens - 1 one-token steps after it.
        kv_cache: the cache's storage ("fp32", "bf16", "fp8"); kv_cache_bytes: its bytes (keys, values, scales).
        weight_bytes: bytes of the model's parameters and buffers (each storage once).
        peak_memory_bytes: on CUDA torch.cuda.max_memory_allocated during the call (weights included); elsewhere
            weight_bytes + kv_cache_bytes (activations, a few MiB at most, not counted). peak_memory_source says
            which (CUDA_PEAK or HELD_TENSORS).
        rss_peak_delta_bytes: growth of the process's peak resident memory during the call (getrusage), None where
            it cannot be read; 0 when an earlier peak (e.g. loading the model) was higher.
    """

    batch: int
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_s: float
    kv_cache: str
    kv_cache_bytes: int
    weight_bytes: int
    peak_memory_bytes: int
    peak_memory_source: str
    rss_peak_delta_bytes: int | None

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens (all sequences) per second of prefill."""
        return self.batch * self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else math.nan

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens (all sequences) per second of the one-token steps; nan when there were none (new_tokens=1)."""
        steps = self.new_tokens - 1
        return self.batch * steps / self.decode_s if steps > 0 and self.decode_s > 0 else math.nan

    def to_dict(self) -> dict:
        """JSON-ready: every field and both rates (nan as None)."""
        rates = {"prefill_tokens_per_s": self.prefill_tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s}
        return {**dataclasses.asdict(self), **{k: None if math.isnan(v) else v for k, v in rates.items()}}


@dataclasses.dataclass(frozen=True)
class Generation:
    """The result of `generate`: tokens (B, max_new_tokens) int64, the new tokens only, and the call's stats."""

    tokens: torch.Tensor
    stats: GenerationStats


# ---------------------------------------------------------------------------------------------------- sampling


def check_sampling(*, max_new_tokens: int, temperature: float, top_k: int | None, seed: int, kv_cache: str,
                   vocab_size: int) -> None:
    """Raise ValueError (one line naming the option and the value) for a bad generation option."""
    check_int("max_new_tokens", max_new_tokens, low=1)
    check_number("temperature", temperature, low=0.0)
    check_int("top_k", top_k, low=1, high=vocab_size, allow_none=True)
    check_seed("seed", seed)
    check_choice("kv_cache", kv_cache, list(KV_DTYPES))


def sample(logits: torch.Tensor, *, temperature: float, top_k: int | None,
           generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `logits` (B, vocab): argmax at temperature 0, else a draw from softmax(logits / T)
    restricted to the top_k largest logits (exactly k candidates, ties broken by torch.topk). Returns (B, 1) int64."""
    logits = logits.float()  # the softmax sums vocab_size exponentials: fp32 (the library's rule)
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    # the largest logit first (as softmax would): a tiny temperature then divides 0 and negatives, never overflowing
    # the largest to inf (inf - inf = NaN in softmax)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        values, indices = torch.topk(logits, top_k, dim=-1)  # (B, k)
        logits = torch.full_like(logits, -math.inf).scatter(-1, indices, values)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)  # (B, 1)


# ---------------------------------------------------------------------------------------------------- generate


def _prompt_batch(prompt_ids, vocab_size: int, device: torch.device) -> torch.Tensor:
    """prompt_ids ((T,) or (B, T) token ids: a tensor or nested sequences of ints) as a (B, T) int64 tensor."""
    if isinstance(prompt_ids, (str, bytes)):
        raise ValueError(f"prompt_ids must be token ids, not {type(prompt_ids).__name__}: encode the text first, "
                         f"run_tokenizer(run).encode(text) (minifloat.inference.tokenizer), or list(text.encode()) "
                         f"for a model of byte tokens")
    try:
        prompt = torch.as_tensor(prompt_ids) if not isinstance(prompt_ids, torch.Tensor) else prompt_ids
    except (TypeError, ValueError, RuntimeError) as err:  # not numbers, or rows of different lengths
        raise ValueError(f"prompt_ids must be a (T,) or (B, T) batch of integer token ids (a tensor, or lists of "
                         f"ints of one length), got a {type(prompt_ids).__name__} torch cannot read as one "
                         f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
    if prompt.dim() == 1:
        prompt = prompt[None]
    if prompt.dim() != 2 or prompt.numel() == 0 or prompt.is_floating_point() or prompt.is_complex():
        raise ValueError(f"prompt_ids must be a non-empty (T,) or (B, T) batch of integer token ids, got shape "
                         f"{tuple(prompt.shape)} of {prompt.dtype}")
    if prompt.min() < 0 or prompt.max() >= vocab_size:
        raise ValueError(f"prompt_ids must be token ids in [0, {vocab_size}), got values in "
                         f"[{int(prompt.min())}, {int(prompt.max())}]")
    return prompt.to(device=device, dtype=torch.long)


def peak_rss_bytes() -> int | None:
    """The process's peak resident set size so far, or None where getrusage is missing (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # kernels run asynchronously: wait for them before reading the time
    return time.perf_counter()


@torch.no_grad()
def generate(model: Llama, prompt_ids, *, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             seed: int = 0, kv_cache: str = "bf16") -> Generation:
    """Continue each prompt by `max_new_tokens` tokens (see the module docstring).

    Args:
        model: a reference Llama (or one prepared for inference, with Llama's forward); it runs in its own dtypes,
            in eval mode during the call.
        prompt_ids: (T,) or (B, T) token ids (a tensor or lists of ints): B prompts of equal length T.
        max_new_tokens: tokens to generate per prompt, >= 1.
        temperature: 0 for greedy decoding, else the softmax temperature (> 0).
        top_k: sample among the k most likely tokens only, 1 <= k <= vocab_size; None for all of them.
        seed: seeds the sampling generator (ignored when greedy).
        kv_cache: the KV cache's storage: "bf16", "fp8" (E4M3, a scale per token and head) or "fp32".
    Returns:
        Generation(tokens (B, max_new_tokens) int64 on the model's device, stats).
    Raises:
        ValueError: a bad option, prompt or model, or T + max_new_tokens - 1 > max_seq_len.
    """
    config = getattr(model, "config", None)
    if not isinstance(config, LlamaConfig):
        raise ValueError(f"generate needs minifloat's reference Llama (a model with a LlamaConfig), got "
                         f"{type(model).__name__}")
    check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed, kv_cache=kv_cache,
                   vocab_size=config.vocab_size)
    device = next(model.parameters()).device
    prompt = _prompt_batch(prompt_ids, config.vocab_size, device)
    (B, T), positions = prompt.shape, prompt.shape[1] + max_new_tokens - 1  # the last new token is never fed
    if T > config.max_seq_len:
        raise ValueError(f"a prompt of {T} tokens is longer than the model's max_seq_len={config.max_seq_len}; "
                         f"shorten it to {config.max_seq_len} tokens or fewer")
    if positions > config.max_seq_len:
        raise ValueError(f"a prompt of {T} tokens and max_new_tokens={max_new_tokens} need {positions} positions, "
                         f"more than the model's max_seq_len={config.max_seq_len}; shorten the prompt or ask for "
                         f"at most {config.max_seq_len - T + 1} new tokens")
    cache = KVCache(config, batch=B, max_len=positions, dtype=kv_cache, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    options = dict(temperature=temperature, top_k=top_k, generator=generator)
    weight_bytes = StorageLedger().add([*model.parameters(), *model.buffers()])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss_before = peak_rss_bytes()
    was_training = model.training
    model.eval()
    try:
        t0 = _clock(device)
        logits, _ = model(prompt, cache=cache)  # (B, T, vocab)
        # steps whose logits held NaN or inf (their argmax is token 0): counted on the device, read once at the end
        nonfinite = (~torch.isfinite(logits[:, -1])).any().int()
        token = sample(logits[:, -1], **options)  # (B, 1)
        new = [token]
        t1 = _clock(device)
        for _ in range(max_new_tokens - 1):
            logits, _ = model(token, cache=cache)  # (B, 1, vocab)
            nonfinite += (~torch.isfinite(logits[:, -1])).any().int()
            token = sample(logits[:, -1], **options)
            new.append(token)
        t2 = _clock(device)
    finally:
        model.train(was_training)
    if bad := int(nonfinite):
        raise ValueError(f"the model's logits were NaN or infinite at {bad} of the {max_new_tokens} steps, so its "
                         f"tokens mean nothing: its weights (or their FP8 scales) hold non-finite values; repair or "
                         f"reload them (a diverged run? resume from an earlier checkpoint)")
    rss_after = peak_rss_bytes()
    if device.type == "cuda":
        peak, source = torch.cuda.max_memory_allocated(device), CUDA_PEAK
    else:
        peak, source = weight_bytes + cache.nbytes(), HELD_TENSORS
    stats = GenerationStats(batch=B, prompt_tokens=T, new_tokens=max_new_tokens, prefill_s=t1 - t0, decode_s=t2 - t1,
                            kv_cache=kv_cache, kv_cache_bytes=cache.nbytes(), weight_bytes=weight_bytes,
                            peak_memory_bytes=peak, peak_memory_source=source,
                            rss_peak_delta_bytes=None if rss_before is None else rss_after - rss_before)
    return Generation(torch.cat(new, dim=1), stats)


# ---------------------------------------------------------------------------------------------------- run folders


def run_device(run_dir: str | pathlib.Path) -> str:
    """The device a run trained on (its run.json), "auto" when the file is missing or unreadable."""
    try:
        device = json.loads((pathlib.Path(run_dir) / RUN_FILE).read_text()).get("device")
    except (OSError, ValueError, AttributeError):
        return "auto"
    return device if isinstance(device, str) and device else "auto"


def load_run_model(run_dir: str | pathlib.Path, *, checkpoint: str = "latest",
                   device: str | torch.device | None = None) -> Llama:
    """A run folder's model (minifloat train --out RUN_DIR) as a plain fp32 Llama with the checkpoint's weights, in
    eval mode: the run's own model (minifloat.inference.export.load_run: FP8 layers and their scaling state
    included) with its parameters copied into a Llama of the same size.

    Args:
        run_dir: the run's folder.
        checkpoint: "latest" (RUN_DIR/ckpt), or another checkpoint folder, inside the run or a path of its own.
        device: where the model goes; None for the device the run trained on (run.json), "auto" for a GPU if any.
    Raises:
        FileNotFoundError: no such run folder or checkpoint.
        CheckpointError (a ValueError): the checkpoint is corrupt or does not fit its own config.
        ValueError: the device is not available.
    """
    target = compute_device(str(device) if device is not None else run_device(run_dir), "generate")
    trained = load_run(run_dir, checkpoint=checkpoint)
    with restoring_rng():  # the new model's random init, overwritten below, leaves torch's generator alone
        model = Llama(trained.config)
    state = trained.state_dict()
    model.load_state_dict({key: state[key] for key in model.state_dict()})  # FP8 scaling state left out
    return model.to(target).eval()


def decode_bytes(tokens: Sequence[int] | torch.Tensor) -> str:
    """Byte tokens (minifloat.training.data's vocabulary) as text; invalid UTF-8 becomes U+FFFD."""
    return ByteTokenizer().decode(tokens)
