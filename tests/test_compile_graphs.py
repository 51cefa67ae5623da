"""Whole graphs under torch.compile: a converted model is one graph, compiled once, however the steps go (issue 21).

`minifloat train --compile` (TrainConfig.compile) wraps the policy-applied reference Llama in torch.compile. Dynamo
must capture its forward whole (no graph breaks) and, once the first step has compiled it, never compile it again:
not for the next steps (scales, amax histories and the weight-cast generation change every step), and not after the
eager evaluations the trainer runs between steps. Two ways this failed:

* A graph break inside Fp8Linear.forward makes every FP8 layer a frame of its own, guarded on that layer's Python
  attributes (its name, the dtype its input arrives in): one recompile per layer, until dynamo's recompile_limit (8)
  leaves the rest eager for good (seen here with one forced break). Most likely what an H100 run of the compiled
  Llama (torch 2.11) hit: dynamo there broke the graph at torch.amp.is_autocast_available (now read outside the
  graph, minifloat.core.autocast).
* An eager forward between compiled steps recompiled the next ones twice: dynamo guarded on the absence of the FP8
  autocast's per-thread state (gone after the first `mf.autocast` block, the evaluation's) and on the layers'
  weight-cast caches (filled by eager forwards, emptied by each FP8 step).

The compiler backend is aot_eager inside a frame counter: dynamo's graph breaks and guards do not depend on the
backend (the trainer's Llama gave the same frames per step under inductor, before and after the fixes), and aot_eager
compiles in a fraction of inductor's time. Nothing here compares numbers: tests/test_compile.py does.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import minifloat as mf
from minifloat.training.loop import TrainConfig, train
from residual_mlp import MLP

STEPS = 6  # step 0 compiles; steps 1-5, with evaluations after steps 1, 3 and 5, must compile nothing
BACKEND = "aot_eager"
# the trainer's run: the tiny Llama on a small slice of the corpus, evaluated eagerly every other step
RUN = TrainConfig(model="tiny", preset="fp8-delayed", steps=STEPS, batch_size=4, seq_len=32, eval_every=2,
                  eval_batches=1, checkpoint_every=0, max_bytes=200_000, seed=0, compile=True, compile_scope="model")
# the whole-model scope (--compile-scope model; the default compiles by blocks, checked by default below): all under
# -m slow, ~15-20 s each on 2 cores
PRESETS = [pytest.param(p, marks=pytest.mark.slow)
           for p in ("fp8-delayed", "fp8-current", "fp8-block", "mxfp8", "nvfp4")]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def frames_per_call(monkeypatch) -> list[int]:
    """torch.compile of a module, as the trainer calls it, on a frame-counting backend: the returned list gets the
    number of frames compiled so far after each call of the compiled module (one call per micro-batch). Compiles of
    functions (minifloat's own kernels) pass through unchanged."""
    real_compile, frames = torch.compile, []

    def compile_(model, **options):
        if not isinstance(model, nn.Module):
            return real_compile(model, **options)
        counter = CompileCounterWithBackend(BACKEND)
        compiled = real_compile(model, backend=counter, **options)

        def call(*args, **kwargs):
            out = compiled(*args, **kwargs)
            frames.append(counter.frame_count)
            return out

        return call

    monkeypatch.setattr(torch, "compile", compile_)
    return frames


def assert_one_graph_compiled_once(frames: list[int]) -> None:
    graph_breaks = dict(counters["graph_break"])
    assert not graph_breaks, f"graph breaks: {graph_breaks}"
    assert frames[0] == 1, f"the first step compiled {frames[0]} frames (a graph break splits the forward)"
    assert frames == [1] * len(frames), f"frames compiled so far after each step: {frames} (recompiles)"


@pytest.mark.parametrize("preset", PRESETS)
def test_trainer_compiles_the_llama_once_in_one_graph(tmp_path, frames_per_call, preset):
    result = train(dataclasses.replace(RUN, preset=preset, out=str(tmp_path)), progress=False)
    assert len(result.losses) == STEPS and len(result.val_losses) == STEPS // 2
    assert len(frames_per_call) == STEPS
    assert_one_graph_compiled_once(frames_per_call)


def test_trainer_compiles_each_kind_of_block_once(tmp_path, monkeypatch):
    """--compile-scope blocks (the default): each block's forward is compiled on its own and the graph is reused by
    every block of the same structure; nothing compiles again after the first step (evaluations stay eager). The
    10m preset's six blocks under fp8-delayed are two kinds (the policy keeps some of the first block's
    projections in high precision), so two frames; a guard on a layer's own Python state (its name, say) compiled
    all six."""
    from minifloat.training import compiled

    real_compile, counter, frames = torch.compile, CompileCounterWithBackend(BACKEND), []

    def compile_(fn, **options):  # the blocks' compiles counted; minifloat's own kernels' pass through
        if getattr(fn, "__name__", "") != "forward":
            return real_compile(fn, **options)
        return real_compile(fn, backend=counter, **options)

    monkeypatch.setattr(torch, "compile", compile_)
    real_call = compiled.CompiledBlocks.__call__

    def call(self, *args, **kwargs):
        out = real_call(self, *args, **kwargs)
        frames.append(counter.frame_count)
        return out

    monkeypatch.setattr(compiled.CompiledBlocks, "__call__", call)
    config = dataclasses.replace(RUN, model="10m", batch_size=2, steps=4, compile_scope="blocks", out=str(tmp_path))
    result = train(config, progress=False)
    assert len(result.losses) == 4 and len(frames) == 4
    assert not dict(counters["graph_break"]), dict(counters["graph_break"])
    assert frames == [2] * 4, f"frames compiled so far after each step: {frames}"


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # the reentrant one's eager evaluation
# all under -m slow (the default suite's 10-minute budget): the trainer test above covers the same guards
@pytest.mark.parametrize("checkpoint", [pytest.param(None, marks=pytest.mark.slow),
                                        pytest.param("reentrant", marks=pytest.mark.slow),
                                        pytest.param("non-reentrant", marks=pytest.mark.slow)])
def test_converted_mlp_compiles_once_around_eager_evaluations(checkpoint):
    """mf.convert'ed layers compiled with fullgraph (and under activation checkpointing), an eager evaluation under
    mf.autocast after every step."""
    torch.manual_seed(0)
    model = mf.convert(MLP(64, 128, checkpoint=checkpoint), recipe=mf.DelayedScaling(), keep_first_last=False)
    counter = CompileCounterWithBackend(BACKEND)
    fn = torch.compile(model, backend=counter, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    frames = []
    for i in range(STEPS):
        x = (torch.randn(32, 64, generator=g) * (1 + i)).requires_grad_(checkpoint == "reentrant")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(x)
        (y.float() ** 2).mean().backward()
        opt.step()  # ends the FP8 step: new scales, the weight-cast caches emptied
        opt.zero_grad()
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), mf.autocast():
            model(x)  # eager, as the trainer's evaluation: fills the layers' weight-cast caches
        model.train()
        frames.append(counter.frame_count)
    assert_one_graph_compiled_once(frames)


def test_compiled_blocks_leave_the_model_eager_outside_the_call():
    """CompiledBlocks compiles each block's forward for its own call only: the results are the model's (the eager
    backend runs the same ops), and afterwards every block has its class's forward again (evaluation stays eager)."""
    from minifloat.training.compiled import CompiledBlocks
    from minifloat.training.model import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny", vocab_size=16))
    idx = torch.randint(16, (2, 8))
    forwards = []
    calls = CompiledBlocks(model, list(model.blocks), {"backend": "eager"})
    hook = model.blocks[1].register_forward_pre_hook(lambda m, args: forwards.append("forward" in vars(m)))
    try:
        got = calls(idx)
    finally:
        hook.remove()
    assert forwards == [True], "the block ran its class's forward inside the call"
    assert all("forward" not in vars(b) for b in model.blocks)
    assert torch.equal(got[0], model(idx)[0])  # (logits, loss)
