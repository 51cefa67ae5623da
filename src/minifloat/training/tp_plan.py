"""Tensor and sequence parallel for the reference Llama (minifloat.training.model), and the 2-D FSDP × TP mesh.

The Megatron-LM layout (Shoeybi et al., arXiv 1909.08053; sequence parallel: Korthikanti et al., arXiv 2205.05198)
as torchtitan writes it for DTensor. Between blocks the residual stream is sharded along the sequence (Shard(1)):
the norms run on their tokens only, in fp32 (minifloat.amp.norms.RMSNorm under torch's SequenceParallel). Each
attention and MLP all-gathers its normed input, runs column-parallel then row-parallel FP8 layers, and
reduce-scatters the output back onto the sequence shards. The residual stream stays a DTensor (the embedding and the
row-parallel outputs keep `use_local_output=False`): a block compiled on its own (the trainer's `--compile`) then takes
and returns DTensors, and its input gradient leaves it as one (as a plain tensor it broke DTensor's backward).

    wte             RowwiseParallel (vocab rows)         idx replicated  -> x (B, T/t, C)
    attn_norm       SequenceParallel, fp32               x (B, T/t, C)
    q/k/v_proj      Fp8ColwiseParallel (heads)           all-gather      -> (B, T, C/t): n_head/t local heads,
                                                                            n_kv_head/t local key/value heads
    o_proj          Fp8RowwiseParallel                   partial sums    -> reduce-scatter (B, T/t, C)
    mlp_norm        SequenceParallel, fp32
    gate/up_proj    Fp8ColwiseParallel                   all-gather      -> (B, T, d_ff/t)
    down_proj       Fp8RowwiseParallel                   partial sums    -> reduce-scatter (B, T/t, C)
    norm            SequenceParallel, fp32
    lm_head         ColwiseParallel (vocab rows)         all-gather      -> logits (B, T, vocab), replicated

A tied head shares the embedding's DTensor (both shard the vocab rows). Layers that `mf.convert` kept in high
precision (the first block's q/k/v, the head) take torch's own styles through the same classes.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel, SequenceParallel

from minifloat.distributed.tp import Fp8ColwiseParallel, Fp8RowwiseParallel, apply_2d, apply_tensor_parallel
from minifloat.training.model import Llama


def _check(model: Llama, tp: int) -> None:
    if not isinstance(model, Llama):
        raise ValueError(f"model must be a minifloat Llama, got {type(model).__name__}")
    config = model.config
    if config.qk_norm:  # its gain would see only the local heads: a gradient per rank, summed nowhere
        raise ValueError("tensor parallel does not support qk_norm=True yet")
    # each rank holds whole heads, and the query heads of a key/value head on the same rank: n_head and n_kv_head
    # both split (query head h reads kv head h // (n_head / n_kv_head); rank r's blocks of each stay together)
    for field, value in (("n_head", config.n_head), ("n_kv_head", config.kv_heads), ("ffn_dim", config.ffn_dim),
                         ("vocab_size", config.vocab_size)):
        if value % tp:
            raise ValueError(f"{field} ({value}) must be a multiple of the tensor-parallel size {tp}")


def llama_plan(model: Llama) -> dict:
    """The parallelize_module plan of `model` (see the module docstring): module path -> ParallelStyle."""
    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "norm": SequenceParallel(),
        "lm_head": Fp8ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(len(model.blocks)):
        b = f"blocks.{i}"
        plan.update({
            f"{b}.attn_norm": SequenceParallel(),
            f"{b}.attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None), use_local_output=True),
            f"{b}.attn.q_proj": Fp8ColwiseParallel(),
            f"{b}.attn.k_proj": Fp8ColwiseParallel(),
            f"{b}.attn.v_proj": Fp8ColwiseParallel(),
            f"{b}.attn.o_proj": Fp8RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            f"{b}.mlp_norm": SequenceParallel(),
            f"{b}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                           use_local_output=True),
            f"{b}.mlp.gate_proj": Fp8ColwiseParallel(),
            f"{b}.mlp.up_proj": Fp8ColwiseParallel(),
            f"{b}.mlp.down_proj": Fp8RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        })
    return plan


def _parallelize(model: Llama, tp_mesh: DeviceMesh, apply) -> Llama:
    tp = tp_mesh.size()
    _check(model, tp)
    tied = model.lm_head.weight is model.wte.weight
    apply(llama_plan(model))
    if tied:  # both styles shard the vocab rows (Shard(0)): one DTensor again
        model.lm_head.weight = model.wte.weight
    for block in model.blocks:
        block.attn.n_head //= tp  # the heads of this rank's q/k/v columns
        block.attn.n_kv_head //= tp
    return model


def llama_tensor_parallel(model: Llama, tp_mesh: DeviceMesh) -> Llama:
    """Tensor + sequence parallel over the 1-D `tp_mesh`, in place (a converted Llama; build the optimizer after).

    Every rank feeds the same (B, T) tokens, T a multiple of the TP size; logits and loss come out replicated.
    Raises ValueError if the heads (query or key/value), SwiGLU width or vocabulary do not split evenly, or with
    qk_norm.
    """
    return _parallelize(model, tp_mesh, lambda plan: apply_tensor_parallel(model, tp_mesh, plan))


def llama_2d(model: Llama, mesh: DeviceMesh, *, param_dtype: torch.dtype | None = None) -> Llama:
    """FSDP2 × TP over a 2-D `mesh` with dims ("dp", "tp"), in place: TP inside each dp group, then each block and
    the root sharded with `minifloat.distributed.fsdp.shard` along dp.

    The ranks of one TP group (one dp index) feed the same tokens; different dp indices feed different ones, whose
    gradients FSDP2 averages.
    """
    return _parallelize(model, mesh["tp"],
                        lambda plan: apply_2d(model, mesh, plan, units=list(model.blocks), param_dtype=param_dtype))
