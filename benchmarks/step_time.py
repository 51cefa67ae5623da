"""Training-step time and activation memory of FP8 linear layers against bfloat16 autocast, in one process.

The model is a stack of MLP blocks, Linear(d, h) -> GELU -> Linear(h, d) (3 blocks = 6 linear layers by default,
d=1024, h=4096), trained on a (tokens, d) = (2048, 1024) input against a random target with MSE loss. One step is
forward + loss, backward, AdamW step, zero_grad. Variants:

    fp32                        plain fp32
    bf16-autocast               fp32 parameters, torch.autocast("cpu", bfloat16) around forward and loss (baseline)
    minifloat-<recipe>          mf.convert(model, recipe=..., keep_first_last=False): all linears FP8, the rest as
                                bf16-autocast; recipes delayed, current, current-row, block, mx
    torchao-float8-tensorwise   torchao.float8.convert_to_float8_training(model) (default config: dynamic tensorwise
                                scaling), the rest as bf16-autocast; eager, as users run it without torch.compile
    torchao-float8-tensorwise-compiled  the same under torch.compile (only with --torchao-compile)
    <variant>-compiled          with --compile: bf16-autocast and every minifloat variant again, the model wrapped
                                in torch.compile (inductor, default mode); their saved bytes are not probed (saved-
                                tensor hooks do not reach into compiled graphs)

The input requires grad, as the activations entering a block in the middle of a network do, so every variant runs
all three GEMMs (fprop, dgrad, wgrad) of every layer.

Measured, per variant:
  * step time: after warm-up steps (the first minifloat steps compile its kernels), the median of --steps timed steps
    per round over --rounds rounds; variants are interleaved, in reversed order on odd rounds, so that slow drift of
    the machine hits all of them alike. Reported with its ratio to bf16-autocast measured in the same run.
  * bytes saved for backward during one forward of the model (loss excluded): the tensors autograd saves
    (saved_tensors_hooks), counted once per (storage, offset, size), without the parameters and views of them (they
    exist anyway). The input counts: it stands for the previous layer's activation.
  * peak RSS delta over one step (approximate: sampled every millisecond from /proc, after malloc_trim).

Usage:
    python benchmarks/step_time.py                                  # full config, a few minutes on 2 cores
    python benchmarks/step_time.py --tokens 256 --dim 256 --hidden 512 --steps 2 --rounds 1   # smoke run
    python benchmarks/step_time.py --json results.json --markdown results.md --variants bf16-autocast,minifloat-mx

torchao is optional (`pip install --no-deps torchao`, never letting pip replace torch); without it the torchao
variants are skipped with a message. On a CPU, torch._scaled_mm (torchao's FP8 GEMM) is a reference kernel running at
well under 1 GFLOP/s, so the script probes it first and skips torchao when a step would exceed --torchao-max-step-s
(the default config would take over an hour a step); small configs still run it. torchao's Float8Linear casts its
input only under CUDA autocast, so under CPU autocast the first layer keeps (and saves) its fp32 input.

No numbers here are asserted anywhere: this is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import json
import logging
import os
import pathlib
import platform
import shlex
import statistics
import sys
import threading
import time
from typing import Callable

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import minifloat as mf

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import machine  # noqa: E402 - benchmarks/machine.py

BASELINE = "bf16-autocast"
MIB = 2**20
RSS_SAMPLE_S = 0.001
ENV_OF_NOTE = ("PYTHONPATH", "OMP_NUM_THREADS", "MINIFLOAT_COMPILE", "MINIFLOAT_GEMM_BACKEND")

stdout = Console(width=None if sys.stdout.isatty() else 200)  # no 80-column wrap when redirected
progress = Console(stderr=True, width=None if sys.stderr.isatty() else 200)


# ----------------------------------------------------------------------------------------------------------- variants

@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    prepare: Callable[[nn.Module], nn.Module]  # converts the fp32 model in place (or wraps it) for this variant
    autocast: bool  # torch.autocast("cpu", bfloat16) around forward and loss
    note: str = ""
    compiled: bool = False  # the model runs under torch.compile


def _compiled(variant: Variant) -> Variant:
    prepare = variant.prepare
    return Variant(f"{variant.name}-compiled", lambda m: torch.compile(prepare(m)), variant.autocast,
                   note="torch.compile", compiled=True)


def _minifloat(recipe) -> Callable[[nn.Module], nn.Module]:
    return lambda model: mf.convert(model, recipe=recipe, keep_first_last=False)


def _import_torchao_float8():
    """torchao.float8.convert_to_float8_training, or None and the reason it cannot be used."""
    # torchao's CUDA-only extensions fail to load on CPU builds and it logs each one; they are not used here
    logging.getLogger("torchao").setLevel(logging.ERROR)
    try:
        from torchao.float8 import convert_to_float8_training
    except (ImportError, AttributeError, RuntimeError, OSError) as exc:
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return convert_to_float8_training, None


def scaled_mm_gflops(m: int = 128, k: int = 256, n: int = 256) -> float:
    """Throughput of torch._scaled_mm (E4M3 x E4M3 -> bfloat16) on the CPU, the GEMM torchao.float8 runs."""
    one = torch.ones(())
    a = torch.randn(m, k).to(torch.float8_e4m3fn)  # (M, K)
    b = torch.randn(n, k).to(torch.float8_e4m3fn).t()  # (K, N), column-major as _scaled_mm wants
    torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
    t0 = time.perf_counter()
    torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
    return 2 * m * k * n / (time.perf_counter() - t0) / 1e9


def gemm_gflop_per_step(args: argparse.Namespace) -> float:
    # 2 linears per block, 3 GEMMs each (fprop, dgrad, wgrad) of 2*T*D*H flops
    return 2 * args.blocks * 3 * 2 * args.tokens * args.dim * args.hidden / 1e9


def all_variants(args: argparse.Namespace) -> tuple[list[Variant], dict[str, str]]:
    """Every variant this machine can run in reasonable time, and the reasons for the ones it cannot."""
    variants = [
        Variant("fp32", lambda m: m, autocast=False),
        Variant(BASELINE, lambda m: m, autocast=True),
        Variant("minifloat-delayed", _minifloat(mf.DelayedScaling()), autocast=True),
        Variant("minifloat-current", _minifloat(mf.CurrentScaling()), autocast=True),
        Variant("minifloat-current-row", _minifloat(mf.CurrentScaling(granularity="row")), autocast=True),
        Variant("minifloat-block", _minifloat(mf.BlockScaling()), autocast=True),
        Variant("minifloat-mx", _minifloat(mf.MXScaling()), autocast=True),
    ]
    if args.compile:
        variants += [_compiled(v) for v in variants if v.name == BASELINE or v.name.startswith("minifloat-")]
    names = ["torchao-float8-tensorwise"] + (["torchao-float8-tensorwise-compiled"] if args.torchao_compile else [])
    to_float8, why_not = _import_torchao_float8()
    if to_float8 is None:
        return variants, {name: f"torchao is not importable ({why_not})" for name in names}
    # On CPU, torch._scaled_mm is a reference kernel (no FP8 GEMM hardware): estimate a step before committing to it
    gflops = scaled_mm_gflops()
    estimate_s = gemm_gflop_per_step(args) / gflops
    if estimate_s > args.torchao_max_step_s:
        why = (f"torch._scaled_mm, which torchao.float8 calls for its FP8 GEMMs, runs at {gflops:.3f} GFLOP/s on this "
               f"CPU (a reference kernel), so one step ({gemm_gflop_per_step(args):.0f} GFLOP of FP8 GEMMs) would take "
               f"~{estimate_s:.0f} s > --torchao-max-step-s {args.torchao_max_step_s:g}; raise that limit to run it "
               f"anyway, or shrink --tokens/--dim/--hidden")
        return variants, {name: why for name in names}
    variants.append(Variant(names[0], to_float8, autocast=True, note="eager, no torch.compile"))
    if args.torchao_compile:
        variants.append(Variant(names[1], lambda m: torch.compile(to_float8(m)), autocast=True,
                                note="torch.compile; the other variants are eager"))
    return variants, {}


# -------------------------------------------------------------------------------------------------------------- model

def mlp_stack(dim: int, hidden: int, blocks: int) -> nn.Sequential:
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)]
    return nn.Sequential(*layers)


def count_fp8_linears(model: nn.Module) -> int:
    """Linear layers that are no longer plain nn.Linear / run FP8 GEMMs (minifloat's or torchao's)."""
    return sum(type(m).__name__ in ("Fp8Linear", "Float8Linear") for m in model.modules())


@dataclasses.dataclass
class Trainer:
    variant: Variant
    model: nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor  # (T, D), requires grad
    target: torch.Tensor  # (T, D)
    fp8_linears: int

    @classmethod
    def build(cls, variant: Variant, args: argparse.Namespace) -> "Trainer":
        torch.manual_seed(args.seed)  # same weights and data for every variant
        model = mlp_stack(args.dim, args.hidden, args.blocks)
        x = torch.randn(args.tokens, args.dim, requires_grad=True)
        target = torch.randn(args.tokens, args.dim)
        model = variant.prepare(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return cls(variant, model, opt, x, target, count_fp8_linears(model))

    def step(self, forward_hooks: contextlib.AbstractContextManager | None = None) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.variant.autocast):
            with forward_hooks or contextlib.nullcontext():  # the model's saved tensors, not the loss's
                y = self.model(self.x)  # (T, D)
            loss = F.mse_loss(y.float(), self.target)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.x.grad = None


# -------------------------------------------------------------------------------------------------- memory probes

def _plain_tensors(t: torch.Tensor):
    """`t`, or the tensors inside a wrapper subclass (such as torchao's Float8TrainingTensor)."""
    if is_traceable_wrapper_subclass(t):
        for attr in t.__tensor_flatten__()[0]:
            yield from _plain_tensors(getattr(t, attr))
    else:
        yield t


class SavedTensorCounter:
    """Bytes autograd saves for backward, each (storage, offset, size) once, parameters and their views excluded."""

    def __init__(self, params):
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.seen: set[tuple[int, int, int]] = set()
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        for p in _plain_tensors(t):
            if isinstance(p, nn.Parameter) or p.untyped_storage().data_ptr() in self.param_storages:
                continue
            nbytes = p.numel() * p.element_size()
            key = (p.untyped_storage().data_ptr(), p.storage_offset(), nbytes)
            if key not in self.seen:
                self.seen.add(key)
                self.bytes += nbytes
        return t

    def hooks(self) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _malloc_trim() -> None:
    """Give freed heap memory back to the OS (glibc), so that RSS before a step is close to live memory."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@contextlib.contextmanager
def peak_rss_delta(result: dict):
    """Sample RSS every millisecond in a thread; result["bytes"] = peak - RSS at entry (None without /proc)."""
    if not os.path.exists("/proc/self/statm"):
        result["bytes"] = None
        yield
        return
    gc.collect()
    _malloc_trim()
    start = peak = _rss_bytes()
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss_bytes())
            time.sleep(RSS_SAMPLE_S)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        result["bytes"] = max(peak, _rss_bytes()) - start


# ---------------------------------------------------------------------------------------------------------- running

@dataclasses.dataclass
class Result:
    variant: str
    note: str
    fp8_linears: int
    saved_bytes: int | None = None  # None: not probed (compiled variants)
    peak_rss_delta_bytes: int | None = None
    step_s: list[list[float]] = dataclasses.field(default_factory=list)  # one list of step times per round

    @property
    def median_ms(self) -> float:
        return 1e3 * statistics.median(t for rnd in self.step_s for t in rnd)

    @property
    def min_ms(self) -> float:
        return 1e3 * min(t for rnd in self.step_s for t in rnd)


def run(variants: list[Variant], args: argparse.Namespace) -> list[Result]:
    trainers = {v.name: Trainer.build(v, args) for v in variants}
    results = {v.name: Result(v.name, v.note, trainers[v.name].fp8_linears) for v in variants}
    for rnd in range(args.rounds):
        order = variants if rnd % 2 == 0 else variants[::-1]
        for v in order:
            trainer, result = trainers[v.name], results[v.name]
            warmup = args.warmup if rnd == 0 else 1  # later rounds only re-warm caches
            for _ in range(warmup - (rnd == 0)):
                trainer.step()
            if rnd == 0 and v.compiled:
                trainer.step()
            elif rnd == 0:  # last warm-up step: count saved tensors and peak RSS (untimed)
                counter = SavedTensorCounter(trainer.model.parameters())
                rss: dict = {}
                with peak_rss_delta(rss):
                    trainer.step(forward_hooks=counter.hooks())
                result.saved_bytes, result.peak_rss_delta_bytes = counter.bytes, rss["bytes"]
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                trainer.step()
                times.append(time.perf_counter() - t0)
            result.step_s.append(times)
            progress.print(f"round {rnd + 1}/{args.rounds}  {v.name:<36} median "
                           f"{1e3 * statistics.median(times):9.1f} ms")
    return [results[v.name] for v in variants]


# ---------------------------------------------------------------------------------------------------------- reports

def machine_info() -> dict:
    cpu_model, flags = "", set()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not cpu_model:
                    cpu_model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    _, torchao_why_not = _import_torchao_float8()
    return {
        "processor": platform.processor(),
        "cpu_model": cpu_model,
        "cpu_flags_of_note": sorted(flags & {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "minifloat": mf.__version__,
        "torchao": _torchao_version() if torchao_why_not is None else None,
    }


def _torchao_version() -> str:
    import torchao
    return torchao.__version__


def command_line() -> str:
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in ENV_OF_NOTE if k in os.environ]
    return " ".join(env + ["python", shlex.join(sys.argv)])


def rows(results: list[Result]) -> list[dict]:
    base = next(r for r in results if r.variant == BASELINE)
    return [{
        "variant": r.variant,
        "note": r.note,
        "fp8_linears": r.fp8_linears,
        "step_ms_median": r.median_ms,
        "step_ms_min": r.min_ms,
        "step_ms_round_medians": [1e3 * statistics.median(rnd) for rnd in r.step_s],
        "step_ms_all": [1e3 * t for rnd in r.step_s for t in rnd],
        "step_ratio_to_bf16_autocast": r.median_ms / base.median_ms,
        "saved_bytes": r.saved_bytes,
        "saved_mib": None if r.saved_bytes is None else r.saved_bytes / MIB,
        "saved_ratio_to_bf16_autocast": (r.saved_bytes / base.saved_bytes
                                         if r.saved_bytes is not None and base.saved_bytes else None),
        "peak_rss_delta_mib": None if r.peak_rss_delta_bytes is None else r.peak_rss_delta_bytes / MIB,
    } for r in results]


def config_line(args: argparse.Namespace) -> str:
    return (f"{args.blocks} MLP blocks ({2 * args.blocks} linears) d={args.dim} hidden={args.hidden}, "
            f"tokens={args.tokens}; {args.warmup} warm-up + {args.steps} timed steps × {args.rounds} round(s); "
            f"AdamW; {torch.get_num_threads()} torch threads")


def print_table(table_rows: list[dict], skipped: dict[str, str], args: argparse.Namespace, info: dict) -> None:
    table = Table(title=f"Training step, {config_line(args)}",
                  caption=f"{info['cpu_model']} ({', '.join(info['cpu_flags_of_note']) or 'no bf16 extensions'}), "
                          f"torch {info['torch']}")
    for col in ("variant", "FP8 linears", "step ms (median)", "step ms (min)", f"× {BASELINE}",
                "saved MiB", f"× {BASELINE} saved", "peak RSS delta MiB (approx.)"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in table_rows:
        rss = r["peak_rss_delta_mib"]
        table.add_row(r["variant"] + (f" ({r['note']})" if r["note"] else ""), str(r["fp8_linears"]),
                      f"{r['step_ms_median']:.1f}", f"{r['step_ms_min']:.1f}",
                      f"{r['step_ratio_to_bf16_autocast']:.2f}", _mib(r["saved_mib"]),
                      _ratio(r["saved_ratio_to_bf16_autocast"]), "-" if rss is None else f"{rss:.0f}")
    stdout.print(table)
    for name, why in skipped.items():
        stdout.print(f"[yellow]skipped {name}: {why}[/yellow]")


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown(table_rows: list[dict], skipped: dict[str, str], args: argparse.Namespace, info: dict) -> str:
    lines = [f"Training step, {config_line(args)}.", "",
             f"| variant | step ms | × {BASELINE} | saved MiB | × bf16 saved |", "|---|---:|---:|---:|---:|"]
    for r in table_rows:
        name = r["variant"] + (f" ({r['note']})" if r["note"] else "")
        lines.append(f"| {name} | {r['step_ms_median']:.1f} | {r['step_ratio_to_bf16_autocast']:.2f} | "
                     f"{_mib(r['saved_mib'])} | {_ratio(r['saved_ratio_to_bf16_autocast'])} |")
    lines.append("")
    lines += [f"Skipped {name}: {why}" for name, why in skipped.items()]
    lines += ["", "Command:", "", "```", command_line(), "```", "", "Machine:", ""]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds over all variants")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the first round (>= 3)")
    p.add_argument("--variants", default="", help="comma list (default: all); bf16-autocast is always added")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--blocks", type=int, default=3, help="MLP blocks (2 linears each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--compile", action="store_true",
                   help="add torch.compile'd twins of bf16-autocast and the minifloat variants")
    p.add_argument("--torchao-compile", action="store_true", help="add torchao-float8-tensorwise under torch.compile")
    p.add_argument("--torchao-max-step-s", type=float, default=60.0,
                   help="skip torchao when its estimated step time (from a torch._scaled_mm probe) exceeds this")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write a markdown table with the command and machine info")
    machine.add_overwrite(p)
    args = p.parse_args(argv)
    machine.keep_existing(p, args, "json", "markdown")
    for name in ("steps", "rounds", "tokens", "dim", "hidden", "blocks"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 3:
        p.error(f"--warmup must be >= 3 (the first minifloat steps compile kernels), got {args.warmup}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    variants, skipped = all_variants(args)
    if args.variants:
        wanted = [name.strip() for name in args.variants.split(",") if name.strip()]
        known = {v.name for v in variants} | set(skipped)
        unknown = [name for name in wanted if name not in known]
        if unknown:
            raise SystemExit(f"unknown variant(s) {unknown}; choose from {sorted(known)}")
        if BASELINE not in wanted:
            progress.print(f"adding {BASELINE}: ratios are taken against it")
            wanted.insert(0, BASELINE)
        variants = [v for v in variants if v.name in wanted]
        skipped = {name: why for name, why in skipped.items() if name in wanted}
    for name, why in skipped.items():
        progress.print(f"[yellow]skipping {name}: {why}[/yellow]")
    progress.print(f"{config_line(args)}\nvariants: {', '.join(v.name for v in variants)}")

    info = machine_info()
    table_rows = rows(run(variants, args))
    print_table(table_rows, skipped, args, info)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command_line(), "config": vars(args), "machine": info, "results": table_rows,
                       "skipped": skipped}, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(table_rows, skipped, args, info))


if __name__ == "__main__":
    main()
