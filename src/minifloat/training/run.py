"""The objects of one training run and what one optimizer step computes with them.

`build` makes the run's objects from a TrainConfig (the model under its precision policy on the device, sharded or
wrapped for the world's ranks, AdamW, loss scaler, guard, shadow check); `forward_backward` computes one step's
gradients over its micro-batches; `evaluate` the mean validation loss. minifloat.training.loop runs the steps;
minifloat.training.memory measures one step with the same objects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh

from minifloat.amp.policy import PrecisionPolicy
from minifloat.amp.scaler import LossScaler
from minifloat.fp8.modules import autocast, reuse_weight_casts
from minifloat.safety.guards import GuardConfig, StepGuard
from minifloat.safety.shadow import Mode, ShadowCheck, ShadowConfig
from minifloat.safety.stability import StabilityConfig
from minifloat.training.config import TrainConfig
from minifloat.training.data import val_batches
from minifloat.training.model import Llama
from minifloat.training.optimizer import adamw
from minifloat.training.parallel import Parallel, World, accumulating, shard, wrap
from minifloat.training.throughput import resolve_device
from minifloat.training.tp_plan import llama_2d


@dataclasses.dataclass
class Run:
    """The objects of one run, built by `build`: what a step needs, on `device`."""

    config: TrainConfig
    device: torch.device
    policy: PrecisionPolicy
    model: Llama
    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    guard: StepGuard
    shadow: ShadowCheck
    stability: StabilityConfig
    world: World = World()
    train_module: torch.nn.Module | None = None  # what the training forward calls: DDP(model), else model

    @property
    def autocast_device(self) -> str:
        """torch.autocast's device type: cuda on a GPU, cpu for everything else (meta included)."""
        return "cuda" if self.device.type == "cuda" else "cpu"


def build(config: TrainConfig, device: torch.device | None = None, world: World = World(), *,
          vocab_size: int = 256) -> Run:
    """The model (seeded, under the config's policy, on `device`; sharded or wrapped for the world's ranks), AdamW
    (behind the `master` mode's wrapper: minifloat.training.optimizer), loss scaler, guard and shadow check.
    vocab_size: the data's (corpus.vocab_size)."""
    device = device if device is not None else resolve_device(config.device)
    torch.manual_seed(config.seed)
    policy = config.policy()
    model = Llama(config.model_config(vocab_size))  # TrainConfig refused a keep_blocks that keeps every block
    model = policy.apply(model, filter=config.layer_filter()).to(device)
    if world.parallel is Parallel.FSDP:
        shard(model)  # before the optimizer: fully_shard replaces the parameters by their shards
    elif world.parallel is Parallel.FSDP_TP:
        llama_2d(model, init_device_mesh(device.type, (world.data_size, world.tp), mesh_dim_names=("dp", "tp")))
        # the replicated logits come back from the TP head as a view, which FSDP2 warns could lose its backward hook
        # under an in-place op; the trainer makes none on the model's outputs
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
    stability = StabilityConfig(embedding_grad_alpha=config.embedding_grad_alpha, max_grad_norm=config.grad_clip,
                                weight_decay=config.weight_decay)
    if config.embedding_grad_alpha != 1.0:
        # GLM-130B: the embedding output's gradient times alpha (a forward hook, so the state-dict keys stay)
        model.wte.register_forward_hook(lambda _module, _args, h: stability.shrink_embedding_grad(h))
    optimizer = adamw(model, stability.param_groups(model), lr=config.lr, state_formats=config.state_formats,
                      master=config.master, seed=config.seed)
    scaler = LossScaler.for_dtype(policy.compute_dtype, model=model)  # a no-op for bf16 and fp32
    guard = StepGuard(model, optimizer, stateful={"scaler": scaler},
                      config=GuardConfig(rollback_after=config.rollback_after, snapshot_every=config.snapshot_every))
    # without checks the mode stays FP8 and shadow.context() changes nothing
    shadow = ShadowCheck(ShadowConfig(interval=config.shadow_every or 1, threshold=config.shadow_threshold,
                                      reference_dtype=str(policy.compute_dtype).removeprefix("torch.")))
    return Run(config, device, policy, model, optimizer, scaler, guard, shadow, stability, world, wrap(model, world))


def low_precision_layers(config: TrainConfig) -> tuple[int, int]:
    """(linear layers the run trains in its low-precision recipe, all its linear layers), planned on the meta
    device (no memory, no training)."""
    with torch.device("meta"):
        model = Llama(config.model_config())
    kinds = config.policy().plan(model, filter=config.layer_filter())
    return sum(kind == "fp8" for kind in kinds.values()), sum(isinstance(m, torch.nn.Linear) for m in model.modules())


def forward_backward(run: Run, forward, batches: list[tuple[torch.Tensor, torch.Tensor]], step: int, *,
                     poison: bool = False):
    """The gradients of one optimizer step: each micro-batch's forward under the policy's autocast and the shadow's
    mode, and its backward of loss / len(batches) (scaled by the loss scaler). Returns (mean loss, fp32 scalar
    tensor; mode). `poison` multiplies the losses by NaN (TrainConfig.nan_steps). Across ranks the gradients are
    reduced once, in the last micro-batch's backward."""
    total = None
    for i, (x, y) in enumerate(batches):
        with accumulating(run.train_module, run.world, last=i == len(batches) - 1):
            tail = step >= run.config.bf16_tail_start  # the late switch: FP8/FP4 layers in BF16 from here on
            with torch.autocast(run.autocast_device, dtype=run.policy.compute_dtype,
                                enabled=run.policy.autocast_enabled), run.shadow.context(step) as mode, \
                    autocast(enabled=False) if tail else contextlib.nullcontext():
                mode = Mode.BF16 if tail else mode
                logits, loss = forward(x, y)  # (B, T, V), fp32 scalar
                loss = loss + run.stability.z_loss(logits)
            if poison:
                loss = loss * math.nan
            run.scaler.scale(loss / len(batches)).backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total / len(batches), mode


@torch.no_grad()
def evaluate(model: Llama, tokens: torch.Tensor, policy: PrecisionPolicy, config: TrainConfig, *,
             fp8: bool = True, device: torch.device | None = None) -> float:
    """Mean cross-entropy over the first `eval_batches` fixed validation batches (rows weighted equally).

    fp8=False runs the FP8 layers in high precision (the shadow check's BF16 fallback), recording nothing."""
    device = device if device is not None else next(model.parameters()).device
    model.eval()
    total, rows = 0.0, 0
    with reuse_weight_casts():  # nothing changes the weights between the batches: each layer casts them once
        for x, y in val_batches(tokens, batch_size=config.batch_size, seq_len=config.seq_len,
                                max_batches=config.eval_batches):
            with policy.autocast("cuda" if device.type == "cuda" else "cpu"), autocast(enabled=fp8):
                _, loss = model(x.to(device), y.to(device))
            total += loss.item() * x.shape[0]
            rows += x.shape[0]
    model.train()
    return total / rows
