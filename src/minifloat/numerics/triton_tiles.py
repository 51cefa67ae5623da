"""How the elementwise Triton kernels (triton_cast's cast and amax passes, triton_rows' two passes) are tiled.

Each of those kernels maps one program to a (BLOCK_M, BLOCK_K) tile of a 2-D tensor; what it computes is the same
for any tile (every output element depends on its input element and on scales, and the amaxes are maxima, which do
not depend on the order they are merged in), so the tiling is a matter of speed alone. On an H200 the first tiling,
32×64 elements per program, cast 8192² bfloat16 values in 209 µs (1.2 TB/s of a 4.8 TB/s memory): a program moved
too few bytes to cover the memory's latency. Which tiling is fastest depends on the GPU and the shape, so on a GPU a
tensor of at least TUNE_FROM elements has its tiling picked by timing each candidate once per kernel variant and
shape (Triton's autotuner: a few tenths of a second, once; the buffers a launch updates in place, an amax history's
slot and its non-finite counter, are restored after every trial; the timing synchronises the device once, so warm a
step up before capturing it in a CUDA graph, as one must anyway). Smaller tensors, the interpreter and
`triton_cast.self_check`'s own casts take the first candidate, the tiling the kernels were first written for; the
self-check runs every candidate too (`forced`), so a tiling this GPU's compiler refuses turns the kernels off before
use, not in the middle of a run.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from minifloat.core.capture import capturing

# (BLOCK_M, BLOCK_K, num_warps); the first is the untuned default. Each compiles for SM 9.0 in at most 128 registers a
# thread without spills (tests/test_triton_aot.py): larger cast tiles (128×64 on 8 warps: 145-252 registers; 128×128
# on 16: spills) were left out, the casts' rounding being register-hungry; the amax passes hold far less
CAST_TILES = ((32, 64, 8), (32, 128, 8), (64, 128, 16))
AMAX_TILES = ((32, 64, 4), (64, 128, 4), (64, 256, 8), (128, 256, 8))
TUNE_FROM = 1 << 22  # elements: below this a launch is short and the first tiling does

_FORCED: list[int] = []  # set by `forced`: every launch takes its candidates' tiling of this index


def candidates_most() -> int:
    """How many tilings the longest candidate list holds: `forced(i)` for i below it runs each one."""
    return max(len(CAST_TILES), len(AMAX_TILES))


@contextlib.contextmanager
def forced(index: int) -> Iterator[None]:
    """Every launch inside takes its candidates' tiling number `index` (the last, for a shorter list): the
    self-check's and tests' way to run each tiling the autotuner may pick."""
    _FORCED.append(index)
    try:
        yield
    finally:
        _FORCED.pop()


def launch(kernel, candidates: tuple[tuple[int, int, int], ...], x: torch.Tensor, args: tuple, consts: dict, *,
           restore: tuple[str, ...] = (), key: tuple[str, ...] = ()) -> None:
    """Launch `kernel` (a triton.jit function with BLOCK_M and BLOCK_K constexprs) over x's (M, K) in tiles: the
    forced tiling, else on a GPU for a large `x` the fastest of `candidates` (timed once per `key` values and shape;
    `restore` names the arguments a trial updates in place), else the first candidate."""
    m, k = x.shape
    if _FORCED or not _tunes(x):
        bm, bk, warps = candidates[min(_FORCED[-1], len(candidates) - 1)] if _FORCED else candidates[0]
        kernel[(-(-m // bm), -(-k // bk))](*args, **consts, BLOCK_M=bm, BLOCK_K=bk, num_warps=warps)
        return
    tuned = _tuned(kernel, candidates, restore, ("M", "K", *key))
    tuned[lambda meta: (-(-m // meta["BLOCK_M"]), -(-k // meta["BLOCK_K"]))](*args, **consts)


def _tunes(x: torch.Tensor) -> bool:
    """Whether a launch over `x` picks its tiling by timing: a CUDA tensor of TUNE_FROM elements or more, and never
    while a CUDA graph is being captured (timing synchronises the device; a first launch of a shape there takes the
    first tiling, the same bits)."""
    return x.is_cuda and x.numel() >= TUNE_FROM and not capturing(x.device)


def _tuned(kernel, candidates, restore, key):
    """The autotuned launcher of `kernel` over `candidates`, made once per kernel variant."""
    entry = (kernel, candidates, restore, key)
    if entry not in _TUNED:
        import triton

        configs = [triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=warps) for bm, bk, warps in candidates]
        _TUNED[entry] = triton.autotune(configs=configs, key=list(key), restore_value=list(restore))(kernel)
    return _TUNED[entry]


_TUNED: dict[tuple, object] = {}


def picked() -> dict[str, list[dict]]:
    """The tilings the autotuner chose in this process, per kernel: each tuned shape (the key's values) and its
    (BLOCK_M, BLOCK_K, num_warps). For the GPU benchmark's report."""
    out: dict[str, list[dict]] = {}
    for (kernel, _, _, key), tuner in _TUNED.items():
        name = getattr(getattr(kernel, "fn", None), "__name__", None) or str(kernel)
        for values, config in tuner.cache.items():
            out.setdefault(name, []).append({"key": dict(zip(key, (str(v) for v in values))),
                                             "tiles": [config.kwargs["BLOCK_M"], config.kwargs["BLOCK_K"],
                                                       config.num_warps]})
    return out
