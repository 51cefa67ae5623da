"""A training forward under torch.compile by blocks or whole (`minifloat train --compile --compile-scope`, and
benchmarks/gpu.py's compiled runs)."""

from __future__ import annotations

import torch


def compile_forward(module: torch.nn.Module, mode: str = "default", scope: str = "blocks"):
    """`module`'s forward under torch.compile in `mode` (torch.compile's), the same parameters and buffers: with
    scope "blocks", each of its repeated blocks (`repeated_blocks`; `CompiledBlocks`), else, or where it has none,
    the whole module. What `minifloat train --compile` and benchmarks/gpu.py's compiled runs call."""
    options = {} if mode == "default" else {"mode": mode}
    blocks = repeated_blocks(module) if scope == "blocks" else []
    return CompiledBlocks(module, blocks, options) if blocks else torch.compile(module, **options)


def repeated_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks compiled one by one: a `blocks` ModuleList (the reference Llama's; under DDP, `module.module`'s),
    or the children of a Sequential of more than one module of one type; else none."""
    inner = getattr(module, "module", module)  # (DDP holds the model as .module)
    blocks = getattr(inner, "blocks", None)
    if isinstance(blocks, torch.nn.ModuleList) and len(blocks):
        return list(blocks)
    children = list(inner.children()) if isinstance(inner, torch.nn.Sequential) else []
    return children if len(children) > 1 and len({type(c) for c in children}) == 1 else []


class CompiledBlocks:
    """Calls `module` with each block running its compiled forward (regional compilation): dynamo compiles a block's
    code once and reuses the graph for every block of the same structure, where a whole FP8 model is one graph many
    times larger (the 6-block `10m` Llama under fp8-delayed: 334 s to compile whole on 2 CPU cores, 18 s by blocks).
    Only this call compiles: outside it (evaluation, the shadow check's BF16 pass) the blocks run eagerly, as they
    do under the whole model's compile. What is compiled is each block's `forward`, set as an instance attribute for
    the call and removed after: the module's hooks stay outside the graph (FSDP2's per-block gather runs before the
    compiled forward, as when a compiled block is sharded), and the backward of what the call computed is the
    compiled graph's either way."""

    def __init__(self, module: torch.nn.Module, blocks: list[torch.nn.Module], options: dict):
        self.module, self.blocks = module, blocks
        self.forwards = [torch.compile(block.forward, **options) for block in blocks]

    def __call__(self, *args, **kwargs):
        for block, forward in zip(self.blocks, self.forwards):
            block.forward = forward
        try:
            return self.module(*args, **kwargs)
        finally:
            for block in self.blocks:
                del block.forward  # the class's own again
