"""FP8 layers under a CUDA graph's capture take nothing from a Python-side cache (minifloat.core.capture).

A replay re-runs the captured kernels without the Python that chose them, so whatever a capture took from a host cache
(the step's weight cast, a delayed scale's reciprocals, a sibling's input cast made before the capture) would be
frozen into every replay. The CPU twin (`pretend_capture`) runs the capture's code path on the CPU: it must give the
bits of plain eager execution, and read no cache even when the cache holds stale values; a delayed layer that would
need a host read to seed its scales refuses in one line naming the layer and the fix. The real capture and replay
run in the GPU tier (tests/test_gpu_training.py).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch import nn

import minifloat as mf
from minifloat.core.capture import capturing, pretend_capture
from minifloat.fp8 import caster as caster_module
from minifloat.fp8 import shared_input
from minifloat.numerics.compiling import eager_kernels
from residual_mlp import MLP

DIM, HIDDEN, TOKENS, STEPS = 64, 128, 32, 3
RECIPES = [("delayed", mf.DelayedScaling()), ("current", mf.CurrentScaling()),
           ("row", mf.CurrentScaling(granularity="row")), ("block", mf.BlockScaling()), ("mx", mf.MXScaling())]


@pytest.fixture(autouse=True)
def _eager():
    shared_input.forget()
    with eager_kernels():
        yield


def make_model(recipe) -> nn.Module:
    torch.manual_seed(0)
    return mf.convert(MLP(DIM, HIDDEN), recipe=recipe, keep_first_last=False)


def batch(i: int) -> torch.Tensor:
    return torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(i)) * (1 + i)


def test_capturing_is_false_off_cuda_and_true_when_pretended():
    assert not capturing("cpu")
    with pretend_capture():
        assert capturing("cpu")
    assert not capturing("cpu")


def _train(recipe, captured_steps: set[int]):
    """STEPS AdamW steps; forward and backward of the steps in `captured_steps` run as under a capture."""
    model = make_model(recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outputs = []
    for i in range(STEPS):
        with pretend_capture() if i in captured_steps else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = model(batch(i))
            (y.float() ** 2).sum().backward()
        outputs.append(y.detach())
        opt.step()
        opt.zero_grad()
    return outputs, model.state_dict()


@pytest.mark.parametrize("name,recipe", RECIPES, ids=[n for n, _ in RECIPES])
def test_the_capture_path_gives_eagers_bits(name, recipe):
    """After an eager first step (which seeds delayed scales), steps run as under capture give the same outputs,
    weights and scaling state as plain eager steps."""
    outputs, state = _train(recipe, captured_steps={1, 2})
    ref_outputs, ref_state = _train(recipe, captured_steps=set())
    for a, b in zip(outputs, ref_outputs):
        assert torch.equal(a, b)
    for key, value in ref_state.items():
        assert torch.equal(state[key], value), key


def _stale_caches(model: nn.Module) -> None:
    """Make every host cache of the model's FP8 layers hold wrong values under keys that still match: the delayed
    scales' reciprocals doubled, the weight casts' scales doubled. Eager forwards read them (the test checks), a
    capture must not."""
    for layer in mf.fp8_layers(model):
        state = layer.fp8_state
        if state._reciprocals is not None:
            key, pairs = state._reciprocals
            state._reciprocals = (key, [(inverse * 2, multiplier / 2) for inverse, multiplier in pairs])
        for kind, (key, q) in list(layer._weights._entries.items()):
            layer._weights._entries[kind] = (key, dataclasses.replace(q, scale=q.scale * 2))


def _forward(model, x):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x)


@pytest.mark.parametrize("name,recipe", RECIPES[:2], ids=[n for n, _ in RECIPES[:2]])
def test_a_capture_reads_no_host_cache(name, recipe):
    model = make_model(recipe)
    x = batch(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a training step: seeds the scales, fills the caches
        (model(x).float() ** 2).sum().backward()
    with torch.enable_grad():  # (the weight cache serves forwards with autograd on)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            good = model(x).detach()
        _stale_caches(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            stale = model(x).detach()
        with pretend_capture(), torch.autocast("cpu", dtype=torch.bfloat16):
            captured = model(x).detach()
    assert not torch.equal(stale, good)  # eager forwards do read the caches (so the check below means something)
    assert torch.equal(captured, good)


def test_a_capture_before_delayed_scales_are_seeded_is_refused_in_one_line():
    model = make_model(mf.DelayedScaling())
    with pretend_capture(), pytest.raises(RuntimeError) as info, torch.autocast("cpu", dtype=torch.bfloat16):
        model(batch(0))
    message = str(info.value)
    assert "\n" not in message and "blocks.0" in message and "run one training step eagerly" in message


def test_a_capture_takes_no_sibling_cast_made_before_it(monkeypatch):
    """The graph's static input, cast by a warm-up step, must be cast again inside the capture: a replay of a graph
    that took the warm-up's cast would multiply the warm-up's values forever."""
    torch.manual_seed(0)
    layer = mf.convert(nn.Linear(DIM, DIM, bias=False), recipe=mf.CurrentScaling(), keep_first_last=False)
    x = batch(0)
    calls = []
    original = caster_module.quantize
    monkeypatch.setattr(caster_module, "quantize", lambda *a, **k: calls.append(a[0].shape) or original(*a, **k))
    with torch.no_grad():
        layer(x)
        warm = len(calls)
        layer(x)  # eager: the same tensor again takes the entry (no input cast)
        assert len(calls) == warm + 1  # the weight's cast only (no cache without autograd)
        with pretend_capture():
            layer(x)
    assert len(calls) == warm + 1 + 2  # under capture: the input cast again, and the weight's


# the trainer's presets (bf16 too: the baseline benchmarks/gpu.py --cuda-graphs captures beside them)
PRESETS = ["bf16", "fp8-delayed", "fp8-current", "fp8-block", "mxfp8", "nvfp4", "mxfp4"]


@pytest.mark.parametrize("preset", PRESETS)
def test_the_captured_llama_step_reads_nothing_on_the_host(preset):
    """What benchmarks/gpu.py --cuda-graphs captures (the reference Llama under a PrecisionPolicy preset: fp32 norms,
    attention, head and loss; forward and backward) makes, on the capture's code path after a warm-up step, no read
    of a tensor on the host but the CPU-only non-finite checks: on a GPU any other would stop the capture."""
    from host_syncs import CPU_ONLY_READS, HostSyncs
    from minifloat.training.model import Llama, LlamaConfig

    torch.manual_seed(0)
    model = mf.PrecisionPolicy.preset(preset).apply(Llama(LlamaConfig(n_layer=2, n_head=4, d_model=64,
                                                                      max_seq_len=32, attention="fp32")))
    idx = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            loss = model(idx[:, :-1], idx[:, 1:])[1]
        loss.backward()

    step()  # warm-up: seeds delayed scales, sets the host mirrors
    model.zero_grad(set_to_none=True)
    with pretend_capture(), HostSyncs() as syncs:
        step()
    assert not {site: n for site, n in syncs.sites.items() if site not in CPU_ONLY_READS}
