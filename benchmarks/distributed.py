"""Distributed FP8 on this machine: FSDP2 all-gather bytes per step (FP8 vs bf16 / fp32 gathers) and the step time of
DDP / FSDP2 ranks against one process, on the reference Llama (gloo ranks on the CPU; NCCL on a GPU machine).

    python benchmarks/distributed.py --model 10m --nproc 2 --steps 6 --json docs/bench_distributed.json

One process trains the global batch (grad_accum = nproc micro-batches); N ranks train one micro-batch each, the
same global batch per step. Step times are medians over the steps after the first WARMUP; bytes are per rank
per optimizer step as FSDP2 hands them to its collectives (`minifloat.distributed.fsdp.count_fsdp_bytes`). Ratios,
not absolute times, are the result: the ranks share this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minifloat.distributed.fsdp import count_fsdp_bytes, shard
from minifloat.training.model import Llama, LlamaConfig
from minifloat.amp.policy import PrecisionPolicy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import machine  # noqa: E402 - benchmarks/machine.py

PRESETS = ("bf16", "fp8-delayed", "fp8-current")
WARMUP = 3  # first steps left out of the step time: the FP8 kernels compile for each new shape


def _batches(steps: int, n: int, batch: int, seq: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    return [[torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(n)] for _ in range(steps)]


def _step_times(model, opt, batches, policy, *, sync=None) -> list[float]:
    times = []
    for micro in batches:
        t0 = time.perf_counter()
        for x in micro:
            with policy.autocast("cpu"):
                _, loss = model(x[:, :-1], x[:, 1:])
            (loss / len(micro)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def _build(name: str, preset: str):
    torch.manual_seed(0)
    policy = PrecisionPolicy.preset(preset)
    return policy.apply(Llama(LlamaConfig.preset(name))), policy


def _rank(rank: int, args, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, args.threads // args.nproc))
    dist.init_process_group("gloo", rank=rank, world_size=args.nproc)
    try:
        cfg = LlamaConfig.preset(args.model)
        steps = _batches(args.steps, args.nproc, args.batch, args.seq, cfg.vocab_size)
        mine = [[micro[rank]] for micro in steps]
        out = {}
        for preset in PRESETS:
            model, policy = _build(args.model, preset)
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            out[f"ddp/{preset}"] = statistics.median(_step_times(ddp, opt, mine, policy)[WARMUP:])
            for gather in ("fp32", "fp8"):  # fp32: the trainer's gathers (its parameters are fp32)
                if gather == "fp8" and preset == "bf16":
                    continue
                model, policy = _build(args.model, preset)
                shard(model, units=list(model.blocks), fp8_all_gather=gather == "fp8")
                counts = count_fsdp_bytes(model)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                times = _step_times(model, opt, mine, policy)
                out[f"fsdp-{gather}/{preset}"] = statistics.median(times[WARMUP:])
                out[f"bytes/fsdp-{gather}/{preset}"] = {k: v // len(times) for k, v in counts.items()}
        results[rank] = out
    finally:
        dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="reference Llama size (tiny, small, 10m, 100m)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (gloo processes)")
    p.add_argument("--steps", type=int, default=8,
                   help=f"optimizer steps per configuration (the first {WARMUP} are left out)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank's micro-batch")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads shared by all ranks")
    p.add_argument("--json", default="", help="write the results to this JSON file")
    machine.add_overwrite(p)
    args = p.parse_args()
    machine.keep_existing(p, args, "json")

    # one process, the whole global batch as nproc micro-batches
    torch.set_num_threads(args.threads)
    cfg = LlamaConfig.preset(args.model)
    steps = _batches(args.steps, args.nproc, args.batch, args.seq, cfg.vocab_size)
    single = {}
    for preset in PRESETS:
        model, policy = _build(args.model, preset)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        single[preset] = statistics.median(_step_times(model, opt, steps, policy)[WARMUP:])

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_rank, args=(args, port, shared), nprocs=args.nproc, join=True)
        ranks = dict(shared)
    r0 = ranks[0]

    print(f"{args.model} Llama, {args.nproc} gloo ranks × batch {args.batch} × {args.seq} tokens; "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}")
    print(f"{'preset':<12} {'1 proc s/step':>13} {'DDP ×':>7} {'FSDP fp32 gather ×':>19} {'FSDP fp8 gather ×':>18}")
    for preset in PRESETS:
        row = [r0[f"ddp/{preset}"], r0[f"fsdp-fp32/{preset}"], r0.get(f"fsdp-fp8/{preset}")]
        print(f"{preset:<12} {single[preset]:>13.3f} " + " ".join(
            f"{(v / single[preset]) if v else float('nan'):>{w}.2f}" for v, w in zip(row, (7, 19, 18))))
    # a bf16 gather moves the fp32 gather's elements at 2 bytes each (FSDP2's param_dtype=bf16, which the fp32
    # islands' weights cannot take: computed, not run)
    print("all-gather bytes per rank per step:")
    for preset in PRESETS[1:]:
        fp8 = r0[f"bytes/fsdp-fp8/{preset}"]["all_gather"]
        fp32 = r0[f"bytes/fsdp-fp32/{preset}"]["all_gather"]
        r0[f"bytes/fsdp-bf16/{preset}"] = {"all_gather": fp32 // 2}
        print(f"  {preset:<12} fp8 {fp8:>12,}  bf16 {fp32 // 2:>12,}  fp32 {fp32:>12,}  "
              f"fp8/bf16 {fp8 / (fp32 / 2):.3f}  fp8/fp32 {fp8 / fp32:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "single_process_s": single, "rank0": r0,
                       "machine": platform.processor() or platform.machine(), "torch": torch.__version__}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
