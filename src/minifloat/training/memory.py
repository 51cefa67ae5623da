"""Training memory, measured: the bytes one training step of the reference Llama holds, by kind.

    report = memory_report(TrainConfig(model="10m", preset="fp8-delayed", batch_size=16, seq_len=64))
    report.measured.optimizer_state, report.per_param("optimizer_state"), report.baselines["fp32 AdamW"]

`measure` builds the run exactly as `minifloat train` does (minifloat.training.loop.build: the model under the
preset's policy, AdamW or the optimizer a factory makes), feeds it the run's first real batch and takes one real
step (forward and backward under the policy's autocast, unscale, clip, optimizer step). Nothing is computed from
shapes; every figure is the storage of live tensors:

  weights           the model's parameters (a tied embedding once)
  master weights    tensors the optimizer updates that are not the model's parameters (fp32 copies of
                    low-precision weights, minifloat.amp.master; none for --master bf16-sr, whose fp32 temporaries
                    hold no storage between steps) and Kahan compensation buffers (--master bf16-kahan)
  gradients         the .grad of the parameters and of the master weights, after the optimizer step
  optimizer state   every tensor in optimizer.state (moments, step counters, quantization scales)
  FP8 scaling       the buffers of the FP8 layers' ScalingStates (amax histories, scales)
  other buffers     the model's remaining buffers
  saved for backward  every tensor autograd saves during the forward (torch.autograd.graph.saved_tensors_hooks),
                    those already counted above (a parameter an FP8 layer saves as it is) left out. It holds the
                    activations and the low-precision weight copies autocast makes for its GEMMs; an FP8 linear
                    layer saves its input's FP8 bytes (1 B/element) and scale instead (minifloat.fp8.autograd).

Each storage is counted once in all, in the order above, so views and shared tensors never count twice. Saved
tensors live from the forward to the backward of one micro-batch, so their figure is per micro-batch whatever
grad_accum is. Not measured: temporaries freed within an op, the caching allocator's slack, and the per-step cache of
FP8 weight casts that Fp8Linear holds until the step ends (minifloat.fp8.caster.WeightCache).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
from torch import nn

from minifloat.fp8.scaling import scaling_states
from minifloat.training.config import TrainConfig
from minifloat.training.data import BatchLoader, load_corpus, require_windows
from minifloat.training.loop import build, forward_backward
from minifloat.training.optimizer import grad_param_groups, master_tensors
from minifloat.training.throughput import compute_device

# the same step in plain precisions, measured beside the run: (name, preset), each with torch.optim.AdamW
BASELINES = (("fp32 AdamW", "fp32"), ("bf16 AdamW", "bf16"))
# what each Footprint field holds, for tables and docs
KINDS = {
    "weights": "the model's parameters (a tied embedding once)",
    "master_weights": "tensors the optimizer updates that are not the model's parameters, and Kahan compensation",
    "gradients": "gradients of the parameters and of the master weights",
    "optimizer_state": "every tensor in optimizer.state",
    "fp8_scaling": "buffers of the FP8 layers' ScalingStates",
    "buffers": "the model's other buffers",
    "saved": "tensors autograd saves for backward in one micro-batch's forward",
}

# makes the optimizer of a measured run from the model and its param groups (weight decay on matrices only)
OptimizerFactory = Callable[[nn.Module, list[dict]], torch.optim.Optimizer]


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Bytes held by one training step, by kind (see the module docstring); `total` is their sum."""

    weights: int
    master_weights: int
    gradients: int
    optimizer_state: int
    fp8_scaling: int
    buffers: int
    saved: int

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    def to_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """A measured run and the same step in the plain precisions of BASELINES.

    Attributes:
        config: the measured run.
        params: parameters of the model (a tied embedding once).
        optimizer: the class name of the run's optimizer.
        measured: the run's Footprint.
        baselines: name -> Footprint of the same model, batch and step under BASELINES' presets with AdamW.
    """

    config: TrainConfig
    params: int
    optimizer: str
    measured: Footprint
    baselines: dict[str, Footprint]

    def per_param(self, kind: str, footprint: Footprint | None = None) -> float:
        """Bytes per parameter of one kind ("total" included) of `footprint` (default: the measured run)."""
        return (footprint or self.measured).to_dict()[kind] / self.params

    def to_dict(self) -> dict:
        """JSON-ready: the config, parameter count, optimizer, and every footprint's bytes."""
        return {"config": self.config.flat(), "params": self.params, "optimizer": self.optimizer,
                "measured": self.measured.to_dict(),
                "baselines": {name: f.to_dict() for name, f in self.baselines.items()}}


class StorageLedger:
    """Bytes of tensor storages, each storage counted once however many tensors view it."""

    def __init__(self):
        self.seen: set[int] = set()

    def key(self, t: torch.Tensor) -> tuple[int, int]:
        """(storage address, storage bytes) of `t`."""
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()

    def add(self, tensors: Iterable[torch.Tensor]) -> int:
        """Bytes of the storages among `tensors` not counted before; counts them. A wrapper tensor subclass (one
        with __tensor_flatten__: torchao's quantized optimizer states, DTensor) counts as the plain tensors it
        wraps: its own storage is a shell, and its logical dtype and shape say nothing of its bytes."""
        total = 0
        for t in (s for t in tensors for s in storage_tensors(t)):
            ptr, nbytes = self.key(t)
            if ptr not in self.seen:
                self.seen.add(ptr)
                total += nbytes
        return total


def storage_tensors(t: torch.Tensor) -> Iterable[torch.Tensor]:
    """The plain tensors that hold `t`'s data: `t` itself, or the tensors a wrapper subclass wraps, recursively."""
    if hasattr(type(t), "__tensor_flatten__"):
        names, _context = t.__tensor_flatten__()
        for name in names:
            yield from storage_tensors(getattr(t, name))
    else:
        yield t


def tensors_in(obj) -> Iterable[torch.Tensor]:
    """Every tensor in a nest of dicts, lists and tuples (an optimizer's per-parameter state)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)


def unique_params(model: nn.Module) -> int:
    """Parameters of `model`, a tensor shared by several modules (a tied embedding) once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def first_batch(config: TrainConfig, device: torch.device) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
    """The run's first training batch (x, y), as `minifloat train` draws it, and its data's vocabulary size."""
    corpus = load_corpus(config.data, max_bytes=config.max_bytes, tokenizer=config.tokenizer)
    require_windows(corpus, seq_len=config.seq_len)  # as train: a corpus too short names --max-bytes, not a shape
    loader = BatchLoader(corpus.train, batch_size=config.batch_size, seq_len=config.seq_len, seed=config.seed)
    return tuple(t.to(device) for t in loader.batch(0)), corpus.vocab_size


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What `measure` found: the Footprint, the model's parameter count (a tied embedding once) and the class name
    of the optimizer that took the step."""

    footprint: Footprint
    params: int
    optimizer: str


def measure(config: TrainConfig, *, optimizer: OptimizerFactory | None = None,
            batch: tuple[torch.Tensor, torch.Tensor] | None = None, vocab_size: int = 256) -> Measurement:
    """Build `config`'s run, take one training step on `batch` and measure what it holds.

    Args:
        config: the run (one process, eager: nproc 1, compile off).
        optimizer: makes the optimizer from (model, param groups); None for the run's own AdamW.
        batch: (x, y) on the run's device; None for the run's first batch.
        vocab_size: the vocabulary of `batch`'s data (the run's own data's when batch is None).
    """
    if config.nproc != 1 or config.compile:
        raise ValueError(f"memory measures one eager process: nproc must be 1 and compile off, got "
                         f"nproc={config.nproc}, compile={config.compile}")
    device = compute_device(config.device, "take a training step")
    (x, y), vocab_size = (batch, vocab_size) if batch is not None else first_batch(config, device)
    run = build(config, device, vocab_size=vocab_size)
    if optimizer is not None:
        run = dataclasses.replace(run, optimizer=optimizer(run.model, run.stability.param_groups(run.model)))
    model, opt = run.model, run.optimizer

    ledger = StorageLedger()
    params = list(model.parameters())
    weights = ledger.add(params)
    scaling_buffers = [b for state in scaling_states(model) for b in state.buffers()]
    fp8_scaling = ledger.add(scaling_buffers)
    buffers = ledger.add(model.buffers())
    updated = master_tensors(opt)
    master_weights = ledger.add(updated)

    saved: dict[int, int] = {}  # storage address -> bytes; all saved tensors are alive until the backward

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = ledger.key(t)
        saved[ptr] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward_backward(run, run.train_module, [(x, y)], step=0)
    saved_bytes = sum(nbytes for ptr, nbytes in saved.items() if ptr not in ledger.seen)

    run.scaler.unscale_(opt)
    run.stability.clip_grad_norms(grad_param_groups(opt))
    run.scaler.step(opt)  # ends the FP8 step too
    grads = ledger.add(p.grad for p in params + updated if p.grad is not None)
    state = ledger.add(tensors_in(list(opt.state.values())))
    run.scaler.update()
    footprint = Footprint(weights=weights, master_weights=master_weights, gradients=grads, optimizer_state=state,
                          fp8_scaling=fp8_scaling, buffers=buffers, saved=saved_bytes)
    return Measurement(footprint, unique_params(model), type(opt).__name__)


def memory_report(config: TrainConfig, *, optimizer: OptimizerFactory | None = None,
                  baselines: bool = True) -> MemoryReport:
    """Measure `config`'s training step (see `measure`) and, with `baselines`, the same model, batch and step in
    plain fp32 and in bf16 autocast, both with fp32 AdamW.

    Args:
        config: the run: model, preset, batch_size, seq_len, seed and data matter.
        optimizer: makes the run's optimizer from (model, param groups); None for AdamW as `minifloat train` has it.
        baselines: also measure BASELINES (two more steps).
    """
    device = compute_device(config.device, "take a training step")
    batch, vocab_size = first_batch(config, device)
    run = measure(config, optimizer=optimizer, batch=batch, vocab_size=vocab_size)
    plain = {label: measure(plain_config(config, preset), batch=batch, vocab_size=vocab_size).footprint
             for label, preset in (BASELINES if baselines else ())}
    return MemoryReport(config=config, params=run.params, optimizer=run.optimizer, measured=run.footprint,
                        baselines=plain)


def plain_config(config: TrainConfig, preset: str) -> TrainConfig:
    """`config` under `preset` with fp32 weights and torch's AdamW, without the options that need an FP8 recipe
    (fp8_* overrides, the shadow check)."""
    return dataclasses.replace(config, preset=preset, fp8_format=None, fp8_amax_history_len=None, fp8_margin=None,
                               shadow_every=0, master="fp32", optimizer_state="fp32,fp32")
