"""minifloat's compiled kernels give the same bits whether or not the compiler contracts multiply-adds into FMAs.

Why (issue 20): rounding onto FP8 grids used Veltkamp's split, a float trick that needs each product rounded on its
own. On a GPU inductor's Triton code fuses a multiply and an add into one FMA, which silently turned the rounding into
(nearly) the identity: GEMM operands carried bfloat16 values instead of FP8 ones, and no CPU test noticed. The CPU
backend fuses the same way under TORCHINDUCTOR_CPP_ENABLE_FLOATING_POINT_CONTRACT_FLAG=fast, so here the workload of
tests/fma_probe.py (quantize at every granularity, quantize_t, NVFP4 with both roundings, Fp8Linear training steps;
tensors above compiling.EAGER_BELOW so the compiled kernels run) goes through a fresh process with contract=fast and
its own inductor cache, and every result must be bitwise the eager kernels' (run here, in the test's process: the
bits every compiled kernel must give, tests/test_quantize.py and tests/test_compile.py check that compiled kernels
without contraction do). The layers have biases: the emulated GEMM's epilogue acc·scale + bias is a multiply-add,
which a compiled kernel would contract into one rounding where eager code rounds twice; minifloat adds the bias in an
op of its own (gemm.scale_then_add).

So that the test cannot pass vacuously, the process must have compiled its kernels (no eager fallback, compiled
libraries in its cache), and a canary, Veltkamp's split compiled on its own, must differ from its eager result: on a
machine or torch where the flag fuses nothing, no bug of this class could show.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from minifloat.numerics.compiling import eager_kernels

PROBE = pathlib.Path(__file__).with_name("fma_probe.py")
CONTRACT_FLAG = "TORCHINDUCTOR_CPP_ENABLE_FLOATING_POINT_CONTRACT_FLAG"
CONTRACT = "fast"
CANARY = "canary/veltkamp"
# a cold compile on one core: ~90 s for the default run, ~250 for the wide one. The limit only turns a hung compiler
# into a failure
PROBE_TIMEOUT_S = 1200
SHOWN_MISMATCHES = 50  # the mismatching cases an assertion message lists
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> integer view


def run_probe(root: pathlib.Path, *args: str) -> dict:
    """The probe's {"results", "meta"} compiled under contract=fast in a fresh process, with its own cache."""
    env = dict(os.environ, MINIFLOAT_COMPILE="1", TORCHINDUCTOR_CACHE_DIR=str(root / "cache"), OMP_NUM_THREADS="1",
               **{CONTRACT_FLAG: CONTRACT})  # one thread: the suite's other worker shares the cores
    with open(root / "probe.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(PROBE), str(root / "probe.pt"), *args], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=PROBE_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    tail = (root / "probe.log").read_text()[-4000:]
    assert proc.returncode == 0, f"fma_probe.py under contract={CONTRACT} exited {proc.returncode}:\n{tail}"
    return torch.load(root / "probe.pt")


def eager_results(wide: bool) -> dict[str, torch.Tensor]:
    """The same cases run by the eager kernels in this process: the bits a compiled kernel must give."""
    import fma_probe

    with eager_kernels():
        return fma_probe.collect(wide)


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of a and b differ in their bits (NaN payloads and the sign of zero included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return max(a.numel(), b.numel(), 1)
    bits = _BITS[a.element_size()]
    return int((a.view(bits) != b.view(bits)).sum())


def check_not_vacuous(root: pathlib.Path, probe: dict, eager: dict[str, torch.Tensor]) -> None:
    """The process compiled its kernels, and the contract flag changed the canary's bits."""
    __tracebackhide__ = True  # a failure shows the message, not the probes' tensors
    meta = probe["meta"]
    assert meta["contract"] == CONTRACT, f"inductor did not read {CONTRACT_FLAG}={CONTRACT}: {meta['contract']}"
    # maybe_compile warns when a kernel's compile fails and it falls back to eager
    assert not meta["warnings"], f"contract={CONTRACT}: minifloat warned: {meta['warnings']}"
    assert meta["smallest"] >= meta["eager_below"], f"a case is small enough to run eagerly: {meta}"
    assert meta["unique_graphs"] > 1, f"contract={CONTRACT}: only the canary was compiled: {meta}"
    assert any((root / "cache").rglob("*.so")), f"contract={CONTRACT}: no compiled kernels in the cache"
    canary = mismatches(probe["results"][CANARY], eager[CANARY])
    assert canary > 0, (f"{CONTRACT_FLAG}={CONTRACT} changed no bit of the canary: this machine or torch does not fuse "
                        "multiply-adds, so the bitwise comparison could not catch issue 20")


def check_bitwise(probe: dict, eager: dict[str, torch.Tensor]) -> None:
    """Every case but the canary has the eager kernels' bits under contraction."""
    __tracebackhide__ = True
    fast = probe["results"]
    assert fast.keys() == eager.keys(), f"the two runs saved different cases: {sorted(fast.keys() ^ eager.keys())}"
    counts = {name: mismatches(fast[name], eager[name]) for name in fast if name != CANARY}
    bad = [(name, n, fast[name].numel()) for name, n in counts.items() if n]
    if bad:
        name, n, total = bad[0]
        listing = "\n".join(f"  {k}: {m} of {t}" for k, m, t in bad[:SHOWN_MISMATCHES])
        more = f"\n  ... and {len(bad) - SHOWN_MISMATCHES} more" if len(bad) > SHOWN_MISMATCHES else ""
        pytest.fail(f"FMA contraction changed compiled results (issue 20): first {name}, {n} of {total} elements "
                    f"differ; {len(bad)} of {len(fast) - 1} cases differ:\n{listing}{more}")


def test_results_are_bitwise_the_same_with_and_without_fma_contraction(tmp_path):
    """One test, not two sharing a fixture: pytest-xdist may hand two tests to two workers, each of which would then
    run the probe (tests/conftest.py starts this one first, the longest test of the default suite)."""
    probe = run_probe(tmp_path)
    eager = eager_results(wide=False)
    check_not_vacuous(tmp_path, probe, eager)
    check_bitwise(probe, eager)


@pytest.mark.slow
def test_wide_sweep_is_bitwise_the_same_with_and_without_fma_contraction(tmp_path):
    """E5M2, quantize_t at every granularity, NVFP4's transposed cast, mf.cast under torch.compile, every recipe."""
    probe = run_probe(tmp_path, "--wide")
    eager = eager_results(wide=True)
    check_not_vacuous(tmp_path, probe, eager)
    check_bitwise(probe, eager)
