"""Peak memory and time of exporting a Hugging Face model folder to FP8: shard by shard against the whole model.

A random Llama (transformers' LlamaForCausalLM, default 24 layers, d 1024, 32k vocabulary: ~430M parameters) is
saved in bf16 with save_pretrained's shards of --shard-size. Each way then runs in its own process, whose peak
resident memory is read with getrusage:

* streamed: `python -m minifloat export --hf DIR --format F --out OUT` (minifloat.inference.hf_stream);
* whole model: `export_hf(prepare_inference(load_pretrained(DIR), recipe=...), OUT)`, the path the command took
  before (and still takes with --calibrate).

A first export (not measured) fills inductor's cache with the compiled casts, so neither way pays their compilation.
The two exports are checked to hold the same tensors, bit for bit, before their figures are printed.

    python benchmarks/export_memory.py                                   # hf-fp8-block, 200 MB shards
    python benchmarks/export_memory.py --layers 8 --shard-size 50MB --format hf-fp8 --json runs/export_memory.json
    python benchmarks/export_memory.py --experts 8 --layers 8 --dim 512                 # a Mixtral-shaped MoE
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import machine  # noqa: E402 - benchmarks/machine.py

WHOLE = """
import sys
from minifloat.inference import hf_models
from minifloat.inference.export import export_hf
from minifloat.inference.prepare import prepare_inference
folder, out, fmt = sys.argv[1:4]
model = prepare_inference(hf_models.load_pretrained(folder), recipe=hf_models.FORMAT_RECIPES[fmt])
export_hf(model, out, format=fmt, activations="dynamic")
"""


def peak(argv: list[str]) -> tuple[float, float]:
    """(peak resident memory in MiB, wall seconds) of `python ARGV` in its own process tree."""
    rss, seconds, code, err = machine.child_peak(argv)
    if code != 0:
        raise SystemExit(f"python {' '.join(argv[:3])} ... failed (exit {code}):\n{err}")
    return rss, seconds


def build(folder: pathlib.Path, layers: int, dim: int, vocab: int, shard_size: str, experts: int = 0) -> int:
    """A random bf16 Llama (with `experts`: a Mixtral of that many experts, two per token) saved in `folder`;
    returns its parameter count."""
    import torch
    import transformers

    torch.manual_seed(0)
    fields = dict(vocab_size=vocab, hidden_size=dim, intermediate_size=dim * 11 // 4, num_hidden_layers=layers,
                  num_attention_heads=dim // 64, num_key_value_heads=dim // 128, tie_word_embeddings=False,
                  max_position_embeddings=2048)
    if experts:
        config, cls = transformers.MixtralConfig(**fields, num_local_experts=experts, num_experts_per_tok=2), \
            transformers.MixtralForCausalLM
    else:
        config, cls = transformers.LlamaConfig(**fields), transformers.LlamaForCausalLM
    with torch.device("meta"):
        model = cls(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model.save_pretrained(folder, max_shard_size=shard_size)
    return sum(p.numel() for p in model.parameters())


def same_tensors(a: pathlib.Path, b: pathlib.Path) -> bool:
    import torch
    from safetensors.torch import load_file

    def read(folder):
        out = {}
        for path in sorted(folder.glob("*.safetensors")):
            out.update({k: v.view(torch.uint8) if v.element_size() == 1 else v for k, v in load_file(path).items()})
        return out

    ta, tb = read(a), read(b)
    return set(ta) == set(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--experts", type=int, default=0, help="a Mixtral of this many experts (0: a Llama)")
    p.add_argument("--shard-size", default="200MB", help="save_pretrained's max_shard_size for the model folder")
    p.add_argument("--format", default="hf-fp8-block", choices=["hf", "hf-fp8", "hf-fp8-block"])
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    machine.add_overwrite(p)
    args = p.parse_args()
    machine.keep_existing(p, args, "json")
    with tempfile.TemporaryDirectory(prefix="minifloat-export-memory-") as tmp:
        folder = pathlib.Path(tmp) / "model"
        params = build(folder, args.layers, args.dim, args.vocab, args.shard_size, args.experts)
        stored = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        shards = len(list(folder.glob("*.safetensors")))
        print(f"model: {params / 1e6:.0f}M parameters, {stored / 2**20:.0f} MiB of bf16 in {shards} file(s)")
        rows = {}
        streamed_out, whole_out = pathlib.Path(tmp) / "streamed", pathlib.Path(tmp) / "whole"
        # a first export, not measured, fills inductor's cache with the compiled casts both ways use (the first
        # process to need them compiles them: ~6 s on 2 cores)
        peak(["-m", "minifloat", "export", "--hf", str(folder), "--format", args.format, "--out",
              str(pathlib.Path(tmp) / "warm-up")])
        rows["streamed"] = peak(["-m", "minifloat", "export", "--hf", str(folder), "--format", args.format,
                                 "--out", str(streamed_out)])
        rows["whole model"] = peak(["-c", WHOLE, str(folder), str(whole_out), args.format])
        if not same_tensors(streamed_out, whole_out):
            raise SystemExit("the two exports differ: a bug in minifloat.inference.hf_stream")
        for name, (rss, seconds) in rows.items():
            print(f"{name:12s} peak RSS {rss:8.0f} MiB ({rss * 2**20 / stored:.2f}x the model's bytes)   "
                  f"{seconds:6.1f} s")
    print(f"streamed / whole model: memory {rows['streamed'][0] / rows['whole model'][0]:.2f}x, time "
          f"{rows['streamed'][1] / rows['whole model'][1]:.2f}x   ({machine.line()})")
    if args.json:
        out = pathlib.Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"command": " ".join(sys.argv), "time": time.strftime("%Y-%m-%d %H:%M"),
                                   "machine": machine.describe(), "parameters": params, "model_bytes": stored,
                                   "files": shards, "format": args.format, "experts": args.experts,
                                   "rows": {k: {"peak_rss_mib": r, "seconds": s} for k, (r, s) in rows.items()}},
                                  indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
