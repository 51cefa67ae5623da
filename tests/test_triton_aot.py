"""minifloat's Triton kernels compile for an H100 (SM 9.0) on a machine without a GPU, and hold their values in
registers.

Triton's interpreter (tests/test_triton_cast.py, tests/test_triton_blocks.py) checks what the kernels compute, not
that the GPU compiler accepts them: an op the interpreter runs but Triton cannot lower would only show on a GPU, where
the self-check then turns the kernels off with a warning. Here each kernel variant the library launches is compiled
ahead of time for SM 9.0 (`triton.compile` with a GPUTarget; the Triton wheel ships ptxas), and ptxas' resource report
is read: a kernel that spills registers to local memory would be slow on every GPU. These compile the real kernels
(not the interpreter), a few seconds each, so they run in the slow tier.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton", reason="needs `pip install triton` (in the dev extras)")

from minifloat.numerics import triton_tiles  # noqa: E402 - the tilings the autotuner may pick, each compiled

pytestmark = pytest.mark.slow

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # an older or newer Triton without these names
    GPUTarget = ASTSource = None


# Compiled in a fresh process: a test run may already have built the kernels in Triton's interpreter
# (TRITON_INTERPRET=1 is read when they are built, and they are built once per process).
_COMPILE_ALL = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minifloat.numerics import triton_blocks, triton_cast

folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ptxas = next(p for p in (os.path.join(folder, n) for n in ("ptxas-blackwell", "ptxas")) if os.path.exists(p))
fp8 = dict(FMT_MAX=448.0, EMIN=-6, MBITS=3, MARGIN=0, POW2=True)

def report(fn, signature, constants, num_warps):
    signature = dict(signature, **{name: "constexpr" for name in constants})
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    text = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True,
                          text=True, check=True).stderr
    os.unlink(f.name)
    return {"cubin_bytes": len(compiled.asm.get("cubin", b"")),
            "registers": int(re.search(r"Used (\d+) registers", text).group(1)),
            "spill_bytes": sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", text))}

out = {}
blocks = {"x_ptr": "*bf16", "lut_ptr": "*fp32", "xs_ptr": "*fp32", "out_ptr": "*u8", "out_t_ptr": "*u8",
          "ds_ptr": "*fp32", "ds_t_ptr": "*fp32", "am_ptr": "*fp32", "am_t_ptr": "*fp32", "tamax_ptr": "*i32",
          "slot_ptr": "*fp32", "counter_ptr": "*i64", "scratch_ptr": "*i32", "M": "i32", "K": "i32",
          "stride_xm": "i32", "stride_xk": "i32", "N_KB": "i32", "N_MB": "i32"}
modes = {"rows": dict(ROWS=True), "both-axes": dict(ROWS=True, COLS=True),
         "from-fp8": dict(COLS=True, FROM_FP8=True, FOLD_BF16=True), "block": dict(ROWS=True, BLOCK=True, WRITE_T=True),
         "rows-recording": dict(ROWS=True, RECORD=True), "both-axes-recording": dict(ROWS=True, COLS=True, RECORD=True),
         "block-recording": dict(ROWS=True, BLOCK=True, WRITE_T=True, RECORD=True)}
for name, mode in modes.items():
    constants = dict(FROM_FP8=False, FOLD_BF16=False, ROWS=False, COLS=False, BLOCK=False, WRITE_T=False,
                     RECORD=False, T=triton_blocks.TILE, SUB=triton_blocks.SUB, **fp8)
    constants.update(mode)
    signature = dict(blocks, x_ptr="*u8" if mode.get("FROM_FP8") else "*bf16")
    out["blocks-" + name] = report(triton_blocks._kernel(), signature, constants, triton_blocks.NUM_WARPS)
record = {"slot_ptr": "*fp32", "counter_ptr": "*i64", "scratch_ptr": "*i32"}
cast = {"x_ptr": "*bf16", "q_ptr": "*fp32", "out_ptr": "*u8", "out_t_ptr": "*u8", "amax_ptr": "*i32",
        "dscale_ptr": "*fp32", **record, "M": "i32", "K": "i32", "stride_xm": "i32", "stride_xk": "i32"}
from minifloat.numerics import triton_tiles

def tiled(name, fn, signature, constants, candidates):  # every tiling the autotuner may pick, the first unnamed
    for i, (bm, bk, warps) in enumerate(candidates):
        out[name + ("" if i == 0 else f"@{bm}x{bk}w{warps}")] = report(fn, signature,
                                                                        dict(constants, BLOCK_M=bm, BLOCK_K=bk), warps)

for name, from_amax, recording in (("given-scale", False, False), ("from-amax", True, False),
                                   ("given-scale-recording", False, True)):
    constants = dict(ALONG=1 if from_amax else 0, WRITE=True, WRITE_T=True, AMAX=not from_amax,
                     FROM_AMAX=from_amax, RECORD=recording, **fp8)
    tiled("cast-" + name, triton_cast._kernel(), cast, constants, triton_tiles.CAST_TILES)
amax = {"x_ptr": "*bf16", "amax_ptr": "*i32", **record, "M": "i32", "K": "i32", "stride_xm": "i32",
        "stride_xk": "i32"}
for name, recording in (("amax", False), ("amax-recording", True)):
    tiled("cast-" + name, triton_cast._amax_kernel(), amax, dict(RECORD=recording), triton_tiles.AMAX_TILES)
from minifloat.numerics import triton_rows
amax_kernel, cast_kernel = triton_rows._kernels()
for name, from_fp8, cols, recording in (("both-axes", False, True, False), ("from-fp8", True, True, False),
                                        ("rows-recording", False, False, True)):
    x = "*u8" if from_fp8 else "*bf16"
    common = {"x_ptr": x, "lut_ptr": "*fp32", "xs_ptr": "*fp32", "row_ptr": "*i32", "col_ptr": "*i32"}
    shape = {"M": "i32", "K": "i32", "stride_xm": "i32", "stride_xk": "i32"}
    flags = dict(FROM_FP8=from_fp8, ROWS=not from_fp8, COLS=cols)
    amax_args = dict(common, tamax_ptr="*i32", **record, **shape)
    tiled("rows-amax-" + name, amax_kernel, amax_args, dict(flags, RECORD=recording), triton_tiles.CAST_TILES)
    outputs = {"out_ptr": "*u8", "out_t_ptr": "*u8", "ds_ptr": "*fp32", "ds_t_ptr": "*fp32"}
    tiled("rows-cast-" + name, cast_kernel, dict(common, **outputs, **shape), dict(flags, **fp8),
          triton_tiles.CAST_TILES)
print(json.dumps(out))
"""

def _tilings(names: list[str], candidates) -> list[str]:
    return [name + ("" if i == 0 else f"@{bm}x{bk}w{warps}") for name in names
            for i, (bm, bk, warps) in enumerate(candidates)]


KERNELS = (["blocks-rows", "blocks-both-axes", "blocks-from-fp8", "blocks-block", "blocks-rows-recording",
            "blocks-both-axes-recording", "blocks-block-recording"]
           + _tilings(["cast-given-scale", "cast-from-amax", "cast-given-scale-recording"], triton_tiles.CAST_TILES)
           + _tilings(["cast-amax", "cast-amax-recording"], triton_tiles.AMAX_TILES)
           + _tilings(["rows-amax-both-axes", "rows-cast-both-axes", "rows-amax-from-fp8", "rows-cast-from-fp8",
                       "rows-amax-rows-recording", "rows-cast-rows-recording"], triton_tiles.CAST_TILES))


@pytest.fixture(scope="module")
def reports():
    if GPUTarget is None:
        pytest.skip("this Triton has no ahead-of-time compile API (triton.compiler.ASTSource, GPUTarget)")
    folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not any(os.path.exists(os.path.join(folder, n)) for n in ("ptxas-blackwell", "ptxas")):
        pytest.skip("this Triton wheel ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_ALL], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_compiles_for_an_h100_without_spills(reports, kernel):
    report = reports[kernel]
    assert report["cubin_bytes"] > 0, report
    assert report["spill_bytes"] == 0, report
    # at least two programs of 8 warps per SM (65,536 registers): a bound the kernels stay well within
    assert report["registers"] <= 128, report
