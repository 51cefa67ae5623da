"""Calibration: statistics of the inputs of a model's linear layers over sample batches, and what inference makes of
them — static activation scales (with a clip rule) and SmoothQuant scales.

A pass runs the model on every batch (minifloat.core.batch.call_model: a tensor, a tuple of positional arguments or
a dict of keyword arguments) in eval mode, without gradients and with FP8 off (Fp8Linear layers run in high
precision), while forward pre-hooks record each layer's input: its amax, per-channel amaxes (for SmoothQuant) and a
histogram of |x| (for the percentile and MSE clip rules).

Clip rules, for the static scale fp8_max / amax' (minifloat.numerics.quantize.scale_from_amax):
    max         amax' = the largest |x| over all batches (nothing saturates)
    percentile  amax' = the p-th percentile of |x| over all batches (read from a HISTOGRAM_BINS-bin histogram on
                [0, amax]); the rarer values above it saturate
    mse         amax' = the candidate amax·2^(-i/16), i < MSE_CANDIDATES, whose quantize-dequantize error
                Σ_bins count·(x̂ - x)² over the histogram is least (through minifloat's quantize)

SmoothQuant (Xiao et al., arXiv 2211.10438 §4) moves activation outliers into the weights: per input channel j,
s_j = max|X_j|^α / max|W_j|^(1-α); the layer computes (X / s) @ (W · s)ᵀ = X @ Wᵀ, and X / s has flatter
channels. When a layer's input is the output of an affine norm and every linear layer reading that output is
being converted, s is folded into the norm's gain (and bias): the norm then outputs X / s for free. A fold is
kept only if the model's output on the first batch stays within FOLD_CHECK_SQNR_DB of the unfolded model's (a norm
output that also feeds something else, e.g. a post-norm residual, fails the check); otherwise the layers apply s.

Sensitivity: a layer's SQNR is that of the model's output (every floating tensor it returns, over all batches) with
that layer alone swapped for its FP8 twin, against the model as it is. Roundings of different layers are independent,
so their noise powers add: with the layers L in FP8 the output SQNR is about -10·log10 Σ_{i∈L} 10^(-SQNR_i/10)
(`combined_sqnr_db`; on all-MiniLM-L6-v2 within 0.3 dB of the measured value, docs/inference.md). To reach a target
SQNR keeping as few weight bytes in high precision as it can, `sensitive_layers` keeps layers in order of their noise
power per weight element, 10^(-SQNR_i/10) / numel_i (the greedy answer to that knapsack), until the others' combined
SQNR reaches the target.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from minifloat.core import roles
from minifloat.core.batch import call_on_batch, call_model
from minifloat.fp8.modules import autocast as fp8_autocast
from minifloat.fp8.recipes import CastSpec, NVFP4Spec
from minifloat.inference import nvfp4
from minifloat.numerics.granularity import Granularity
from minifloat.numerics.quantize import abs_max, quantize, scale_from_amax, sqnr_db

log = logging.getLogger("minifloat")

HISTOGRAM_BINS = 2048
MSE_CANDIDATES = 64  # amax · 2^(-i/16): down to amax / 16 (E4M3's relative grid makes larger clips pointless)
SMOOTH_MIN = 1e-5  # SmoothQuant's floor on channel maxima (a dead channel would make s_j zero or infinite)
FOLD_CHECK_SQNR_DB = 40.0  # a correct fold changes only roundings (≥ 50 dB even in bfloat16); a wrong one ~0 dB


class Clip(str, enum.Enum):
    MAX = "max"
    PERCENTILE = "percentile"
    MSE = "mse"


class Observer:
    """Statistics of one layer's input over the batches of a pass. Non-finite values (NaN, ±inf) are left out of
    every statistic, which would otherwise be NaN or infinite for the whole pass; `nonfinite_batches` counts the
    batches that held any.

    Args:
        channels: also keep per-channel amaxes (K,).
        hist_range: keep a histogram of |x| on [0, hist_range] (values above fall in the last bin).
        divide: divide the input by these (K,) scales first (SmoothQuant applied in the layer).
    """

    def __init__(self, *, channels: bool = False, hist_range: torch.Tensor | None = None,
                 divide: torch.Tensor | None = None):
        self.channels, self.hist_range, self.divide = channels, hist_range, divide
        self.amax: torch.Tensor | None = None
        self.channel_amax: torch.Tensor | None = None
        self.hist: torch.Tensor | None = None
        self.batches = 0
        self._nonfinite = torch.zeros((), dtype=torch.int64)  # a tensor: counted without a host sync per batch

    @property
    def nonfinite_batches(self) -> int:
        return int(self._nonfinite)

    @torch.no_grad()
    def observe(self, x: torch.Tensor) -> None:
        x2 = x.detach().reshape(-1, x.shape[-1])  # (tokens, K)
        if self.divide is not None:
            x2 = x2.float() / self.divide
        finite = torch.isfinite(x2)
        self._nonfinite = self._nonfinite.to(x2.device) + (~finite).any()
        self.batches += 1
        x2 = torch.where(finite, x2, torch.zeros((), dtype=x2.dtype, device=x2.device))  # 0: no amax moves
        amax = abs_max(x2, None)
        self.amax = amax if self.amax is None else torch.maximum(self.amax, amax)
        if self.channels:
            ch = abs_max(x2, 0).reshape(-1)
            self.channel_amax = ch if self.channel_amax is None else torch.maximum(self.channel_amax, ch)
        if self.hist_range is not None:
            width = self.hist_range.float().clamp(min=torch.finfo(torch.float32).tiny) / HISTOGRAM_BINS
            index = (x2.abs().float() / width).floor().clamp(max=HISTOGRAM_BINS - 1).long().reshape(-1)
            # weight 0 for the non-finite values: they count in no bin
            counts = torch.bincount(index, weights=finite.reshape(-1).double(), minlength=HISTOGRAM_BINS)
            self.hist = counts if self.hist is None else self.hist + counts


def warn_nonfinite(observers: Mapping[str, Observer]) -> None:
    """One warning line naming each layer whose calibration input held NaN or ±inf, and in how many batches: those
    values were left out of its statistics (Observer), so its scale comes from the finite ones."""
    counts = {n: obs.nonfinite_batches for n, obs in observers.items()}
    if bad := {n: c for n, c in counts.items() if c}:
        log.warning("minifloat: calibration: %d layer(s) saw non-finite inputs (NaN or inf), left out of their "
                    "amax: %s", len(bad), ", ".join(f"{n} ({c} of {observers[n].batches} batches)"
                                                     for n, c in bad.items()))


def check_batches(calibration) -> list:
    """The calibration batches as a list (a generator is read once); ValueError for a single batch or none."""
    if isinstance(calibration, (torch.Tensor, Mapping)):
        raise ValueError(f"calibration must be an iterable of model inputs (e.g. a list of batches), not a single "
                         f"{type(calibration).__name__}; wrap it in a list")
    try:
        batches = list(calibration)
    except TypeError:
        raise ValueError(f"calibration must be an iterable of model inputs, got {type(calibration).__name__}"
                         ) from None
    if not batches:
        raise ValueError("calibration yielded no batches")
    return batches


@contextlib.contextmanager
def calibrating(model: nn.Module):
    """Eval mode, no gradients, FP8 off; the model's training mode is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), fp8_autocast(enabled=False):
            yield
    finally:
        model.train(was_training)


def run_pass(model: nn.Module, batches: list, observers: dict[str, Observer], *, producers: bool = False):
    """Run `model` on every batch with each named layer's input observed.

    Returns:
        (the first batch's output, {linear layer: names of the norms whose output it read, None for any other
        input}); the second is filled for every nn.Linear of the model when `producers`, else empty.
    """
    produced: dict[int, tuple[str, torch.Tensor]] = {}  # id(norm output) -> (norm name, the output, kept alive)
    readers: dict[str, set[str | None]] = {}

    def pre_hook(name):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs.get("input")
            if name in observers:
                observers[name].observe(x)
            if producers:
                source = produced.get(id(x))
                readers.setdefault(name, set()).add(source[0] if source is not None and source[1] is x else None)
        return hook

    def norm_hook(name):
        def hook(module, args, output):
            if isinstance(output, torch.Tensor):
                produced[id(output)] = (name, output)
        return hook

    watched = [n for n, _ in roles.named_linears(model)] if producers else []
    handles = [model.get_submodule(n).register_forward_pre_hook(pre_hook(n), with_kwargs=True)
               for n in dict.fromkeys([*observers, *watched])]
    if producers:
        handles += [m.register_forward_hook(norm_hook(n)) for n, m in model.named_modules() if roles.is_norm(m)]
    first = None
    try:
        with calibrating(model):
            for i, batch in enumerate(batches):
                out = call_on_batch(model, batch, "calibration", i)
                first = out if i == 0 else first
                produced.clear()
    finally:
        for h in handles:
            h.remove()
    return first, readers


def clipped_amax(obs: Observer, clip: Clip, percentile: float, spec: CastSpec) -> torch.Tensor:
    """amax' of the clip rule (see the module docstring) from a pass's statistics."""
    if clip == Clip.MAX or obs.hist is None or not bool(obs.amax > 0):  # (an all-zero input keeps amax 0)
        return obs.amax
    width = obs.hist_range.float() / HISTOGRAM_BINS
    if clip == Clip.PERCENTILE:
        cdf = obs.hist.cumsum(0) / obs.hist.sum()
        index = torch.searchsorted(cdf, torch.tensor(percentile / 100, dtype=cdf.dtype, device=cdf.device))
        return torch.minimum((index.float() + 1) * width, obs.amax)
    centers = (torch.arange(HISTOGRAM_BINS, device=obs.hist.device) + 0.5) * width  # (bins,)
    candidates = obs.amax * torch.exp2(-torch.arange(MSE_CANDIDATES, device=obs.hist.device) / 16)  # (C,)
    dscale = 1.0 / scale_from_amax(candidates, spec.fmt, margin=spec.margin, power_of_two=spec.power_of_two)
    rows = centers.expand(MSE_CANDIDATES, HISTOGRAM_BINS)
    q = quantize(rows, spec.fmt, granularity=Granularity.ROW, scale=dscale).dequantize()  # (C, bins)
    error = ((q - rows).double().pow(2) * obs.hist).sum(1)
    return candidates[torch.argmin(error)]  # the first minimum: the largest such amax


def static_scale(amax: torch.Tensor, spec: CastSpec | NVFP4Spec) -> torch.Tensor:
    """The static input's dequantization scale: 1 / (fp8_max / amax / 2^margin), as delayed scaling derives it;
    NVFP4's global scale 1 / (2688 / amax) (minifloat.inference.nvfp4)."""
    if isinstance(spec, NVFP4Spec):
        return nvfp4.static_scale(amax)
    return 1.0 / scale_from_amax(amax, spec.fmt, margin=spec.margin, power_of_two=spec.power_of_two)


def smoothing_scales(channel_amax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^α / max|W_j|^(1-α) over the weights that read X (SmoothQuant eq. 4); 1 for dead channels."""
    w_amax = torch.stack([abs_max(w.detach(), 0).reshape(-1) for w in weights]).amax(0).float()
    x_amax = channel_amax.float()
    s = x_amax.clamp(min=SMOOTH_MIN).pow(alpha) / w_amax.clamp(min=SMOOTH_MIN).pow(1 - alpha)
    return torch.where((x_amax > 0) & (w_amax > 0) & torch.isfinite(s), s, torch.ones_like(s))


def _set_weight(linear: nn.Module, value: torch.Tensor) -> None:
    # a new Parameter rather than an in-place update: a weight shared with another module stays as it was
    linear.weight = nn.Parameter(value.to(linear.weight.dtype), requires_grad=linear.weight.requires_grad)


def _tensors(obj) -> list[torch.Tensor]:
    """The floating tensors of a model output (tensors, tuples, lists, dicts and Hugging Face ModelOutputs)."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _same_output(reference, output) -> bool:
    ref, out = _tensors(reference), _tensors(output)
    if not ref or len(ref) != len(out):
        return False
    return all(r.shape == o.shape and sqnr_db(r, o) >= FOLD_CHECK_SQNR_DB for r, o in zip(ref, out))


def smooth(model: nn.Module, batches: list, observers: dict[str, Observer], readers: dict[str, set],
           reference, alpha: float) -> tuple[dict[str, torch.Tensor], set[str]]:
    """SmoothQuant's scales for the observed layers (see the module docstring), with the folds applied: X / s folded
    into the norm producing X and W <- W·s for the layers reading it. The other layers are left as they are (the
    model still computes what it did, for a later statistics pass); their W·s is the caller's to apply
    (`scale_weights`) once they divide their input by s.

    Args:
        observers: the layers, with per-channel amaxes from a pass over `batches`.
        readers: that pass's {linear: producing norms}; reference: its first output.
    Returns:
        ({layer: s}, the layers that must divide their input by s themselves).
    """
    groups: dict[str, list[str]] = {}  # norm -> the layers reading its output
    in_layer: set[str] = set()
    for name, obs in observers.items():
        sources = readers.get(name, set())
        producer = next(iter(sources)) if len(sources) == 1 else None
        weight = getattr(model.get_submodule(producer), "weight", None) if producer is not None else None
        foldable = isinstance(weight, torch.Tensor) and weight.shape == obs.channel_amax.shape
        # every linear reading the norm's output must be converted: a high-precision one would see X / s too
        if foldable and all(r in observers for r, sources in readers.items() if producer in sources):
            groups.setdefault(producer, []).append(name)
        else:
            in_layer.add(name)
    scales = {}
    for members in [*groups.values(), *([n] for n in sorted(in_layer))]:
        channel_amax = torch.stack([observers[n].channel_amax for n in members]).amax(0)
        s = smoothing_scales(channel_amax, [model.get_submodule(n).weight for n in members], alpha)
        scales.update(dict.fromkeys(members, s))
    folded = [n for members in groups.values() for n in members]
    saved = [(model.get_submodule(n), model.get_submodule(n).weight) for n in folded]
    for producer, members in groups.items():
        norm, s = model.get_submodule(producer), scales[members[0]]
        for p in (norm.weight, getattr(norm, "bias", None)):
            if isinstance(p, torch.Tensor):
                saved.append((p, p.data.clone()))
                p.data = (p.data.float() / s).to(p.dtype)
    for n in folded:
        _set_weight(model.get_submodule(n), model.get_submodule(n).weight.detach().float() * scales[n])
    if groups:  # the model with only the folds applied must compute what it did before
        with calibrating(model):
            folded_ok = _same_output(reference, call_model(model, batches[0]))
        if not folded_ok:
            for target, value in saved:
                if isinstance(target, nn.Module):
                    target.weight = value
                else:
                    target.data = value
            log.warning("minifloat.prepare_inference: folding SmoothQuant scales into %d norm(s) changed the model's "
                        "output (a norm output feeds more than linear layers); the layers apply them instead",
                        len(groups))
            in_layer |= set(folded)
    return scales, in_layer


def scale_weights(model: nn.Module, scales: Mapping[str, torch.Tensor]) -> None:
    """W <- W·s (per input channel) for each named linear layer."""
    for n, s in scales.items():
        _set_weight(model.get_submodule(n), model.get_submodule(n).weight.detach().float() * s)


def calibrated_amaxes(model: nn.Module, batches: list, names: list[str], *, clip: Clip, percentile: float,
                      alpha: float | None, specs: dict[str, CastSpec], static: bool
                      ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The calibration passes prepare_inference needs: statistics; SmoothQuant (if `alpha`: folds, then W·s for
    every smoothed layer); for static activations, statistics of what the layers will quantize (again after
    smoothing, or for the histogram), taken while the model still computes its original function.

    Returns:
        ({layer: amax' of the clip rule} (empty unless `static`), {layer: s it divides its input by}).
    """
    first = {n: Observer(channels=alpha is not None) for n in names}
    reference, readers = run_pass(model, batches, first, producers=alpha is not None)
    warn_nonfinite(first)  # once: a second pass sees the same batches
    scales, in_layer = smooth(model, batches, first, readers, reference, alpha) if alpha is not None else ({}, set())
    divide = {n: scales[n] for n in in_layer}
    if not static:
        scale_weights(model, divide)
        return {}, divide
    if alpha is None and clip == Clip.MAX:
        return {n: first[n].amax for n in names}, divide
    second = {}
    for n in names:
        hist_range = None
        if clip != Clip.MAX:  # a bound of |X / s| from the first pass (a little above it for folded norms, whose
            # X / s the norm computes with its own rounding; values above fall in the last bin)
            hist_range = first[n].amax if alpha is None else (first[n].channel_amax / scales[n]).amax() * (1 + 2**-6)
        second[n] = Observer(divide=divide.get(n), hist_range=hist_range)
    run_pass(model, batches, second)  # the layers that will divide by s still hold W: the model is unchanged
    scale_weights(model, divide)
    return {n: clipped_amax(second[n], clip, percentile, specs[n]) for n in names}, divide


@contextlib.contextmanager
def swapped(model: nn.Module, name: str, module: nn.Module):
    """`model`'s submodule `name` replaced by `module` inside the block, put back afterwards."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    original = getattr(parent, child)
    setattr(parent, child, module)
    try:
        yield
    finally:
        setattr(parent, child, original)


def layer_sensitivities(model: nn.Module, batches: list, twins: Mapping[str, nn.Module]) -> dict[str, float]:
    """{layer: the output SQNR (dB) of `model` with that layer alone replaced by its twin} over all batches (see the
    module docstring); one pass per twin and batch, plus the reference pass. inf where the twin changes nothing.
    Output elements the model itself computes as NaN or ±inf are left out (with one warning line): one bad value
    would make every layer's SQNR NaN."""
    noise, signal, nonfinite = dict.fromkeys(twins, 0.0), 0.0, 0
    with calibrating(model):
        for batch in batches:  # batches outside: one batch's reference output is kept at a time (LLM logits are big)
            reference = [t.double() for t in _tensors(call_model(model, batch))]
            finite = [torch.isfinite(r) for r in reference]
            nonfinite += not all(bool(f.all()) for f in finite)
            reference = [torch.where(f, r, 0.0) for r, f in zip(reference, finite)]
            signal += sum(r.pow(2).sum().item() for r in reference)
            for name, twin in twins.items():
                with swapped(model, name, twin):
                    out = _tensors(call_model(model, batch))
                # a twin's NaN where the model's output is finite is infinite noise (never a perfect layer)
                noise[name] += sum(torch.where(f, r - o.double(), 0.0).nan_to_num(nan=math.inf).pow(2).sum().item()
                                   for r, o, f in zip(reference, out, finite))
    if nonfinite:
        log.warning("minifloat: sensitivity: the model's output held NaN or inf in %d of %d calibration batches; "
                    "those elements were left out of every layer's SQNR", nonfinite, len(batches))
    return {n: 10 * math.log10(signal / noise[n]) if noise[n] > 0 else math.inf for n in twins}


def combined_sqnr_db(sqnrs: Iterable[float]) -> float:
    """The output SQNR with several layers in FP8, from each one's alone: noise powers add (module docstring)."""
    noise = sum(10 ** (-s / 10) for s in sqnrs)
    return -10 * math.log10(noise) if noise > 0 else math.inf


def sensitive_layers(sqnrs: Mapping[str, float], sizes: Mapping[str, int], target_db: float) -> list[str]:
    """The layers to keep in high precision so that the combined SQNR of the others reaches `target_db`, most noise
    per weight element first (module docstring), in that order; all of them when that never happens.

    Args:
        sqnrs: {layer: output SQNR in dB with it alone in FP8} (`layer_sensitivities`).
        sizes: {layer: its weight's element count}.
    """
    order = sorted(sqnrs, key=lambda n: (-(10 ** (-sqnrs[n] / 10)) / sizes[n], n))
    k = 0
    while k < len(order) and combined_sqnr_db(sqnrs[n] for n in order[k:]) < target_db:
        k += 1
    return order[:k]
