"""Test selection and order: `slow` runs stay out unless the marker expression names them; the longest run first.

pyproject's addopts selects `-m 'not slow'`, but a `-m` on the command line replaces it: `pytest -m gpu` would run the
GPU tier's slow cases too (a cold compile each, minutes on a GPU whose time is rationed). Here a marker expression
that does not mention `slow` also leaves the slow tests out: `-m gpu` is the GPU tier's default set, `-m "gpu and
slow"` the rest of it, `-m slow` every slow test.

README's test command runs the suite in pytest-xdist workers (`-n auto`: one per core). Each worker's torch then
takes its share of the cores, so that two workers on two cores do not each spin two threads; what the tests start
in their own processes (CLI runs, gloo ranks, the FMA probes) keeps torch's default.
"""

from __future__ import annotations

import os

import pytest
import torch


def _cpus() -> int:
    """The CPUs this process may run on (a container's or taskset's share, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@pytest.hookimpl(optionalhook=True)  # pytest without xdist (the GPU machine's) must not reject the hook
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker per CPU this process may use. (xdist's own rule counts physical cores, which is 1 on a
    2-vCPU machine made of one hyper-threaded core, or the host's CPUs, which a container may not have.)"""
    return _cpus()


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, _cpus() // workers))


# The default suite's longest tests, started first: under pytest-xdist a long test begun last keeps one worker busy
# after the others ran out of work (the FMA probes: two cold-compiling processes, 70-130 s)
RUN_FIRST = ("test_fma_contraction.py::",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not any(key in item.nodeid for key in RUN_FIRST))  # stable: the rest keep their order
    if "slow" in (config.option.markexpr or ""):
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]
