"""The cases `triton_cast.self_check` runs on a device before minifloat's Triton kernels are used there: each kernel
variant against the torch path (the CPU emulation's bits), and recording an amax (one launch, or in a cast's own)
against `ScalingState.record`'s torch ops."""

from __future__ import annotations

import torch

from minifloat.numerics import triton_cast, triton_tiles


def checks(device: torch.device):
    """(name, cast) pairs for `self_check`: each cast returns Quantized results, on the kernels unless _CHECKING."""
    from minifloat.numerics.formats import E4M3, E5M2
    from minifloat.numerics.other_axis import quantize_both, quantize_t, requantize_t
    from minifloat.numerics.quantize import quantize

    x = torch.linspace(-600.0, 600.0, 130 * 140, dtype=torch.float32).reshape(130, 140)
    x[0, :8] = torch.tensor([0.0, -0.0, 1e-30, 2.0**-10, 3 * 2.0**-11, 1.0625, float("inf"), float("nan")])
    x[129, 99] = 2.0**-20  # a last ragged row of one tiny value
    x = x.to(device)
    tiles = x[:, :100]  # two 128×128 programs per cast (each is ~0.5 s in Triton's interpreter)
    for fmt in (E4M3, E5M2):
        for options in (dict(granularity="row"), dict(scale=torch.tensor(2.0, device=device), with_t=True),
                        dict(with_t=True)):
            yield f"a {fmt.name} cast with {sorted(options)}", lambda f=fmt, o=options: quantize(x, f, **o)
    # tiles and blocks: E4M3 only (the block recipe's one format; the rounding is the same code for E5M2, and each
    # variant checked is one more kernel compiled before a GPU's first FP8 step)
    for options in (dict(granularity="tile"), dict(granularity="block", with_t=True),
                    dict(granularity="block", power_of_two=True, margin=1)):
        yield f"an E4M3 cast with {options}", lambda o=options: quantize(tiles, E4M3, **o)
    yield "an E4M3 cast of tiles down the columns", lambda: quantize_t(tiles, E4M3, granularity="tile")
    yield "an E4M3 cast of tiles both ways", lambda: quantize_both(tiles, E4M3, granularity="tile", power_of_two=True)
    saved = quantize(tiles, E4M3, granularity="tile", power_of_two=True)
    yield "a re-quantization of FP8 tiles", lambda: requantize_t(saved, power_of_two=True)
    # rows and columns in two passes (triton_rows), from high precision and from FP8 (E4M3: E5M2's rounding is the
    # per-row cast's above)
    yield "an E4M3 cast per row and per column", lambda: quantize_both(tiles, E4M3, granularity="row")
    rows = quantize(tiles, E4M3, granularity="row")
    yield "an E4M3 re-quantization of FP8 rows", lambda: requantize_t(rows)
    # every other tiling the autotuner may pick for a large tensor (triton_tiles), on ragged edges here; past the
    # casts' candidates only the amax pass (current scaling's) has tilings left
    for i in range(1, triton_tiles.candidates_most()):
        cases = [("an E4M3 cast with its amax, both ways", lambda: quantize(tiles, E4M3, with_t=True))]
        if i < len(triton_tiles.CAST_TILES):
            cases += [("an E5M2 cast with a given scale, both ways",
                       lambda: quantize(tiles, E5M2, scale=torch.tensor(2.0, device=device), with_t=True)),
                      ("an E4M3 cast per row and per column", lambda: quantize_both(tiles, E4M3, granularity="row"))]
        for name, cast in cases:
            yield f"{name} in tiling {i}", lambda c=cast, i=i: _in_tiling(i, c)


def _in_tiling(index: int, cast):
    with triton_tiles.forced(index):
        return cast()


def folds_as_torch_does(device: torch.device) -> bool:
    """fold_amax against ScalingState.record's torch ops: one amax and many (more than one block of the kernel's
    walk), all finite or with an inf or a NaN among them."""
    g = torch.Generator().manual_seed(0)
    many = torch.rand(2500, generator=g) * 4.0
    cases = [torch.tensor(3.5), torch.tensor(0.25), many]
    for bad in (float("inf"), float("nan")):
        spoiled = many.clone()
        spoiled[1700] = bad
        cases += [torch.tensor(bad), spoiled]
    for amax in cases:
        amax = amax.to(device)
        slot, counter = torch.ones((), device=device), torch.zeros((), dtype=torch.int64, device=device)
        triton_cast.fold_amax(slot, counter, amax)
        top = amax.float().amax()
        finite = torch.isfinite(top)
        expected = torch.where(finite, torch.maximum(torch.ones_like(top), top), torch.ones_like(top))
        if not (torch.equal(slot, expected) and int(counter) == int(~finite)):
            return False
    return records_in_pass_as_torch_does(device)


def records_in_pass_as_torch_does(device: torch.device) -> bool:
    """A cast that records its amax in its own launch over several programs, finite or with an inf or a NaN: per
    tensor (delayed: given a scale; current: in the amax pass), and, finite or with a NaN, per row (triton_rows' amax
    pass) and in 128×128 blocks (triton_blocks' pass; its tiles record by the same code). The slot and counter as
    `record_amax`'s torch ops leave them, a per-tensor cast's amax returned, and the scratch back to zero."""
    from minifloat.numerics.formats import E4M3
    from minifloat.numerics.quantize import quantize

    casts = [(lambda x, slot, s=s: quantize(x, E4M3, scale=s, record=slot), (70, 200), "inf nan")
             for s in (torch.tensor(2.0, device=device), None)]
    casts += [(lambda x, slot: quantize(x, E4M3, granularity="row", record=slot), (50, 130), "nan"),
              (lambda x, slot: quantize(x, E4M3, granularity="block", record=slot), (40, 130), "nan")]
    for cast, (m, k), spoilers in casts:
        for bad in (None, *(float(v) for v in spoilers.split())):
            x = torch.linspace(-3.0, 3.0, m * k).reshape(m, k)
            if bad is not None:
                x[m - 1, k - 1] = bad  # in the grid's last program
            slot = triton_cast.AmaxSlot(torch.ones((), device=device),
                                        torch.zeros((), dtype=torch.int64, device=device),
                                        torch.zeros(2, dtype=torch.int32, device=device))
            q = cast(x.to(device), slot)
            top = x.abs().amax()
            finite = bool(torch.isfinite(top))
            expected = max(1.0, float(top)) if finite else 1.0
            if not (float(slot.amax) == expected and int(slot.nonfinite) == int(not finite)
                    and (q.amax.dim() or torch.equal(q.amax.cpu().view(torch.int32), top.view(torch.int32)))
                    and not slot.scratch.any()):
                return False
    return True


def same(a, b) -> bool:
    """Whether Quantized results (or tuples of them) hold the same data bytes and scales."""
    if isinstance(a, tuple):
        return all(same(p, q) for p, q in zip(a, b))
    return (torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)
            and (a.data_t is None or torch.equal(a.data_t.view(torch.uint8), b.data_t.view(torch.uint8))))
