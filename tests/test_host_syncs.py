"""No host synchronisation in a steady-state FP8 training step (issue 21: little host work per layer, state kept on
the device, steps CUDA graphs can capture). The instrument: tests/host_syncs.py.

On the CPU the one read allowed is `ScalingState.record`'s check for a non-finite amax (it warns at once; a CPU
waits for nothing). The GPU tier (tests/test_gpu_training.py) runs the same step under
`torch.cuda.set_sync_debug_mode("error")`, where that check is skipped.
"""

from __future__ import annotations

import pytest
import torch

from gpu_device import RECIPES
from host_syncs import CPU_ONLY_READS, WARMUP, HostSyncs, make_step


def test_the_counter_sees_each_kind_of_read():
    """The instrument itself: .item(), bool() and nonzero are each counted, at this file's frame when no minifloat
    frame called them, and at minifloat's frame when one did."""
    from minifloat.numerics.quantize import sqnr_db

    t = torch.ones(4)
    with HostSyncs() as syncs:
        t.sum().item(), bool(t[0] > 0), t.nonzero()
    assert sum(syncs.sites.values()) == 3 and set(syncs.sites) == {("", "")}
    with HostSyncs() as syncs:
        sqnr_db(t, t + 1)  # returns a Python float: one read, made by minifloat
    assert set(syncs.sites) == {("numerics/metrics.py", "sqnr_db")}


@pytest.mark.parametrize("name", [name for name, _ in RECIPES])
def test_a_steady_state_fp8_step_reads_nothing_on_the_host(name):
    """forward, backward, optimizer step and the FP8 step's end, after warm-up: no read of a tensor's value by
    minifloat but the CPU-only non-finite check, for every recipe (delayed, current, row, block, MX, MXFP4, NVFP4)."""
    step = make_step(name, "cpu")
    for _ in range(WARMUP):
        step()
    with HostSyncs() as syncs:
        step()
    unexpected = {site: n for site, n in syncs.sites.items() if site not in CPU_ONLY_READS}
    assert not unexpected, f"{name}: host syncs {unexpected}"


# one recipe per Triton cast module (triton_cast, triton_rows, triton_blocks) by default; the rest with -m slow (the
# interpreter takes about 2 s per step)
TRITON_DEFAULT = ("delayed", "current-row", "block")


@pytest.mark.parametrize("name", [pytest.param(name, marks=() if name in TRITON_DEFAULT else pytest.mark.slow)
                                  for name, _ in RECIPES])
def test_the_triton_path_reads_nothing_on_the_host_either(name, monkeypatch):
    """The same step through the path a GPU takes, minifloat's Triton kernels, here in Triton's interpreter: their
    wrappers (launch grids, amax buffers, scale hand-over) read no value on the host either. Two steps before the
    counted one: the first seeds every role."""
    pytest.importorskip("triton", reason="the Triton interpreter needs `pip install triton` (in the dev extras)")
    from minifloat.numerics import triton_cast

    chosen = []
    real = triton_cast.available
    monkeypatch.setattr(triton_cast, "available", lambda x: chosen.append(real(x)) or chosen[-1])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    step = make_step(name, "cpu")
    for _ in range(2):
        step()
    with HostSyncs() as syncs:
        step()
    assert any(chosen), "the Triton kernels never ran"
    unexpected = {site: n for site, n in syncs.sites.items() if site not in CPU_ONLY_READS}
    assert not unexpected, f"{name}: host syncs {unexpected}"
