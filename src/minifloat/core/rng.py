"""RNG state as plain data: capture and restore every generator a training step draws from.

A checkpoint or a rollback point must bring back the Python, NumPy and torch (CPU and CUDA) generators, or the run
that continues from it draws other dropout masks than the run that never stopped. `rng_state()` returns them as
plain data (ints, tuples, lists and uint8 tensors; no NumPy array), which minifloat.training.checkpoint writes
without pickle (tensors to safetensors, the rest to JSON) and minifloat.safety.guards keeps in memory.

    state = rng_state()
    ...                      # draws
    set_rng_state(state)     # the same draws again

    with restoring_rng() as start:   # a block that leaves every generator as it found it
        a = model(x)                 # dropout draws
        set_rng_state(start)
        b = model(x)                 # the same dropout masks as `a`

A counter-based stream is the other kind of state: its whole state is two integers, a seed (`named_seed` gives one
per layer) and a count of draws. NVFP4's stochastic rounding keeps them as a layer's buffers and derives each draw's
seed on the device (`minifloat.numerics.rounding.counter_seed`).
"""

from __future__ import annotations

import contextlib
import logging
import random
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

log = logging.getLogger("minifloat")


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def rng_state() -> dict[str, Any]:
    """The generator states: "python", "torch" (CPU, a uint8 tensor), "cuda" (one uint8 tensor per device, only once
    CUDA is initialised: reading it earlier would initialise CUDA, and an unused generator needs no restoring) and
    "numpy" (when installed; its 624 uint32 keys as a list of ints)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
        state["numpy"] = (name, keys.tolist(), pos, has_gauss, cached_gaussian)
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore `rng_state()` output. A CUDA or NumPy state this process cannot restore (no CUDA, no NumPy) is
    skipped with a warning: the generators it can restore still are."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(state["cuda"]))
        else:
            log.warning("minifloat: the saved RNG state holds CUDA generators but CUDA is not available; not restored")
    if "numpy" in state:
        np = _numpy()
        if np is None:
            log.warning("minifloat: the saved RNG state holds a NumPy generator but NumPy is not installed; "
                        "not restored")
            return
        name, keys, pos, has_gauss, cached_gaussian = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian))


@contextlib.contextmanager
def restoring_rng() -> Iterator[dict[str, Any]]:
    """Run the block, then put every generator back as it was; yields the state at entry, so that
    `set_rng_state(start)` inside the block replays its draws (two passes with the same dropout masks)."""
    state = rng_state()
    try:
        yield state
    finally:
        set_rng_state(state)


_MASK64 = 2**64 - 1


def _splitmix64(z: int) -> int:
    """SplitMix64's finaliser (Steele, Lea, Flood, "Fast splittable pseudorandom number generators", 2014): a
    bijection of 64-bit integers whose output bits each depend on every input bit."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def named_seed(seed: int, name: str) -> int:
    """A seed in [0, 2^63) for the stream of `name` (e.g. a layer's) under the run's `seed`: the same on every
    machine and in every process (crc32, not Python's salted hash)."""
    return _splitmix64((seed << 32) ^ zlib.crc32(name.encode())) >> 1
