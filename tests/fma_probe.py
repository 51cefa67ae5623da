"""The workload of tests/test_fma_contraction.py, run in a fresh process per floating-point contract setting.

    python tests/fma_probe.py OUT.pt [--wide]

Runs minifloat's compiled kernels on fixed inputs (quantize, quantize_t, NVFP4 with both roundings, Fp8Linear forward
and backward under several recipes, and `cast` inside a user's torch.compile) and saves every result by case name,
with what the test needs to tell that the kernels really ran compiled. The contract setting comes from the
environment (TORCHINDUCTOR_CPP_ENABLE_FLOATING_POINT_CONTRACT_FLAG), which inductor reads when it is imported.

The default run keeps one case per kind of cast; `--wide` adds E5M2, quantize_t at every granularity, compiled `cast`
and the remaining recipes (the slow test's sweep).
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch._dynamo.utils
import torch._inductor.config
from torch import nn

import minifloat as mf
from minifloat.numerics.compiling import EAGER_BELOW, compile_enabled
from minifloat.numerics.fp4 import quantize_nvfp4, quantize_nvfp4_t
from minifloat.numerics.granularity import GRANULARITIES
from minifloat.numerics.other_axis import quantize_t
from minifloat.numerics.quantize import quantize
from minifloat.numerics.rounding import counter_uniform

SEED = 20
ROWS, COLS = 512, 1024  # 524288 elements
TOKENS, D_IN, D_HIDDEN, D_OUT = 256, 512, 384, 256  # the smallest layer tensor, (256, 256), has 65536 elements
STEPS = 2
SR_SEED = 12345  # NVFP4 stochastic rounding's counter seed
# quantize_t's granularities in the default run: "tile" runs its own column-wise kernel (DeepSeek's 128×1 backward
# operands); the wide run has all five ("tensor" and "block" transpose quantize's result)
QUANTIZE_T_DEFAULT = ("tile",)

# (name, function, rounding, in the default run): NVFP4's cast of x and of xᵀ (blocks down the columns, its own SR
# draw indices)
NVFP4_CASES = [
    ("nvfp4", quantize_nvfp4, "nearest", True),
    ("nvfp4", quantize_nvfp4, "stochastic", True),
    ("nvfp4_t", quantize_nvfp4_t, "nearest", False),
    ("nvfp4_t", quantize_nvfp4_t, "stochastic", True),
]
# (name, recipe, in the default run). The default keeps a per-tensor recipe with delayed scales and MX (folded E8M0
# scales, the transposed re-quantization); NVFP4's layer (~40 s of compiling on one core) waits for the wide run,
# its casts are in NVFP4_CASES
RECIPES = [
    ("delayed", mf.DelayedScaling(), True),
    ("current", mf.CurrentScaling(), False),
    ("current-row", mf.CurrentScaling(granularity="row"), False),
    ("block", mf.BlockScaling(), False),
    ("block-no-pow2", mf.BlockScaling(power_of_two=False), False),
    ("mx", mf.MXScaling(), True),
    ("mxfp4", mf.MXScaling(format="e2m1"), False),
    ("nvfp4", mf.NVFP4Scaling(), False),
]


class _Warnings(logging.Handler):
    """Collects minifloat's warnings, among them maybe_compile's "compiling ... failed; running it eagerly"."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def veltkamp_canary(y: torch.Tensor) -> torch.Tensor:
    """y rounded to 4 significant bits by Veltkamp's split, the float trick of issue 20. Right only when c - y is
    rounded on its own; contracted into fma(y, K, -y) it is exact and c - (c - y) gives y back (nearly) unrounded."""
    c = y * float(2**20 + 1)
    return c - (c - y)


def quantize_cases(x: torch.Tensor, wide: bool) -> dict[str, torch.Tensor]:
    out = {}
    for fmt in (mf.E4M3, mf.E5M2) if wide else (mf.E4M3,):
        for g in GRANULARITIES:
            q = quantize(x, fmt, granularity=g, operand_dtype=torch.bfloat16)
            out |= {f"quantize/{fmt.name}/{g}/operand": q.operand, f"quantize/{fmt.name}/{g}/data": q.data,
                    f"quantize/{fmt.name}/{g}/scale": q.scale, f"quantize/{fmt.name}/{g}/amax": q.amax}
            if wide or g in QUANTIZE_T_DEFAULT:
                t = quantize_t(x, fmt, granularity=g, operand_dtype=torch.bfloat16)
                out |= {f"quantize_t/{fmt.name}/{g}/operand": t.operand, f"quantize_t/{fmt.name}/{g}/data": t.data,
                        f"quantize_t/{fmt.name}/{g}/scale": t.scale}
    q = quantize(x, mf.E2M1, granularity="mx", operand_dtype=torch.bfloat16)
    out |= {"quantize/e2m1/mx/operand": q.operand, "quantize/e2m1/mx/data": q.data}
    for name, fn, rounding, default in NVFP4_CASES:
        if default or wide:
            seed = torch.tensor(SR_SEED) if rounding == "stochastic" else None
            q = fn(x, rounding=rounding, seed=seed, operand_dtype=torch.bfloat16)
            out |= {f"{name}/{rounding}/data": q.data, f"{name}/{rounding}/scale": q.scale,
                    f"{name}/{rounding}/operand": q.operand, f"{name}/{rounding}/global_scale": q.global_scale}
    return out


def cast_cases(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """mf.cast, which minifloat runs eagerly, inside a user's torch.compile (a compiled model's own casts)."""
    cast = torch.compile(mf.cast, dynamic=False, fullgraph=True) if compile_enabled() else mf.cast
    out = {f"cast/{fmt.name}/nearest": cast(x, fmt) for fmt in (mf.E4M3, mf.E5M2, mf.E2M1)}
    u = counter_uniform(torch.tensor(SR_SEED), x.shape)
    out |= {f"cast/{fmt.name}/stochastic": cast(x, fmt, rounding="stochastic", uniform=u) for fmt in (mf.E4M3, mf.E2M1)}
    return out


def layer_cases(name: str, recipe, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Two training steps of a converted MLP: each step's output, input gradient and weight gradients.

    With biases: the emulated GEMM's epilogue, acc·scale + bias, rounds the scaled product before the add on every
    device (minifloat.fp8.gemm.scale_then_add), so contraction cannot turn it into one FMA.
    """
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.ReLU(), nn.Linear(D_HIDDEN, D_OUT))
    model = mf.convert(model, recipe=recipe, keep_first_last=False)
    out = {}
    for step in range(STEPS):
        x.grad = None
        model.zero_grad(set_to_none=True)
        with mf.autocast(backend="emulated"):
            y = model(x)  # (TOKENS, D_OUT)
        (y.float() ** 2).mean().backward()
        out[f"layer/{name}/step{step}/y"] = y
        out[f"layer/{name}/step{step}/grad/input"] = x.grad
        out |= {f"layer/{name}/step{step}/grad/{p}": t.grad for p, t in model.named_parameters()}
        mf.fp8_step(model)  # delayed scaling: step 1 casts with scales from step 0's amaxes
    return out


def collect(wide: bool) -> dict[str, torch.Tensor]:
    """Every case's results by name (detached, contiguous copies), the canary first."""
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(ROWS, COLS, generator=gen) * 3
    inputs = torch.randn(TOKENS, D_IN, generator=gen).requires_grad_()
    canary = veltkamp_canary if not compile_enabled() else torch.compile(veltkamp_canary, dynamic=False)
    results = {"canary/veltkamp": canary(x)}
    results |= quantize_cases(x, wide)
    if wide:
        results |= cast_cases(x)
    for name, recipe, default in RECIPES:
        if default or wide:
            results |= layer_cases(name, recipe, inputs)
    return {k: v.detach().contiguous().clone() for k, v in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--wide", action="store_true")
    args = parser.parse_args()
    if not compile_enabled():
        raise SystemExit("fma_probe: MINIFLOAT_COMPILE turns compiling off, and this probe is about compiled kernels")
    warnings = _Warnings()
    logging.getLogger("minifloat").addHandler(warnings)
    results = collect(args.wide)
    meta = {
        "contract": torch._inductor.config.cpp.enable_floating_point_contract_flag,
        "eager_below": EAGER_BELOW,
        # (scales, amaxes and bias gradients are small by nature; every tensor a kernel rounds is above the bar)
        "smallest": min(t.numel() for k, t in results.items() if not k.endswith(("scale", "amax", ".bias"))),
        "unique_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "warnings": warnings.messages,
    }
    torch.save({"results": results, "meta": meta}, args.out)


if __name__ == "__main__":
    main()
