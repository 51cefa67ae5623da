"""The trainer's training forward under torch.compile (`--compile`), by blocks or whole (`--compile-scope`)."""

from __future__ import annotations

import torch


def compiled_forward(module: torch.nn.Module, config):
    """The training forward of `module` under torch.compile in the config's mode and scope (the same parameters and
    buffers): the whole module, or (scope "blocks") each of the Llama's blocks (`CompiledBlocks`)."""
    options = {} if config.compile_mode == "default" else {"mode": config.compile_mode}
    blocks = getattr(getattr(module, "module", module), "blocks", None)  # (DDP holds the model as .module)
    if config.compile_scope == "model" or not isinstance(blocks, torch.nn.ModuleList) or not len(blocks):
        return torch.compile(module, **options)
    return CompiledBlocks(module, list(blocks), options)


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
