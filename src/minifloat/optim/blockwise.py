"""The state machinery of element-wise optimizers whose states are stored block-wise in low precision.

`BlockwiseOptimizer` keeps each state of each parameter in a `StateFormat` (numerics/stateformats.py) and runs the
update chunk by chunk: decode a chunk of every state to float32, apply the optimizer's element-wise rule in float32
in place, encode the chunk back. A chunk is `chunk_blocks` whole blocks, so the float32 temporaries stay bounded
whatever the parameter's size. Subclasses name their states and write the rule (optim/optimizers.py).

Which parameters keep float32 states (the bitsandbytes rule): parameters with fewer than `min_quantized_numel`
elements, and, when the `model` is given, the parameters of norm and embedding modules (minifloat.core.roles; a head
tied to an embedding shares its weight, so it is included). Quantizing these saves little memory and costs accuracy:
norm gains and embedding rows see sparse or tiny gradients whose moments a shared block scale would flush to zero.

Non-finite gradients: if any gradient of the step holds an inf or NaN, the whole step is skipped — no parameter, state
or step count changes — and `skipped_steps` counts it. A step is all or nothing, as with minifloat's LossScaler and
StepGuard, which normally drop such steps before the optimizer runs (then this check finds nothing to do). The check
costs one pass over the gradients and one host sync per step; `check_finite=False` leaves it to those guards.

state_dict holds plain tensors only (DTensors for sharded parameters, below): codes (float8 / int8 / uint8), float32
per-block scales, the float32 step, so minifloat's safetensors checkpoints store it. torch's load_state_dict casts
floating states to the parameter's dtype; this class loads the saved tensors again in their own dtypes (for bf16
parameters torch's cast would have rounded float32 states and scales), then casts codes to their format's dtype.

Sharded parameters (FSDP2's fully_shard: DTensors, a row shard per rank). The states are plain tensors local to the
rank: the blocks are formed over the flattened local shard (`p.to_local()`, its gradient likewise), and nothing is
gathered. The ranks communicate only to decide alike: the fp32-by-rule counts the global numel, the non-finite skip
is a MIN over the mesh, and when a state is created every rank allocates the block count of the largest shard (a MAX
over the mesh; FSDP2 pads its own shards the same way), so that a state is one evenly sharded tensor. `state_dict()`
presents them as DTensors on the parameter's mesh, as torch.distributed.checkpoint (DCP) needs to write every rank's
part of a key (it takes a plain tensor for a replicated one and writes one rank's copy): parameter-shaped states
(fp32, bf16) with the parameter's placements, which DCP reshards; block-wise codes and scales as one
(n_shards · n_blocks, ...) tensor, Shard(0) over the mesh dimensions the parameter is split over. Blocks never cross
a shard boundary, so they depend on the sharding (they are one process's only where every shard starts at a multiple
of `block_size`), and block-wise states load correctly only under the sharding that wrote them (`block_layout`,
checked by minifloat.training.sharded). `load_state_dict` takes DTensors or plain tensors and keeps the local shard.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from minifloat.core.roles import is_embedding, is_norm
from minifloat.core.skip import warn_skipped
from minifloat.core.validate import check_bool, check_int, check_module
from minifloat.fp8 import step as fp8_step
from minifloat.numerics.stateformats import STATE_FORMATS, BlockCodec, StateFormat, code_dtype, round_plain

DEFAULT_BLOCK = 128
DEFAULT_MIN_QUANTIZED_NUMEL = 4096  # bitsandbytes' min_8bit_size
DEFAULT_CHUNK_BLOCKS = 8192  # 1 Mi elements per chunk at block 128: a few MiB of float32 temporaries


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """One state of an optimizer: its name and whether it is never negative (unsigned codes)."""

    name: str
    non_negative: bool = False


def fp32_state_param_ids(model: nn.Module) -> set[int]:
    """ids of the parameters of `model`'s norm and embedding modules (which keep float32 states)."""
    return {id(p) for m in model.modules() if is_norm(m) or is_embedding(m) for p in m.parameters(recurse=False)}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters and gradients), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _reduce_over_mesh(t: torch.Tensor, mesh, op: dist.ReduceOp) -> torch.Tensor:
    """`t` reduced in place over every rank of a device mesh (one all-reduce per mesh dimension)."""
    for dim in range(mesh.ndim):
        dist.all_reduce(t, op=op, group=mesh.get_group(dim))
    return t


def _shard_dims(p: DTensor) -> list[int]:
    """The mesh dimensions p is split over (Shard, or FSDP2-over-TP's _StridedShard: any placement but Replicate)."""
    return [d for d, pl in enumerate(p.placements) if not pl.is_replicate()]


def _meshes(params: list[torch.Tensor]) -> list:
    """The distinct device meshes of the DTensor parameters among `params`, in order."""
    return list({id(p.device_mesh): p.device_mesh for p in params if isinstance(p, DTensor)}.values())


FORMATS_KEY = "minifloat_state_formats"  # in each saved param group: the formats its states were stored in


class BlockwiseOptimizer(torch.optim.Optimizer):
    """Base class: states stored per `state_formats`, updated chunk-wise in float32.

    Subclasses set STATES (a tuple of StateSpec, one format each in `state_formats`) and implement `update_chunk`.

    Args:
        params: parameters or parameter groups.
        defaults: the optimizer's hyperparameters.
        state_formats: one StateFormat (or its string) per state, in STATES order; a single value applies to all.
        block_size: elements per scale block (even, for int4).
        expand: COAT dynamic range expansion of block-scaled states.
        min_quantized_numel: parameters with fewer elements keep float32 states.
        model: if given, the parameters of its norms and embeddings keep float32 states.
        chunk_blocks: blocks per update chunk (bounds the float32 temporaries).
        check_finite: skip a step whose gradients are not all finite.
    """

    STATES: tuple[StateSpec, ...] = ()

    def __init__(self, params, defaults: dict, *, state_formats, block_size: int = DEFAULT_BLOCK,
                 expand: bool = False, min_quantized_numel: int = DEFAULT_MIN_QUANTIZED_NUMEL,
                 model: nn.Module | None = None, chunk_blocks: int = DEFAULT_CHUNK_BLOCKS,
                 check_finite: bool = True):
        if isinstance(state_formats, (str, StateFormat)):
            state_formats = (state_formats,) * len(self.STATES)
        state_formats = tuple(StateFormat.parse(f, field="state_formats") for f in state_formats)
        if len(state_formats) != len(self.STATES):
            raise ValueError(f"state_formats needs {len(self.STATES)} entries "
                             f"({', '.join(s.name for s in self.STATES)}), got {len(state_formats)}")
        check_int("block_size", block_size, low=2)
        if block_size % 2:
            raise ValueError(f"block_size must be an even int >= 2, got {block_size}")
        check_int("chunk_blocks", chunk_blocks, low=1)
        check_int("min_quantized_numel", min_quantized_numel, low=0)
        check_bool("expand", expand)
        check_bool("check_finite", check_finite)
        check_module(type(self).__name__, model, allow_none=True)
        super().__init__(params, defaults)
        if bad := [p for g in self.param_groups for p in g["params"] if not p.is_floating_point()]:
            raise ValueError(f"{type(self).__name__}: params must be floating-point tensors, got {bad[0].dtype}")
        self.state_formats = state_formats
        self.block_size = block_size
        self.expand = expand
        self.min_quantized_numel = min_quantized_numel
        self.chunk_blocks = chunk_blocks
        self.check_finite = check_finite
        self.skipped_steps = 0
        self._fp32_ids = fp32_state_param_ids(model) if model is not None else set()

    # ------------------------------------------------------------------------------------------------ the rule

    def update_chunk(self, group: dict, param: torch.Tensor, grad: torch.Tensor, states: list[torch.Tensor],
                     step: float) -> None:
        """Apply the optimizer's rule in place to float32 1-D chunks of the parameter and its states."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------------ formats

    def keeps_fp32_state(self, p: torch.Tensor) -> bool:
        """Whether parameter p keeps float32 states by the rule in the module docstring (on the global numel of a
        sharded parameter, so that every rank decides alike)."""
        return p.numel() < self.min_quantized_numel or id(p) in self._fp32_ids

    def formats_for(self, p: torch.Tensor) -> tuple[StateFormat, ...]:
        """The state formats parameter p uses."""
        return (StateFormat.FP32,) * len(self.STATES) if self.keeps_fp32_state(p) else self.state_formats

    def _codec(self, fmt: StateFormat, spec: StateSpec) -> BlockCodec | None:
        if not STATE_FORMATS[fmt].block_scaled:
            return None
        return BlockCodec(fmt, signed=not spec.non_negative, expand=self.expand)

    def _block_scaled(self, p: torch.Tensor) -> bool:
        return any(STATE_FORMATS[fmt].block_scaled for fmt in self.formats_for(p))

    def _init_states(self, params: list[torch.Tensor]) -> None:
        """Create the states of `params` (a collective when some are DTensors with block-wise states: every rank
        allocates the block count of the largest shard, see the module docstring)."""
        n_blocks = {p: -(-_local(p).numel() // self.block_size) for p in params}
        blocked = [p for p in params if self._block_scaled(p)]
        for mesh in _meshes(blocked):
            on_mesh = [p for p in blocked if isinstance(p, DTensor) and p.device_mesh is mesh]
            counts = torch.tensor([n_blocks[p] for p in on_mesh], device=_local(on_mesh[0]).device)
            for p, n in zip(on_mesh, _reduce_over_mesh(counts, mesh, dist.ReduceOp.MAX).tolist()):
                n_blocks[p] = n
        for p in params:
            local = _local(p)
            state = {"step": torch.tensor(0.0)}
            for spec, fmt in zip(self.STATES, self.formats_for(p)):
                codec = self._codec(fmt, spec)
                if codec is None:
                    state[spec.name] = torch.zeros(local.shape, dtype=code_dtype(fmt, signed=True),
                                                   device=local.device)
                else:
                    # one block at least: packing int4 codes cannot reshape 0 blocks (an empty shard); cut to n
                    parts = codec.empty(max(n_blocks[p], 1), self.block_size, local.device)
                    state.update({spec.name + suffix: t[: n_blocks[p]] for suffix, t in parts.items()})
            self.state[p].update(state)

    # ------------------------------------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step (skipped whole if a gradient is not finite; see the module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if any(p.grad.is_sparse for p in params):
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        if self.check_finite and params and not self._all_finite(params):
            self.skipped_steps += 1
            warn_skipped(type(self).__name__, self.skipped_steps)
            fp8_step.step_skipped(self)  # the FP8 step goes on into the next optimizer step
            return loss
        self._init_states([p for p in params if not self.state[p]])
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] += 1
                self._step_param(group, p, state, state["step"].item())
        return loss

    def _all_finite(self, params: list[torch.Tensor]) -> bool:
        """Whether every gradient is finite; over all ranks of a sharded model (each rank sees its shards)."""
        finite = torch.stack([torch.isfinite(_local(p.grad)).all() for p in params]).all().float()
        for mesh in _meshes(params):
            _reduce_over_mesh(finite, mesh, dist.ReduceOp.MIN)
        return bool(finite.item())

    def _step_param(self, group: dict, p: torch.Tensor, state: dict, step: float) -> None:
        local = _local(p).detach()  # the rank's shard of a DTensor: its blocks are the rank's own
        work = local if local.dtype == torch.float32 and local.is_contiguous() else local.float().contiguous()
        flat, grad = work.view(-1), _local(p.grad).detach().reshape(-1)
        formats = self.formats_for(p)
        codecs = [self._codec(fmt, spec) for fmt, spec in zip(formats, self.STATES)]
        n, chunk = flat.numel(), self.chunk_blocks * self.block_size
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            blocks = slice(start // self.block_size, -(-end // self.block_size))
            states = [self._read(state, spec, codec, start, end, blocks)
                      for spec, codec in zip(self.STATES, codecs)]
            self.update_chunk(group, flat[start:end], grad[start:end].float(), states, step)
            for spec, codec, fmt, x in zip(self.STATES, codecs, formats, states):
                self._write(state, spec, codec, fmt, start, end, blocks, x)
        if work is not local:
            local.copy_(work)

    def _read(self, state: dict, spec: StateSpec, codec: BlockCodec | None, start: int, end: int,
              blocks: slice) -> torch.Tensor:
        if codec is None:  # fp32 states: a view, updated in place; bf16: a float32 copy
            return state[spec.name].view(-1)[start:end].float()
        parts = {suffix: state[spec.name + suffix][blocks] for suffix in codec.suffixes}
        return codec.decode(parts).reshape(-1)[: end - start]

    def _write(self, state: dict, spec: StateSpec, codec: BlockCodec | None, fmt: StateFormat, start: int,
               end: int, blocks: slice, x: torch.Tensor) -> None:
        if codec is None:
            dest = state[spec.name].view(-1)[start:end]
            if x.data_ptr() != dest.data_ptr():
                dest.copy_(round_plain(x, fmt))
            return
        padded = torch.zeros((blocks.stop - blocks.start) * self.block_size, device=x.device)
        padded[: end - start] = x
        for suffix, t in codec.encode(padded.view(-1, self.block_size)).items():
            state[spec.name + suffix][blocks] = t

    # ------------------------------------------------------------------------------------------------ state_dict

    def state_dict(self) -> dict:
        """torch's state_dict; the states of DTensor parameters as DTensors (see the module docstring)."""
        out = super().state_dict()
        for group in out["param_groups"]:  # checked on load: codes read in another format are other numbers
            group[FORMATS_KEY] = [f.value for f in self.state_formats]
        params = [p for g in self.param_groups for p in g["params"]]
        out["state"] = {i: self._dtensor_states(params[i], s) if s and isinstance(params[i], DTensor) else s
                        for i, s in out["state"].items()}
        return out

    def _dtensor_states(self, p: DTensor, state: dict) -> dict:
        """The states of sharded parameter p as DTensors viewing the local ones: parameter-shaped states with p's
        placements; block-wise tensors (n_blocks, ...) per rank as one (n_shards · n_blocks, ...) Shard(0) tensor."""
        mesh, out = p.device_mesh, dict(state)
        split = _shard_dims(p)
        blocks = [Shard(0) if d in split else Replicate() for d in range(mesh.ndim)]
        n_shards = math.prod(mesh.size(d) for d in split)
        for spec, fmt in zip(self.STATES, self.formats_for(p)):
            codec = self._codec(fmt, spec)
            if codec is None:
                out[spec.name] = DTensor.from_local(state[spec.name], mesh, p.placements, run_check=False,
                                                    shape=p.shape, stride=p.stride())
                continue
            for key in (spec.name + suffix for suffix in codec.suffixes):
                t = state[key]
                out[key] = DTensor.from_local(t, mesh, blocks, run_check=False, stride=t.stride(),
                                              shape=(n_shards * t.shape[0], *t.shape[1:]))
        return out

    def block_layout(self) -> list[str | None]:
        """Per parameter (param_groups order), how its block-wise states are split into shard-local blocks, in
        words: whole (one process, DDP) or the shards of a DTensor parameter (FSDP2); None where every state is
        parameter-shaped (fp32, bf16: DCP reshards those). Block-wise states load correctly only into their layout."""
        def layout(p):
            if not self._block_scaled(p):
                return None
            if not isinstance(p, DTensor):
                return "whole parameters (one process or DDP)"
            n = math.prod(p.device_mesh.size(d) for d in _shard_dims(p))
            return (f"{n} shards per parameter (mesh {tuple(p.device_mesh.shape)}, "
                    f"{', '.join(repr(pl) for pl in p.placements)})")
        return [layout(p) for g in self.param_groups for p in g["params"]]

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load_state_dict (DTensor states as their local shards), then every stored state cast back to its
        format's dtype (exact)."""
        local = {i: {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                 for i, s in state_dict["state"].items()}
        mine = [f.value for f in self.state_formats]
        for group in state_dict["param_groups"]:
            saved = group.get(FORMATS_KEY)  # None: saved before the formats were recorded (the keys are checked)
            if saved is not None and list(saved) != mine:
                raise ValueError(f"this {type(self).__name__} stores its states as {','.join(mine)}, the state loaded "
                                 f"was saved as {','.join(saved)}: its codes would be read as other numbers. Build the "
                                 f"optimizer with state_formats={tuple(saved)!r} to load it")
        groups = [{k: v for k, v in g.items() if k != FORMATS_KEY} for g in state_dict["param_groups"]]
        super().load_state_dict({**state_dict, "state": local, "param_groups": groups})
        # torch cast every floating state to its parameter's dtype: for bf16 parameters that rounded fp32 states
        # and scales to bf16. Take the saved tensors again, in their own dtypes.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for i, p in zip(saved_ids, [p for g in self.param_groups for p in g["params"]]):
            for key, value in local.get(i, {}).items():
                if isinstance(value, torch.Tensor) and key in self.state[p]:
                    self.state[p][key] = value.to(device=self.state[p][key].device, copy=True)
        for p, state in self.state.items():
            if not state:
                continue
            for spec, fmt in zip(self.STATES, self.formats_for(p)):
                codes = code_dtype(fmt, signed=not spec.non_negative)
                state[spec.name] = state[spec.name].to(codes)
                for suffix in ("_scale", "_absmax", "_expo"):
                    if spec.name + suffix in state:
                        state[spec.name + suffix] = state[spec.name + suffix].float()
            self._check_keys(p, state)
            self._check_shapes(p, state)

    def _check_keys(self, p: torch.Tensor, state: dict) -> None:
        """A loaded state must hold what p's formats store (codes and their scales), nothing of another format's."""
        want = {"step"}
        for spec, fmt in zip(self.STATES, self.formats_for(p)):
            codec = self._codec(fmt, spec)
            want |= {spec.name} if codec is None else {spec.name + suffix for suffix in codec.suffixes}
        if set(state) != want:
            formats = ",".join(f.value for f in self.formats_for(p))
            raise ValueError(f"the loaded state of a parameter of shape {tuple(_local(p).shape)} holds "
                             f"{sorted(state)}, where state formats {formats} store {sorted(want)}: it was saved "
                             f"with other state formats")

    def _check_shapes(self, p: torch.Tensor, state: dict) -> None:
        """Loaded states must fit p's (local) shape: a state of another sharding fails here, not in a later step."""
        local = _local(p)
        for spec, fmt in zip(self.STATES, self.formats_for(p)):
            t, codec = state[spec.name], self._codec(fmt, spec)
            if codec is None:
                fits = t.shape == local.shape
            else:  # a shard's blocks: padded to the largest shard's count, so at least its own
                n_blocks = -(-local.numel() // self.block_size)
                row = codec.empty(1, self.block_size, t.device)[""].shape[1:]
                fits = t.shape[1:] == row and (t.shape[0] >= n_blocks if isinstance(p, DTensor) else
                                               t.shape[0] == n_blocks)
            if not fits:
                raise ValueError(f"the loaded {spec.name} state of a parameter of shape {tuple(local.shape)} has "
                                 f"shape {tuple(t.shape)} ({fmt}, block {self.block_size}): it was saved for "
                                 f"another parameter, sharding or block size")

    # ------------------------------------------------------------------------------------------------ memory

    def state_bytes(self) -> int:
        """Bytes of every state tensor (codes, scales, step counters) held now."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor))

    def bytes_per_param(self) -> float:
        """state_bytes() per element of the parameters that have state (0.0 before the first step)."""
        n = sum(_local(p).numel() for p in self.state if self.state[p])
        return self.state_bytes() / n if n else 0.0
