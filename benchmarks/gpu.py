"""FP8 training speed on a GPU, in one command (issue 21): GEMMs, one linear layer, an MLP stack and the reference
Llama, for bf16, every minifloat recipe and torchao.float8, eager and compiled.

Sections (full sizes; --smoke shrinks every one of them so that the whole run takes seconds on a CPU):

    gemm      one GEMM (M×K×N, bf16 output) on operands quantized beforehand: the ceiling. bf16 `a @ bᵀ` against
              mf.scaled_mm on E4M3 operands scaled per tensor, per row, per 1×128 tile × 128×128 block (fprop,
              dgrad), 1×128 × 1×128 tiles (block-wgrad: BlockScaling's wgrad) and MX; and
              torch._scaled_mm per tensor with fast accumulation (torchao's forward GEMM; minifloat never asks for it)
    linear    one nn.Linear(K, N, bias=False), forward and backward (all three GEMMs: the input requires grad) at
              8192³ and at Llama-3-8B's shapes with 16384 tokens, K×N = 4096×6144 (q, k, v fused under GQA),
              4096×4096, 4096×14336, 14336×4096; no optimizer (the FP8 step still ends: mf.fp8_step)
    mlp       4 residual SwiGLU blocks x + mlp(RMSNorm(x)) (d 4096, ffn 14336, 8192 tokens), MSE loss, AdamW
    llama8b   the reference Llama (minifloat.training.model) at Llama-3-8B layer shapes: 4 layers, d 4096, ffn 14336,
              32 heads (the model has no grouped-query attention: k and v are 4096×4096), vocab 32000, untied head,
              RoPE θ 500000, 4×2048 tokens; the trainer's PrecisionPolicy presets; AdamW
    100m      the "100m" preset (14 layers, d 768, byte vocabulary) at 8×1024 = 8192 tokens/step; AdamW
    1b        the "1b" preset (Llama-3.2-1B's body: 16 layers, d 2048, 32 heads, 8 kv heads, ffn 8192, untied head) at
              a 32000-token vocabulary, 8×2048 = 16384 tokens/step, SDPA attention on CUDA; AdamW (issue 23's MFU)

Variants: bf16 (fp32 parameters, torch.autocast bfloat16: the baseline); minifloat's delayed, current, row (current
scaling per row), block (DeepSeek 1×128 / 128×128), mxfp8, nvfp4, mxfp4 (mf.convert(..., keep_first_last=False) in
the linear and MLP sections, the PrecisionPolicy preset in the Llama ones, with its fp32 head, norms and embeddings);
delayed-pays and current-pays (the Llama sections only: the preset with PrecisionPolicy.apply(filter=
mf.where_fp8_pays(...)), only the linears FP8 is predicted to speed up at the section's tokens on this GPU, H100 or
H200 rates; docs/fp8.md "Where FP8 pays"); torchao-tensorwise and torchao-rowwise
(torchao.float8.convert_to_float8_training, on the linears minifloat's presets convert) when torchao imports. On an H100 (SM90) MX and NVFP4 GEMMs run emulated (docs/fp8.md), so their rows
time the emulation. Every variant runs eager (unless --compiled-only); compiled (torch.compile of each repeated block,
or of the whole model with --compile-scope model; inductor defaults) runs a priority list (COMPILED_PRIORITY) while
--budget-s lasts, or --compile-variants. A compiled run is skipped when it would end past --budget-s by the time the
section's compiled runs have taken so far (COMPILE_GUESS_S until one has run).

Measured, per variant, one at a time (built from the same seed: same weights and data), memory freed in between:
  * step time: the median of --steps steps after --warmup untimed ones, each step between two CUDA events (on a CPU,
    wall clock); tokens/s and TFLOP/s from it (6·weights·tokens for linears, the trainer's flops_per_token for the
    Llama); the speedup over bf16 in the same mode (eager against eager, compiled against compiled);
  * host time (GPU only): the median time Python took to issue a step, without synchronising; close to the step
    time means the step is bound by host work and launches, not by the GPU;
  * peak memory: torch.cuda.max_memory_allocated over the timed steps (weights, optimizer state, activations);
  * SQNR in dB of the first step's output (logits for the Llama) against bf16 eager's: finite where FP8 really ran;
  * compiled runs: dynamo's graph count and graph breaks (with their reasons).
A variant that fails (out of memory, a compile error) gets a row saying why, and the run goes on. --profile PATH
also profiles 2 steps of every run (torch.profiler) and writes its op table (top 25 by GPU self time) to PATH, and
the kernels launched, the GPU's busy time, the host's syncs and the time by part (GEMMs, casts, attention, optimizer:
benchmarks/time_parts.py) per step to the JSON: where the time goes, in the same
call. For the host's side it adds the ops and CUDA runtime calls by CPU self time and the Python functions by their
own time (cProfile over 2 more steps): what a host-bound step (the 100m section) spends its time on.

Usage:
    python benchmarks/gpu.py                                      # everything, under ~8 minutes on one H100
    python benchmarks/gpu.py --sections linear,llama8b --variants current,torchao-tensorwise --compile-variants all
    python benchmarks/gpu.py --smoke --device cpu --json /tmp/smoke.json    # tiny shapes, seconds on a CPU
The JSON (default runs/gpu_bench.json; an existing file is refused without --overwrite) holds every figure and the
machine; it is rewritten after every measurement ("complete": false until the end), so a run stopped by a time limit
keeps what it measured. --markdown writes the tables for docs/benchmarks.md.

No numbers here are asserted anywhere: this is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F
from rich.table import Table
from torch import nn
from torch._dynamo.utils import counters

import minifloat as mf
from minifloat.core.autocast import cuda_fp32_matmuls
from minifloat.fp8.native import native_scale
from minifloat.numerics import triton_tiles
from minifloat.training.compiled import compile_forward
from minifloat.training.model import Llama, LlamaConfig, SwiGLU
from minifloat.training.optimizer import fused_on_cuda
from minifloat.training.throughput import flops_per_token, mfu, peak_bf16_flops

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import machine  # noqa: E402 - benchmarks/machine.py
import step_time  # noqa: E402 - benchmarks/step_time.py: its consoles, command line, torchao check, FP8 layer count
import time_parts  # noqa: E402 - benchmarks/time_parts.py: where a profiled step's time goes

BASELINE = "bf16"
GIB = 2**30
SECTIONS = ("gemm", "linear", "mlp", "llama8b", "100m", "1b")
# seconds a compiled run is expected to take, compile included, until one of its section has been timed (then the
# longest measured): the full Llama compiles in ~1 min per variant on an H100's host; the 100m preset has 14 layers
COMPILE_GUESS_S = {"linear": 30, "mlp": 60, "llama8b": 90, "100m": 120, "1b": 150}

# (K, N) of Llama-3-8B's linears: q, k, v fused (4096 + 2·1024 under GQA), o, gate / up, down
LLAMA3_8B_LINEARS = ((4096, 6144), (4096, 4096), (4096, 14336), (14336, 4096))
GEMM_SHAPES = [(8192, 8192, 8192)] + [(16384, k, n) for k, n in LLAMA3_8B_LINEARS]  # (M = tokens, K, N)
SMOKE_GEMM_SHAPES = [(64, 128, 128), (128, 128, 128)]
FULL = {
    "gemm": GEMM_SHAPES,
    "linear": GEMM_SHAPES,
    "mlp": [dict(tokens=8192, d_model=4096, ffn=14336, blocks=4)],
    "llama8b": [dict(config=dict(n_layer=4, d_model=4096, n_head=32, d_ff=14336, vocab_size=32000, max_seq_len=2048,
                                 rope_theta=500000.0, tie_embeddings=False), batch=4, seq=2048)],
    "100m": [dict(preset="100m", batch=8, seq=1024)],
    "1b": [dict(preset="1b", vocab=32000, batch=8, seq=2048)],
}
# every quantized tensor under minifloat's EAGER_BELOW (32768 elements), so that no kernel compiles on a CPU
SMOKE = {
    "gemm": SMOKE_GEMM_SHAPES,
    "linear": SMOKE_GEMM_SHAPES,
    "mlp": [dict(tokens=64, d_model=128, ffn=128, blocks=2)],
    "llama8b": [dict(config=dict(n_layer=2, d_model=128, n_head=4, d_ff=128, vocab_size=256, max_seq_len=32,
                                 tie_embeddings=False), batch=2, seq=32)],
    "100m": [dict(preset="tiny", batch=2, seq=32)],
    "1b": [dict(preset="tiny", vocab=512, batch=2, seq=32)],
}

# compiled runs by default, most wanted first (issue 21's targets), each on its section's first shape, while the
# time budget lasts
COMPILED_PRIORITY = (
    ("linear", ("bf16", "current", "delayed", "torchao-tensorwise")),
    ("llama8b", ("bf16", "delayed", "current")),
    ("1b", ("bf16", "current", "delayed")),
    ("100m", ("bf16", "current", "delayed")),
    ("llama8b", ("row", "block", "torchao-tensorwise")),
    ("linear", ("row", "block", "torchao-rowwise")),
    ("mlp", ("bf16", "current", "delayed")),
)
COMPILED_SMOKE = (("linear", ("bf16", "current")),)  # a compiled run in seconds on a CPU

NOTES = {  # what a reader of each table should know; printed under it and written to the JSON
    "gemm": "operands quantized before timing, bf16 output; minifloat's own GEMMs never ask for fast accumulation",
    "linear": "fp32 weight under torch.autocast(bfloat16); the input requires grad, so all three GEMMs run",
    "mlp": "fp32 weights under torch.autocast(bfloat16); RMSNorm in fp32 (mf.RMSNorm); AdamW fused on CUDA",
    "llama8b": "no grouped-query attention (k and v projections 4096x4096); attention: the model's default, "
               "scaled_dot_product_attention on CUDA (fp32 scores materialised on a CPU); fp32 head and "
               "cross-entropy (PrecisionPolicy); nvfp4 and mxfp4 presets keep the last block in bf16; AdamW fused "
               "on CUDA (as the trainer)",
    "100m": "byte vocabulary (256), tied head in fp32; attention as above",
    "1b": "the 1b preset at a 32000-token vocabulary: grouped-query attention (8 kv heads), SDPA on CUDA, untied "
          "fp32 head; MFU against the GPU's dense BF16 peak",
}


# ----------------------------------------------------------------------------------------------------------- variants

@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    recipe: object | None = None  # a minifloat recipe
    preset: str = BASELINE  # the Llama sections' PrecisionPolicy preset (`recipe` replaces its recipe)
    torchao: str | None = None  # a torchao.float8 recipe name
    pays: bool = False  # the Llama sections: only the linears mf.where_fp8_pays predicts faster (docs/fp8.md)


VARIANTS = (
    Variant(BASELINE),
    Variant("delayed", mf.DelayedScaling(), "fp8-delayed"),
    Variant("current", mf.CurrentScaling(), "fp8-current"),
    Variant("row", mf.CurrentScaling(granularity="row"), "fp8-current"),
    Variant("block", mf.BlockScaling(), "fp8-block"),
    Variant("mxfp8", mf.MXScaling(), "mxfp8"),
    Variant("nvfp4", mf.NVFP4Scaling(), "nvfp4"),
    Variant("mxfp4", mf.MXScaling(format="e2m1"), "mxfp4"),
    Variant("delayed-pays", mf.DelayedScaling(), "fp8-delayed", pays=True),
    Variant("current-pays", mf.CurrentScaling(), "fp8-current", pays=True),
    Variant("torchao-tensorwise", torchao="tensorwise"),
    Variant("torchao-rowwise", torchao="rowwise"),
)
# the GEMM section's E4M3 operands: (granularity of a, of b, torch._scaled_mm's fast accumulation)
GEMMS = {"tensor": ("tensor", "tensor", False), "tensor-fast-accum": ("tensor", "tensor", True),
         "row": ("row", "row", False), "block": ("tile", "block", False),
         "block-wgrad": ("tile", "tile", False),  # BlockScaling's wgrad: 1×128 tiles on both operands
         "mxfp8": ("mx", "mx", False)}


def torchao_float8():
    """The torchao.float8 module, or None and the reason it cannot be used."""
    convert, why_not = step_time._import_torchao_float8()
    if convert is None:
        return None, why_not
    import torchao.float8
    return torchao.float8, None


def gpu_name(device: torch.device) -> str:
    """The mf.where_fp8_pays GPU whose measured rates fit `device`: h200 on an H200, else h100."""
    return "h200" if device.type == "cuda" and "H200" in torch.cuda.get_device_name(device) else "h100"


def to_fp8(model: nn.Module, variant: Variant, names: set[str] | None = None) -> nn.Module:
    """`model`'s linears (those in `names`, or all) as the variant's FP8 layers: minifloat's or torchao's."""
    if variant.recipe is not None:
        return mf.convert(model, recipe=variant.recipe, keep_first_last=False,
                          filter=None if names is None else lambda name, _: name in names)
    if variant.torchao is not None:
        float8, _ = torchao_float8()
        config = float8.Float8LinearConfig.from_recipe_name(variant.torchao)
        return float8.convert_to_float8_training(
            model, config=config, module_filter_fn=None if names is None else lambda _, fqn: fqn in names)
    return model


# --------------------------------------------------------------------------------------------------------- workloads

@dataclasses.dataclass
class Workload:
    step: Callable[[], torch.Tensor]  # one training step (or GEMM); returns its forward's output, detached
    tokens: int  # per step
    flops: float  # per step
    model: nn.Module | None = None


def autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


COMPILE_MODE = {"mode": "default", "scope": "blocks"}  # torch.compile's (--compile-mode, --compile-scope)


def compile_model(model: nn.Module):
    """The model's forward under torch.compile in the run's --compile-mode ("reduce-overhead": CUDA graphs, for
    host-bound steps) and --compile-scope: the trainer's `compile_forward`. With "blocks" (the default) the Llama's
    blocks or the MLP section's residual blocks are each compiled and the rest runs eagerly: one graph per distinct
    block, compiled once and reused by its likes (regional compilation). A whole FP8 Llama is one graph many times
    larger: the 6-block `10m` preset took 334 s to compile on 2 CPU cores, its blocks 18 s, and the 14-block 100m did
    not finish compiling within 150 s on an H200. Anything else (one linear) compiles whole."""
    return compile_forward(model, COMPILE_MODE["mode"], COMPILE_MODE["scope"])


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """The MLP's and the Llama's AdamW: fused on CUDA, as the trainer's (minifloat.training.optimizer)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4, **fused_on_cuda([{"params": list(model.parameters())}]))


def gemm_workload(shape, variant: str, device: torch.device, compiled: bool) -> Workload:
    m, k, n = shape
    a = torch.randn(m, k, device=device).to(torch.bfloat16)  # (M, K)
    b = torch.randn(n, k, device=device).to(torch.bfloat16)  # (N, K)
    if variant == BASELINE:
        return Workload(lambda: a @ b.t(), m, 2.0 * m * k * n)
    ga, gb, fast_accum = GEMMS[variant]
    pow2 = ga == "tile"  # BlockScaling's power-of-two scales
    qa = mf.quantize(a, mf.E4M3, granularity=ga, power_of_two=pow2, operand_dtype=torch.bfloat16)
    qb = mf.quantize(b, mf.E4M3, granularity=gb, power_of_two=pow2, operand_dtype=torch.bfloat16)
    if fast_accum:
        def step():
            return torch._scaled_mm(qa.data, qb.data.t(), scale_a=native_scale(qa, "a"),
                                    scale_b=native_scale(qb, "b"), out_dtype=torch.bfloat16, use_fast_accum=True)
    else:
        def step():
            return mf.scaled_mm(qa, qb, out_dtype=torch.bfloat16)
    return Workload(step, m, 2.0 * m * k * n)


def linear_workload(shape, variant: Variant, device: torch.device, compiled: bool) -> Workload:
    tokens, k, n = shape
    with torch.device(device):
        model = to_fp8(nn.Sequential(nn.Linear(k, n, bias=False)), variant)  # mf.convert swaps children only
        x = torch.randn(tokens, k, requires_grad=True)  # (T, K): the previous layer's activation
        grad_y = torch.randn(tokens, n)  # (T, N)
    forward = compile_model(model) if compiled else model

    def step():
        with autocast(device):
            y = forward(x)  # (T, N)
        y.backward(grad_y.to(y.dtype))
        mf.fp8_step(model)  # no optimizer here to end the FP8 step; a no-op without minifloat layers
        x.grad = None
        model.zero_grad(set_to_none=True)
        return y.detach()

    return Workload(step, tokens, 6.0 * tokens * k * n, model)


class ResidualSwiGLU(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.norm, self.mlp = mf.RMSNorm(config.d_model, config.norm_eps), SwiGLU(config)

    def forward(self, x):
        return x + self.mlp(self.norm(x))  # (T, C)


def train_step(forward, opt: torch.optim.Optimizer, device: torch.device, *inputs, compiled: bool = False):
    """A step that returns (output, loss) from forward(*inputs) and ends at opt.step() (which ends the FP8 step).
    With --cuda-graphs, an eager run's forward and backward are replayed from one CUDA graph (`graphed_step`)."""
    if GRAPHS["on"] and not compiled:
        return graphed_step(forward, opt, device, *inputs)

    def step():
        with autocast(device):
            out, loss = forward(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.detach()

    return step


GRAPHS = {"on": False}  # --cuda-graphs
GRAPH_WARMUP = 2  # eager steps on a side stream before the capture: seed delayed scales, compile and tune kernels


def graphed_step(forward, opt: torch.optim.Optimizer, device: torch.device, *inputs):
    """train_step with forward and backward captured once in a CUDA graph and replayed (PyTorch's whole-network
    capture of an eager model; minifloat's layers take nothing from a host cache while captured, docs/fp8.md): the
    first call runs GRAPH_WARMUP eager steps on a side stream, then captures; every call replays the graph, whose
    backward writes the gradients afresh, and runs the optimizer (and with it the FP8 step's end) eagerly. The inputs
    are the step's static tensors (the sections train on one batch). Autocast without its weight cache, as captures
    need it."""
    graph: dict = {}

    def eager_step():
        with torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False):
            out, loss = forward(*inputs)
        loss.backward()
        return out

    def step():
        if not graph:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(GRAPH_WARMUP):
                    eager_step()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            torch.cuda.current_stream(device).wait_stream(side)
            graph["graph"] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph["graph"]):
                graph["out"] = eager_step()
        graph["graph"].replay()
        opt.step()
        return graph["out"].detach()  # the graph's static output: the next replay overwrites it

    return step


def mlp_workload(shape: dict, variant: Variant, device: torch.device, compiled: bool) -> Workload:
    config = LlamaConfig(d_model=shape["d_model"], d_ff=shape["ffn"], n_head=1, vocab_size=16)
    with torch.device(device):
        model = to_fp8(nn.Sequential(*(ResidualSwiGLU(config) for _ in range(shape["blocks"]))), variant)
        x = torch.randn(shape["tokens"], shape["d_model"], requires_grad=True)  # (T, C)
        target = torch.randn(shape["tokens"], shape["d_model"])
    forward = compile_model(model) if compiled else model

    def with_loss(x):
        y = forward(x)
        return y, F.mse_loss(y.float(), target)

    opt = adamw(model)
    flops = 6.0 * shape["tokens"] * 3 * shape["d_model"] * shape["ffn"] * shape["blocks"]
    return Workload(train_step(with_loss, opt, device, x, compiled=compiled), shape["tokens"], flops, model)


def llama_workload(shape: dict, variant: Variant, device: torch.device, compiled: bool) -> Workload:
    config = (LlamaConfig.preset(shape["preset"], vocab_size=shape.get("vocab", 256)) if "preset" in shape
              else LlamaConfig(**shape["config"]))
    config = dataclasses.replace(config, max_seq_len=max(config.max_seq_len, shape["seq"]))
    with torch.device(device):
        model = Llama(config)
        idx = torch.randint(config.vocab_size, (shape["batch"], shape["seq"]))  # (B, T)
        targets = torch.randint(config.vocab_size, (shape["batch"], shape["seq"]))
    tokens = shape["batch"] * shape["seq"]
    flops = tokens * flops_per_token(model, n_layers=config.n_layer, d_model=config.d_model, seq_len=shape["seq"])
    policy = mf.PrecisionPolicy.preset(variant.preset)
    if variant.recipe is not None:
        policy = dataclasses.replace(policy, recipe=variant.recipe)
    plan = mf.PrecisionPolicy.preset("fp8-current").plan(model)
    pays = mf.where_fp8_pays(policy.recipe, tokens=tokens, gpu=gpu_name(device)) if variant.pays else None
    model = policy.apply(model, filter=pays)
    if variant.torchao is not None:  # on the linears minifloat's presets convert
        model = to_fp8(model, variant, {name for name, kind in plan.items() if kind == "fp8"})
    forward = compile_model(model) if compiled else model
    opt = adamw(model)
    return Workload(train_step(forward, opt, device, idx, targets, compiled=compiled), tokens, flops, model)


GRAPHED_SECTIONS = ("mlp", "llama8b", "100m", "1b")  # their eager runs replay CUDA graphs under --cuda-graphs
LLAMA_SECTIONS = ("llama8b", "100m", "1b")  # the sections whose models have layers that pay and layers that don't
BUILDERS = {"gemm": gemm_workload, "linear": linear_workload, "mlp": mlp_workload, "llama8b": llama_workload,
            "100m": llama_workload, "1b": llama_workload}


# ----------------------------------------------------------------------------------------------------------- running

@dataclasses.dataclass(frozen=True)
class Case:
    section: str
    shape_index: int
    variant: str
    compiled: bool

    @property
    def mode(self) -> str:
        if not self.compiled:
            return "eager (CUDA graphs)" if GRAPHS["on"] and self.section in GRAPHED_SECTIONS else "eager"
        details = ([] if COMPILE_MODE["mode"] == "default" else [COMPILE_MODE["mode"]]) + (
            ["whole model"] if COMPILE_MODE["scope"] == "model" else [])
        return "compiled" + (f" ({', '.join(details)})" if details else "")


def shape_name(shape) -> str:
    if isinstance(shape, tuple):
        return "x".join(map(str, shape))
    if "preset" in shape:
        return f"{shape['preset']}, {shape['batch']}x{shape['seq']} tokens"
    if "config" in shape:
        c = shape["config"]
        return (f"{c['n_layer']} layers d{c['d_model']} ffn{c['d_ff']} {c['n_head']} heads vocab {c['vocab_size']}, "
                f"{shape['batch']}x{shape['seq']} tokens")
    return f"{shape['blocks']} blocks d{shape['d_model']} ffn{shape['ffn']}, {shape['tokens']} tokens"


def time_steps(step: Callable, n: int, device: torch.device) -> tuple[list[float], int | None, list[float] | None]:
    """Milliseconds of each of `n` steps, the peak memory allocated over them (None on a CPU), and on a GPU the host
    milliseconds of each step: how long Python took to issue it (no synchronisation in between). A step whose host
    time is close to its step time is bound by host work and kernel launches (or synchronises), not by the GPU."""
    if device.type != "cuda":
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t0))
        return times, None, None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    host = []
    for start, end in events:
        start.record()
        t0 = time.perf_counter()
        step()
        host.append(1e3 * (time.perf_counter() - t0))
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events], torch.cuda.max_memory_allocated(device), host


PROFILE_STEPS = 2
PROFILE_ROWS = 25
HOST_ROWS = 30  # Python functions listed per run by the host profile (cProfile), by their own time


def profile_steps(step: Callable, device: torch.device, title: str, path: pathlib.Path) -> dict:
    """Profile PROFILE_STEPS steps with torch.profiler; append the op table (top PROFILE_ROWS by the device's self
    time on a GPU, by CPU self time on a CPU) under `title` to `path`. Returns per-step figures: the kernels launched
    and the GPU's busy time (their summed durations), so that busy time against step time says how much of the step
    the GPU idles (waiting on the host), and the host's synchronisations with the GPU per step.

    Where the host's time goes is appended too: on a GPU the same ops and CUDA runtime calls by CPU self time
    (kernel launches, `torch._scaled_mm`'s setup, synchronisations), and on every device the Python functions by
    their own time over PROFILE_STEPS more steps (cProfile: the caster, `quantize`, Triton's launcher, autograd)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILE_STEPS):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    cuda = device.type == "cuda"
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    # cudaStreamSynchronize (.item(), a copy to the host), cudaDeviceSynchronize, cudaEventSynchronize; the one
    # torch.cuda.synchronize after the steps above is not the steps'
    syncs = sum("Synchronize" in e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU)
    figures = {"kernels_per_step": len(kernels) / PROFILE_STEPS if kernels else None,
               "gpu_busy_ms": busy_us / 1e3 / PROFILE_STEPS if kernels else None,
               "host_syncs_per_step": max(syncs - 1, 0) / PROFILE_STEPS if cuda else None,
               # GEMMs, casts, attention, optimizer... per step (benchmarks/time_parts.py): kernels on a GPU, the ops'
               # own CPU time on a CPU
               "time_by_part_ms": time_parts.time_by_part(prof.events(), cuda, PROFILE_STEPS)}
    if cuda and kernels:
        # kernels no CPU op launched (their correlation reaches none): what the parts above leave of the busy time
        rest = figures["gpu_busy_ms"] - sum(figures["time_by_part_ms"].values())
        if rest > 1e-3:
            figures["time_by_part_ms"]["unattributed"] = rest
    python = cProfile.Profile()
    python.enable()
    for _ in range(PROFILE_STEPS):
        step()
    if cuda:
        torch.cuda.synchronize(device)
    python.disable()
    listing = io.StringIO()
    pstats.Stats(python, stream=listing).sort_stats("tottime").print_stats(HOST_ROWS)
    with path.open("a") as f:
        f.write(f"\n=== {title}: {PROFILE_STEPS} steps"
                + (f", {figures['kernels_per_step']:.0f} kernels and {figures['gpu_busy_ms']:.2f} ms of kernel time "
                   f"per step, {figures['host_syncs_per_step']:.1f} host syncs per step" if kernels else "") + " ===\n")
        f.write(prof.key_averages().table(sort_by=sort, row_limit=PROFILE_ROWS, max_name_column_width=70))
        parts = figures["time_by_part_ms"]
        f.write(f"\n--- {title}: {'GPU' if cuda else 'CPU'} time per step by part (benchmarks/time_parts.py) ---\n"
                + "".join(f"{part:22s} {ms:10.3f} ms\n" for part, ms in parts.items()))
        if cuda:
            f.write(f"\n--- {title}: the host's side, by CPU self time (launches, runtime calls, syncs) ---\n")
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=PROFILE_ROWS,
                                              max_name_column_width=70))
        f.write(f"\n--- {title}: host Python over {PROFILE_STEPS} more steps (cProfile, by own time) ---\n")
        f.write(listing.getvalue())
    return figures


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_case(case: Case, shapes: dict, variants: dict[str, Variant], references: dict, args) -> dict:
    """One variant's row: its figures, or the one-line reason it failed."""
    shape = shapes[case.section][case.shape_index]
    row = {"section": case.section, "shape": shape_name(shape), "variant": case.variant, "mode": case.mode}
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    counters.clear()
    if case.compiled:
        torch._dynamo.reset()  # a fresh cache: each variant compiles from scratch and cannot hit the recompile limit
    try:
        row.update(measure(case, shape, case.variant if case.section == "gemm" else variants[case.variant],
                           references, args))
    except Exception as exc:  # noqa: BLE001 - one failing variant (out of memory, a compile error) ends only its row
        row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    free_memory(args.device)
    row["wall_s"] = time.perf_counter() - t0
    return row


def measure(case: Case, shape, variant, references: dict, args) -> dict:
    """Build, warm up and time one case. The bf16 eager run of a shape leaves its first output in `references`
    (on the CPU) for the others' SQNR."""
    work = BUILDERS[case.section](shape, variant, args.device, case.compiled)
    out, key, figures = work.step(), (case.section, case.shape_index), {}
    if case.variant == BASELINE and not case.compiled:
        references[key] = out.float().cpu()
        figures.update(sqnr_db=None, reference=True)
    elif key in references:
        sqnr = mf.sqnr_db(references[key].to(args.device), out.float())
        figures.update(sqnr_db=sqnr if math.isfinite(sqnr) else None, bitwise_equal_to_bf16=sqnr == math.inf)
    del out
    for _ in range(args.warmup - 1):
        work.step()
    times, peak, host = time_steps(work.step, args.steps, args.device)
    ms = statistics.median(times)
    if host is not None:
        figures.update(host_ms=statistics.median(host))
    if args.profile:
        title = f"{case.section} {shape_name(shape)} {case.variant} {case.mode}"
        figures.update(profile_steps(work.step, args.device, title, pathlib.Path(args.profile)))
    tokens_per_s = work.tokens / ms * 1e3
    figures.update(step_ms=ms, step_ms_all=times, tokens_per_s=tokens_per_s, tflops=work.flops / ms / 1e9,
                   peak_gib=None if peak is None else peak / GIB,
                   mfu=mfu(tokens_per_s, work.flops / work.tokens, peak_bf16_flops(args.device)),
                   fp8_linears=None if work.model is None else step_time.count_fp8_linears(work.model))
    if case.compiled:
        figures.update(graphs=counters["stats"]["unique_graphs"], graph_breaks=sum(counters["graph_break"].values()),
                       graph_break_reasons=sorted(counters["graph_break"])[:5])
    return figures


def plan(args, names: list[str]) -> list[Case]:
    """Every eager case, section by section, then the compiled ones in priority order."""
    gemm_names = [BASELINE, *GEMMS]

    def runs_in(section: str, variant: str) -> bool:  # "-pays" chooses layers of a Llama only
        return section in LLAMA_SECTIONS or not variant.endswith("-pays")

    cases = [] if args.compiled_only else [
        Case(s, i, v, False) for s in args.sections for i in range(len(args.shapes[s]))
        for v in (gemm_names if s == "gemm" else names) if runs_in(s, v)]
    if args.no_compile:
        return cases
    if args.compile_variants:
        wanted = names if args.compile_variants == ["all"] else [BASELINE, *args.compile_variants]
        priority = [(s, tuple(v for v in names if v in wanted and runs_in(s, v))) for s in args.sections
                    if s != "gemm"]
        return cases + [Case(s, i, v, True) for s, vs in priority for i in range(len(args.shapes[s])) for v in vs]
    priority = COMPILED_SMOKE if args.smoke else COMPILED_PRIORITY
    return cases + [Case(s, 0, v, True) for s, vs in priority if s in args.sections for v in vs if v in names]


def run(cases: list[Case], args, variants: dict[str, Variant], save: Callable[[list[dict]], None]) -> list[dict]:
    """Every case in turn; `save(rows)` after each, so a run stopped early (a time limit, a crash) keeps its rows."""
    references, rows, longest = {}, [], {}
    for case in cases:
        elapsed = time.perf_counter() - args.start
        # a compiled run's time as measured in this section (compile included), else the static guess: the guess
        # alone starved the second compiled variant of a short call (100m under CUDA graphs: bf16 only)
        guess = longest.get(case.section, COMPILE_GUESS_S.get(case.section, 0))
        if case.compiled and elapsed + guess > args.budget_s:
            rows.append({"section": case.section, "shape": shape_name(args.shapes[case.section][case.shape_index]),
                         "variant": case.variant, "mode": case.mode,
                         "skipped": f"time budget: {elapsed:.0f} s spent, a compiled run here takes ~{guess:.0f} s, "
                                    f"--budget-s {args.budget_s:g}"})
            continue
        row = run_case(case, args.shapes, variants, references, args)
        if case.compiled:
            longest[case.section] = max(longest.get(case.section, 0), row["wall_s"])
        rows.append(row)
        what = row.get("error") or f"{row['step_ms']:9.2f} ms  SQNR {_db(row)}"
        step_time.progress.print(f"{elapsed:6.0f} s  {case.section:<8} {row['shape']:<28.28} {case.variant:<19} "
                                 f"{case.mode:<8} {what}  ({row['wall_s']:.1f} s)")
        save(rows)
    add_speedups(rows)
    return rows


def add_speedups(rows: list[dict]) -> None:
    """Speedup over bf16 in the same mode and over bf16 eager, and peak memory over bf16's (same mode)."""
    base = {(r["section"], r["shape"], r["mode"]): r for r in rows if r["variant"] == BASELINE and "step_ms" in r}
    for r in rows:
        same, eager = base.get((r["section"], r["shape"], r["mode"])), base.get((r["section"], r["shape"], "eager"))
        if "step_ms" not in r:
            continue
        r["speedup_vs_bf16"] = same["step_ms"] / r["step_ms"] if same else None
        r["speedup_vs_bf16_eager"] = eager["step_ms"] / r["step_ms"] if eager else None
        r["peak_vs_bf16"] = r["peak_gib"] / same["peak_gib"] if same and r["peak_gib"] else None


# ----------------------------------------------------------------------------------------------------------- reports

def describe_machine(device: torch.device) -> dict:
    """machine.describe() plus the GPU, its driver, CUDA, Triton, torchao and minifloat."""
    info = machine.describe()
    float8, _ = torchao_float8()
    info.update(device=str(device), cuda=torch.version.cuda, minifloat=mf.__version__,
                torchao=None if float8 is None else sys.modules["torchao"].__version__, triton=_version("triton"),
                cuda_fp32_matmul=getattr(torch.backends.cuda.matmul, "fp32_precision", None))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}", gpu_memory_gib=props.total_memory / GIB,
                    driver=_nvidia_smi_driver(device.index or 0))
    return info


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def _nvidia_smi_driver(index: int) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[index].split(",")[-1].strip() if index < len(out) else None


def machine_line(info: dict) -> str:
    gpu = (f"{info['gpu']} (SM {info['capability']}), driver {info['driver']}, CUDA {info['cuda']}, "
           f"Triton {info['triton']}, " if "gpu" in info else f"{info['cpu']} ({info['cores']} cores), ")
    return gpu + f"torch {info['torch']}, torchao {info['torchao'] or 'not installed'}"


def _db(r: dict) -> str:
    if r.get("reference"):
        return "ref"
    return "=" if r.get("bitwise_equal_to_bf16") else "-" if r.get("sqnr_db") is None else f"{r['sqnr_db']:.1f}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


COLUMNS = ("shape", "variant", "mode", "FP8 linears", "step ms", "host ms", "tokens/s", "TFLOP/s (MFU)",
           "speedup × bf16", "peak GiB", "SQNR dB vs bf16")


def cells(r: dict) -> list[str]:
    head = [r["shape"], r["variant"], r["mode"]]
    if "step_ms" not in r:
        return head + ["", f"{'skipped' if 'skipped' in r else 'failed'}: {r.get('skipped') or r['error']}"] + [""] * 6
    breaks = f" ({r['graph_breaks']} breaks)" if r.get("graph_breaks") else ""
    return head + [_num(r["fp8_linears"], "d"), f"{r['step_ms']:.2f}", _num(r.get("host_ms"), ".2f"),
                   f"{r['tokens_per_s']:,.0f}",
                   f"{r['tflops']:.1f}" + ("" if r.get("mfu") is None else f" ({r['mfu']:.0%})"),
                   _num(r["speedup_vs_bf16"], ".2f") + breaks, _num(r["peak_gib"], ".2f"),
                   _db(r)]


def print_tables(rows: list[dict], skipped: dict[str, str], info: dict) -> None:
    for section in dict.fromkeys(r["section"] for r in rows):
        table = Table(title=f"{section}: step time, speedup over bf16 in the same mode", caption=machine_line(info))
        for col in COLUMNS:
            table.add_column(col, justify="left" if col in COLUMNS[:3] else "right")
        for r in rows:
            if r["section"] == section:
                table.add_row(*cells(r))
        step_time.stdout.print(table)
        step_time.stdout.print(f"[dim]{section}: {NOTES[section]}[/dim]")
    for name, why in skipped.items():
        step_time.stdout.print(f"[yellow]skipped {name}: {why}[/yellow]")


def markdown(rows: list[dict], skipped: dict[str, str], info: dict) -> str:
    lines = [f"Machine: {machine_line(info)}.", ""]
    for section in dict.fromkeys(r["section"] for r in rows):
        lines += [f"**{section}**", "", "| " + " | ".join(COLUMNS) + " |",
                  "|---|---|---|" + "---:|" * (len(COLUMNS) - 3)]
        lines += ["| " + " | ".join(cells(r)) + " |" for r in rows if r["section"] == section]
        lines += ["", NOTES[section], ""]
    lines += [f"Skipped {name}: {why}" for name, why in skipped.items()]
    return "\n".join(lines + ["", "Command:", "", "```", step_time.command_line(), "```"]) + "\n"


# -------------------------------------------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    p.add_argument("--variants", default="", help="comma list (default: all) for every section but gemm; bf16 is "
                                                  f"always added; of {', '.join(v.name for v in VARIANTS)}")
    p.add_argument("--compile-variants", default="", help="comma list (or 'all') compiled in every section and shape "
                                                          "instead of the default priority list")
    p.add_argument("--no-compile", action="store_true", help="eager runs only")
    p.add_argument("--compiled-only", action="store_true",
                   help="compiled runs only (their speedups are over bf16 compiled; for a call whose eager rows an "
                        "earlier call measured)")
    p.add_argument("--compile-mode", choices=("default", "reduce-overhead", "max-autotune"), default="default",
                   help="torch.compile's mode for the compiled runs; reduce-overhead replays CUDA graphs, which takes "
                        "the host out of small steps (the 100m section). Every compiled run of the call uses it")
    p.add_argument("--compile-scope", choices=("blocks", "model"), default="blocks",
                   help="blocks: compile each repeated block of the Llama and MLP sections in place, the rest eager "
                        "(minutes less compiling); model: torch.compile of the whole model")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="eager runs of the mlp and Llama sections (bf16 too) capture forward and backward in one CUDA "
                        "graph and replay it, the optimizer eager between replays: the host's work per layer out of "
                        "small steps without torch.compile (CUDA only; compiled runs are --compile-mode's)")
    p.add_argument("--budget-s", type=float, default=420.0, help="compiled runs that would end after this many "
                                                                  "seconds of the run are skipped")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 10, smoke 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3, smoke 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda when torch sees one")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, runs anywhere in seconds (checks the script)")
    p.add_argument("--tf32", choices=("on", "off"), default="on",
                   help="the fp32 matmuls (the Llama's fp32 head) on TF32 tensor cores, as the trainer runs them "
                        "(its --tf32, on by default), or off: IEEE float32 products")
    p.add_argument("--json", default="runs/gpu_bench.json", metavar="PATH")
    p.add_argument("--markdown", metavar="PATH", help="also write the tables as markdown")
    p.add_argument("--profile", metavar="PATH", help="also profile 2 steps of every run with torch.profiler and "
                   "write each run's op table (top 25 by GPU time) to PATH, a text file; the JSON gets kernels and "
                   "GPU busy time per step")
    p.add_argument("--overwrite", action="store_true", help="replace existing --json / --markdown / --profile files")
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    if not args.sections:
        p.error(f"--sections names none; choose from {list(SECTIONS)}")
    args.compile_variants = [v.strip() for v in args.compile_variants.split(",") if v.strip()]
    if args.no_compile and (args.compile_variants or args.compiled_only):
        p.error("--no-compile runs nothing compiled: leave out --compile-variants / --compiled-only, or --no-compile")
    args.steps = (3 if args.smoke else 10) if args.steps is None else args.steps
    args.warmup = (2 if args.smoke else 3) if args.warmup is None else args.warmup
    if args.steps < 1 or args.warmup < 1:
        p.error(f"--steps and --warmup must be >= 1, got {args.steps} and {args.warmup}")
    args.shapes = SMOKE if args.smoke else FULL
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.start = time.perf_counter()
    COMPILE_MODE.update(mode=args.compile_mode, scope=args.compile_scope)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.cuda_graphs and args.device.type != "cuda":
        print(f"--cuda-graphs needs a CUDA device (this run's is {args.device}); leave it out on a CPU",
              file=sys.stderr)
        return 2
    GRAPHS["on"] = args.cuda_graphs
    on_gpu = args.device.type == "cuda" and torch.cuda.is_available()
    if (args.device.type == "cuda" or not args.smoke) and not on_gpu:
        print(f"benchmarks/gpu.py needs a CUDA GPU (device {args.device}, torch "
              f"{torch.__version__} sees {torch.cuda.device_count()} GPUs); --smoke --device cpu runs its tiny shapes on the CPU",
              file=sys.stderr)
        return 2
    for path in filter(None, (args.json, args.markdown, args.profile)):
        if pathlib.Path(path).exists() and not args.overwrite:
            print(f"{path} exists; pass --overwrite to replace it, or another path", file=sys.stderr)
            return 2
    if args.smoke and args.device.type == "cpu":
        torch.set_num_threads(1)  # tiny shapes gain nothing from threads, which wait on each other on a busy machine
    fp32_matmuls = cuda_fp32_matmuls("tf32" if args.tf32 == "on" else "ieee")
    fp32_matmuls.__enter__()  # for the whole process, as the trainer's steps run
    names = [v.name for v in VARIANTS]
    wanted = [n.strip() for n in args.variants.split(",") if n.strip()]
    wanted = names if wanted in ([], ["all"]) else wanted
    unknown = [n for n in wanted + args.compile_variants if n not in names + ["all"]]
    if unknown:
        print(f"unknown variant(s) {unknown}; choose from {names} (or all)", file=sys.stderr)
        return 2
    if "all" in args.compile_variants and args.compile_variants != ["all"]:
        print("--compile-variants: 'all' stands alone", file=sys.stderr)
        return 2
    outside = [n for n in args.compile_variants if n not in wanted + [BASELINE, "all"]]
    if outside:
        print(f"--compile-variants {outside} not in --variants {wanted}: a variant is compiled only where it runs; "
              f"add it to --variants", file=sys.stderr)
        return 2
    float8, why_not = torchao_float8()
    skipped = {} if float8 is not None else {n: f"torchao is not importable ({why_not})" for n in wanted
                                             if n.startswith("torchao")}
    names = [n for n in names if (n in wanted or n == BASELINE) and n not in skipped]

    info = describe_machine(args.device)
    step_time.progress.print(f"{machine_line(info)}\nsections {', '.join(args.sections)}; variants {', '.join(names)}")
    config = {k: v for k, v in vars(args).items() if k not in ("start", "device")}
    json_path = pathlib.Path(args.json)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    if args.profile:
        pathlib.Path(args.profile).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.profile).write_text(f"benchmarks/gpu.py profiles: {machine_line(info)}\n")

    def save(rows: list[dict], complete: bool = False) -> None:
        """The JSON with the rows so far ("complete": false until the last), replaced in one rename."""
        rows = [dict(r) for r in rows]
        add_speedups(rows)
        result = {"command": step_time.command_line(), "config": config, "machine": info, "notes": NOTES,
                  "skipped": skipped, "complete": complete, "tilings": triton_tiles.picked(),
                  "sections": {s: [r for r in rows if r["section"] == s] for s in args.sections},
                  "wall_s": time.perf_counter() - args.start}
        tmp = json_path.with_name(f".{json_path.name}.tmp")
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(json_path)

    rows = run(plan(args, names), args, {v.name: v for v in VARIANTS}, save)
    save(rows, complete=True)
    if args.markdown:
        pathlib.Path(args.markdown).write_text(markdown(rows, skipped, info))
    print_tables(rows, skipped, info)
    step_time.progress.print(f"{time.perf_counter() - args.start:.0f} s; wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
