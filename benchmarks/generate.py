"""Generation speed and memory of the reference Llama: bf16 against an FP8 KV cache and FP8 weights, same process.

    python benchmarks/generate.py --json docs/bench_generate.json                 # 10m and 100m, batches 1, 8, 64
    python benchmarks/generate.py --models 10m --batches 1 --max-new-tokens 8     # a quick check

Weights are random (seeded): speed and memory do not depend on their values. Every row generates `--max-new-tokens`
tokens greedily after a prompt of `--prompt-len` random bytes, for a batch of equal-length prompts, through
minifloat.inference.generate with a KV cache. Variants:

  bf16          bf16 weights, bf16 KV cache: the baseline of every ratio
  bf16+fp8kv    bf16 weights, FP8 KV cache (E4M3, a scale per token and head)
  fp8-RECIPE    FP8 weights by minifloat.inference.prepare_inference under FP8_RECIPES[RECIPE] (tensor, row,
                block, mx: minifloat.inference.generate), quantized from the fp32 weights, the rest bf16; bf16 KV cache

Each (model, batch, variant) runs once untimed (warm-up: first-call allocations, kernel choice and compilation, at
every length the timed call reaches) and then timed. Ratios are against the bf16 row of the same model and batch, measured in the same process. Peak
memory is torch.cuda.max_memory_allocated on a GPU, else the bytes of the weights and the KV cache
(GenerationStats.peak_memory_source says which); decode tokens/s counts the one-token steps after the prefill.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import pathlib
import sys
from collections.abc import Iterator

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import machine  # noqa: E402 - benchmarks/machine.py

from minifloat.inference.generate import FP8_RECIPES, generate  # noqa: E402
from minifloat.inference.prepare import prepare_inference  # noqa: E402
from minifloat.training.model import Llama, LlamaConfig  # noqa: E402
from minifloat.training.throughput import resolve_device  # noqa: E402

BASELINE = "bf16"
MIB = 2 ** 20


def variants(fp32: Llama, device: torch.device, wanted: set[str]) -> Iterator[tuple[str, Llama, str]]:
    """(name, model on `device`, KV cache) of each variant in `wanted` (all when empty; the baseline always), built
    one at a time from the CPU fp32 model, which stays there unchanged (so it is not in a GPU's peak): FP8 weights
    are quantized from fp32, then everything else is cast to bf16, as `minifloat generate --fp8` does."""
    names = [BASELINE, "bf16+fp8kv", *(f"fp8-{r}" for r in FP8_RECIPES)]
    for name in (n for n in names if not wanted or n in wanted or n == BASELINE):
        model = copy.deepcopy(fp32)
        if name.startswith("fp8-"):
            model = prepare_inference(model, recipe=FP8_RECIPES[name.removeprefix("fp8-")])
        yield name, model.to(device=device, dtype=torch.bfloat16), "fp8" if name == "bf16+fp8kv" else "bf16"


def measure(model: Llama, *, batch: int, prompt_len: int, max_new_tokens: int, kv_cache: str,
            device: torch.device) -> dict:
    """One warm-up call, then the timed one; its stats as a dict."""
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(device)
    # the warm-up runs the same lengths: a kernel may compile once a growing KV cache passes a size
    # (numerics.compiling.EAGER_BELOW), which must not fall in the timed call
    generate(model, prompt, max_new_tokens=max_new_tokens, kv_cache=kv_cache)
    return generate(model, prompt, max_new_tokens=max_new_tokens, kv_cache=kv_cache).stats.to_dict()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (FP8 weights and their scales included), each storage once."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base or math.isnan(value) else value / base


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="10m,100m", help="comma list of Llama presets (default 10m,100m)")
    p.add_argument("--batches", default="1,8,64", help="comma list of batch sizes (default 1,8,64)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt bytes per sequence (default 64)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per sequence (default 128)")
    p.add_argument("--variants", default="", help="comma list of variants to run (default: all)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--json", default="", metavar="PATH", help="also write the results as JSON to PATH")
    machine.add_overwrite(p)
    args = p.parse_args()
    machine.keep_existing(p, args, "json")
    device = resolve_device(args.device)
    wanted = {v.strip() for v in args.variants.split(",") if v.strip()}
    rows = []
    print(f"{'model':>5} {'batch':>5} {'variant':<12} {'prefill tok/s':>13} {'decode tok/s':>12} {'× bf16':>7} "
          f"{'peak MiB':>9} {'× bf16':>7} {'KV MiB':>8} {'weights MiB':>11} {'× bf16':>7}")
    for name in (m.strip() for m in args.models.split(",")):
        torch.manual_seed(args.seed)
        fp32 = Llama(LlamaConfig.preset(name)).eval()
        for label, model, kv_cache in variants(fp32, device, wanted):
            for batch in (int(b) for b in args.batches.split(",")):
                stats = measure(model, batch=batch, prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens,
                                kv_cache=kv_cache, device=device)
                base_row = next((r for r in rows if (r["model"], r["batch"], r["variant"]) == (name, batch, BASELINE)),
                                None)
                ref = base_row["stats"] if base_row else stats
                weights = weight_bytes(model)
                ref_weights = base_row["weight_bytes"] if base_row else weights
                row = {"model": name, "batch": batch, "variant": label, "stats": stats, "weight_bytes": weights,
                       "weights_vs_bf16": ratio(weights, ref_weights),
                       "decode_vs_bf16": ratio(stats["decode_tokens_per_s"], ref["decode_tokens_per_s"]),
                       "prefill_vs_bf16": ratio(stats["prefill_tokens_per_s"], ref["prefill_tokens_per_s"]),
                       "peak_memory_vs_bf16": ratio(stats["peak_memory_bytes"], ref["peak_memory_bytes"])}
                rows.append(row)
                decode = stats["decode_tokens_per_s"] or math.nan
                print(f"{name:>5} {batch:>5} {label:<12} {stats['prefill_tokens_per_s']:>13.0f} {decode:>12.1f} "
                      f"{row['decode_vs_bf16'] or math.nan:>7.2f} {stats['peak_memory_bytes'] / MIB:>9.1f} "
                      f"{row['peak_memory_vs_bf16'] or math.nan:>7.2f} {stats['kv_cache_bytes'] / MIB:>8.2f} "
                      f"{weights / MIB:>11.1f} {row['weights_vs_bf16'] or math.nan:>7.2f}",
                      flush=True)
            del model
        del fp32
    source = rows[0]["stats"]["peak_memory_source"] if rows else "-"
    print(f"peak memory: {source}; × bf16: ratio to the bf16 row of the same model and batch, this process")
    if args.json:
        info = {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
                else machine.line(), "torch": torch.__version__,
                "threads": torch.get_num_threads(), "prompt_len": args.prompt_len,
                "max_new_tokens": args.max_new_tokens, "seed": args.seed}
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
