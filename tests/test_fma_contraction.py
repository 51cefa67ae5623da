"""minifloat's compiled kernels give the same bits whether or not the compiler contracts multiply-adds into FMAs.

Why (issue 20): rounding onto FP8 grids used Veltkamp's split, a float trick that needs each product rounded on its
own. On a GPU inductor's Triton code fuses a multiply and an add into one FMA, which silently turned the rounding into
(nearly) the identity: GEMM operands carried bfloat16 values instead of FP8 ones, and no CPU test noticed. The CPU
backend fuses the same way under TORCHINDUCTOR_CPP_ENABLE_FLOATING_POINT_CONTRACT_FLAG=fast, so here the workload of
tests/fma_probe.py (quantize at every granularity, quantize_t, NVFP4 with both roundings, Fp8Linear training steps;
tensors above compiling.EAGER_BELOW so the compiled kernels run) goes through two fresh processes, contract=fast and
contract=off, each with its own inductor cache, and every result must agree bitwise. The layers have biases: the
emulated GEMM's epilogue acc·scale + bias is a multiply-add, which a compiled kernel would contract into one rounding
where eager code rounds twice; minifloat adds the bias in an op of its own (gemm.scale_then_add).

So that the test cannot pass vacuously, each process must have compiled its kernels (no eager fallback, compiled
libraries in its cache), and a canary, Veltkamp's split compiled on its own, must differ between the two: on a
machine or torch where the flag fuses nothing, no bug of this class could show.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

PROBE = pathlib.Path(__file__).with_name("fma_probe.py")
CONTRACT_FLAG = "TORCHINDUCTOR_CPP_ENABLE_FLOATING_POINT_CONTRACT_FLAG"
CONTRACTS = ("fast", "off")
CANARY = "canary/veltkamp"
# cold compiles, both processes together (2 cores): ~135 CPU-seconds for the default run, ~330 for the wide one. The
# limit only turns a hung compiler into a failure
PROBE_TIMEOUT_S = 1200
SHOWN_MISMATCHES = 50  # the mismatching cases an assertion message lists
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> integer view


def run_probes(root: pathlib.Path, *args: str) -> dict[str, dict]:
    """The probe's {"results", "meta"} under each contract setting, the processes run side by side."""
    procs = {}
    for contract in CONTRACTS:
        env = dict(os.environ, MINIFLOAT_COMPILE="1", TORCHINDUCTOR_CACHE_DIR=str(root / f"cache-{contract}"),
                   OMP_NUM_THREADS="1", **{CONTRACT_FLAG: contract})  # one thread each: the two share the cores
        log = open(root / f"{contract}.log", "w")
        cmd = [sys.executable, str(PROBE), str(root / f"{contract}.pt"), *args]
        procs[contract] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log)
    try:
        for proc, _ in procs.values():
            proc.wait(timeout=PROBE_TIMEOUT_S)
    finally:
        for proc, log in procs.values():
            if proc.poll() is None:  # timed out, or the other one did
                proc.kill()
                proc.wait()
            log.close()
    for contract, (proc, _) in procs.items():
        tail = (root / f"{contract}.log").read_text()[-4000:]
        assert proc.returncode == 0, f"fma_probe.py under contract={contract} exited {proc.returncode}:\n{tail}"
    return {c: torch.load(root / f"{c}.pt") for c in CONTRACTS}


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of a and b differ in their bits (NaN payloads and the sign of zero included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return max(a.numel(), b.numel(), 1)
    bits = _BITS[a.element_size()]
    return int((a.view(bits) != b.view(bits)).sum())


def check_not_vacuous(root: pathlib.Path, probes: dict[str, dict]) -> None:
    """Both processes compiled their kernels, and the contract flag changed the canary's bits."""
    __tracebackhide__ = True  # a failure shows the message, not the probes' tensors
    for contract, probe in probes.items():
        meta = probe["meta"]
        assert meta["contract"] == contract, f"inductor did not read {CONTRACT_FLAG}={contract}: {meta['contract']}"
        # maybe_compile warns when a kernel's compile fails and it falls back to eager
        assert not meta["warnings"], f"contract={contract}: minifloat warned: {meta['warnings']}"
        assert meta["smallest"] >= meta["eager_below"], f"a case is small enough to run eagerly: {meta}"
        assert meta["unique_graphs"] > 1, f"contract={contract}: only the canary was compiled: {meta}"
        assert any((root / f"cache-{contract}").rglob("*.so")), f"contract={contract}: no compiled kernels in the cache"
    canary = mismatches(*(probes[c]["results"][CANARY] for c in CONTRACTS))
    assert canary > 0, (f"{CONTRACT_FLAG}=fast changed no bit of the canary: this machine or torch does not fuse "
                        "multiply-adds, so the bitwise comparison could not catch issue 20")


def check_bitwise(probes: dict[str, dict]) -> None:
    """Every case but the canary has the same bits under both contract settings."""
    __tracebackhide__ = True
    fast, off = (probes[c]["results"] for c in CONTRACTS)
    assert fast.keys() == off.keys(), f"the two runs saved different cases: {sorted(fast.keys() ^ off.keys())}"
    counts = {name: mismatches(fast[name], off[name]) for name in fast if name != CANARY}
    bad = [(name, n, fast[name].numel()) for name, n in counts.items() if n]
    if bad:
        name, n, total = bad[0]
        listing = "\n".join(f"  {k}: {m} of {t}" for k, m, t in bad[:SHOWN_MISMATCHES])
        more = f"\n  ... and {len(bad) - SHOWN_MISMATCHES} more" if len(bad) > SHOWN_MISMATCHES else ""
        pytest.fail(f"FMA contraction changed compiled results (issue 20): first {name}, {n} of {total} elements "
                    f"differ; {len(bad)} of {len(fast) - 1} cases differ:\n{listing}{more}")


def test_results_are_bitwise_the_same_with_and_without_fma_contraction(tmp_path):
    """One test, not two sharing a fixture: pytest-xdist may hand two tests to two workers, each of which would then
    run the probes (tests/conftest.py starts this one first, the longest test of the default suite)."""
    probes = run_probes(tmp_path)
    check_not_vacuous(tmp_path, probes)
    check_bitwise(probes)


@pytest.mark.slow
def test_wide_sweep_is_bitwise_the_same_with_and_without_fma_contraction(tmp_path):
    """E5M2, quantize_t at every granularity, NVFP4's transposed cast, mf.cast under torch.compile, every recipe."""
    probes = run_probes(tmp_path, "--wide")
    check_not_vacuous(tmp_path, probes)
    check_bitwise(probes)
