"""The state machinery of element-wise optimizers whose states are stored block-wise in low precision.

`BlockwiseOptimizer` keeps each state of each parameter in a `StateFormat` (optim/stateformats.py) and runs the
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

state_dict holds plain tensors only: codes (float8 / int8 / uint8), float32 per-block scales, the float32 step, so
minifloat's safetensors checkpoints store it. torch's load_state_dict casts floating states to the parameter's dtype;
this class casts them back to their stored dtypes, which is exact (float32 holds every code value).
"""

from __future__ import annotations

import dataclasses
import torch
from torch import nn

from minifloat.core.roles import is_embedding, is_norm
from minifloat.optim.stateformats import STATE_FORMATS, BlockCodec, StateFormat, code_dtype, round_plain

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
        if block_size < 2 or block_size % 2:
            raise ValueError(f"block_size must be an even number >= 2, got {block_size}")
        if chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
        if min_quantized_numel < 0:
            raise ValueError(f"min_quantized_numel must be >= 0, got {min_quantized_numel}")
        super().__init__(params, defaults)
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
        """Whether parameter p keeps float32 states by the rule in the module docstring."""
        return p.numel() < self.min_quantized_numel or id(p) in self._fp32_ids

    def formats_for(self, p: torch.Tensor) -> tuple[StateFormat, ...]:
        """The state formats parameter p uses."""
        return (StateFormat.FP32,) * len(self.STATES) if self.keeps_fp32_state(p) else self.state_formats

    def _codec(self, fmt: StateFormat, spec: StateSpec) -> BlockCodec | None:
        if not STATE_FORMATS[fmt].block_scaled:
            return None
        return BlockCodec(fmt, signed=not spec.non_negative, expand=self.expand)

    def _init_state(self, p: torch.Tensor) -> dict:
        state = {"step": torch.tensor(0.0)}
        n_blocks = -(-p.numel() // self.block_size)
        for spec, fmt in zip(self.STATES, self.formats_for(p)):
            codec = self._codec(fmt, spec)
            if codec is None:
                state[spec.name] = torch.zeros_like(p, dtype=code_dtype(fmt, signed=True),
                                                    memory_format=torch.contiguous_format)
            else:
                parts = codec.empty(n_blocks, self.block_size, p.device)
                state.update({spec.name + suffix: t for suffix, t in parts.items()})
        return state

    # ------------------------------------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step (skipped whole if a gradient is not finite; see the module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if self.check_finite and params:
            finite = torch.stack([torch.isfinite(p.grad).all() for p in params]).all()
            if not finite.item():
                self.skipped_steps += 1
                return loss
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state.update(self._init_state(p))
                state["step"] += 1
                self._step_param(group, p, state, state["step"].item())
        return loss

    def _step_param(self, group: dict, p: torch.Tensor, state: dict, step: float) -> None:
        work = p.detach() if p.dtype == torch.float32 and p.is_contiguous() else p.detach().float().contiguous()
        flat, grad = work.view(-1), p.grad.detach().reshape(-1)
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
        if work is not p.detach():
            p.detach().copy_(work)

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

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load_state_dict, then every stored state cast back to its format's dtype (exact)."""
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            if not state:
                continue
            for spec, fmt in zip(self.STATES, self.formats_for(p)):
                codes = code_dtype(fmt, signed=not spec.non_negative)
                state[spec.name] = state[spec.name].to(codes)
                for suffix in ("_scale", "_absmax", "_expo"):
                    if spec.name + suffix in state:
                        state[spec.name + suffix] = state[spec.name + suffix].float()

    # ------------------------------------------------------------------------------------------------ memory

    def state_bytes(self) -> int:
        """Bytes of every state tensor (codes, scales, step counters) held now."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor))

    def bytes_per_param(self) -> float:
        """state_bytes() per element of the parameters that have state (0.0 before the first step)."""
        n = sum(p.numel() for p in self.state if self.state[p])
        return self.state_bytes() / n if n else 0.0
