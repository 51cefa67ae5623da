"""torch.compile (CPU, inductor) of whole models with Fp8Linear layers inside, against eager.

A converted MLP compiles with `fullgraph=True` under every recipe and matches eager bitwise over several training
steps with growing inputs: outputs, gradients, weights and the scaling state, with no recompiles after the first
step. Bitwise needs inductor's `emulate_precision_casts` (scoped to the test): by default inductor keeps a fused
intermediate in fp32 where eager rounds it to bfloat16, for any bfloat16 model, FP8 or not.

The policy-applied reference Llama (fp32 islands, FP8 linears) compiles too and agrees with eager to the stated
tolerance: there the fp32 islands' own fusions reorder fp32 sums.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch._dynamo
import torch._inductor.config as inductor_config
from torch import nn

import minifloat as mf
from minifloat.training.model import Llama, LlamaConfig
from recipe_cases import RECIPES

STEPS = 4
DIM, HIDDEN, TOKENS = 128, 256, 64
# the recipe of the default suite (the stateful one); the others run with -m slow (a cold compile costs 15-40 s per
# model on 2 cores; mx, the one with every workaround, folded E8M0 scales and the transposed re-quantization, was in
# the default suite until its 35 s pushed a fresh clone's suite past 10 minutes: a compiled mx model still runs there
# in tests/test_nonfinite.py)
FAST = {"delayed"}
RECIPE_PARAMS = [pytest.param(r, id=n, marks=() if n in FAST else pytest.mark.slow) for n, r in RECIPES]
# Llama, compiled vs eager: the fp32 islands (RMSNorm, softmax, cross-entropy) reassociate fp32 sums under fusion,
# and a reassociated input flips a few E4M3 roundings downstream. Measured over 3 steps: loss ≤ 2e-3 relative;
# scales (fp8_max / amax, an amax being one extreme element) up to 4.1e-2
LLAMA_LOSS_RTOL = 1e-2
LLAMA_SCALE_RTOL = 0.1


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, DIM))
                                    for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def make(recipe) -> nn.Module:
    torch.manual_seed(0)
    return mf.convert(MLP(), recipe=recipe, keep_first_last=False)


def step(model, fn, opt, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fn(x)
    (y.float() ** 2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    return y.detach(), grads


@pytest.mark.parametrize("recipe", RECIPE_PARAMS)
def test_compiled_mlp_is_bitwise_eager_with_one_graph(recipe):
    eager, compiled = make(recipe), make(recipe)
    fn = torch.compile(compiled, fullgraph=True)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, compiled)]
    g = torch.Generator().manual_seed(1)
    with inductor_config.patch(emulate_precision_casts=True):
        for i in range(STEPS):
            x = torch.randn(TOKENS, DIM, generator=g) * (1 + i)  # growing: delayed scales move every step
            if i == 1:  # step 0 compiled forward and backward; from here on nothing may recompile
                guard = torch._dynamo.config.patch(error_on_recompile=True)
                guard.__enter__()
            y_e, g_e = step(eager, eager, opts[0], x)
            y_c, g_c = step(compiled, fn, opts[1], x)
            assert torch.equal(y_e, y_c), i
            for a, b in zip(g_e, g_c):
                assert torch.equal(a, b), i
        guard.__exit__(None, None, None)
    state_e, state_c = eager.state_dict(), compiled.state_dict()
    for key in state_e:  # weights and scaling state
        assert torch.equal(state_e[key], state_c[key]), key


# The 4-bit recipes under fullgraph compile: NVFP4's stochastic-rounding seeds come from the layers' buffers
# (counter_seed), so nothing breaks the graph, and the compiled run is bitwise eager, RHT and SR included. Slow tier:
# from cold compile caches (a clean CI machine) the nvfp4 case took 101 s on 2 cores (15 s warm); the default suite
# keeps NVFP4's compiled kernels against their eager twins (tests/test_fp4_numerics.py)
@pytest.mark.slow
@pytest.mark.parametrize("recipe", [pytest.param(mf.NVFP4Scaling(), id="nvfp4"),
                                    pytest.param(mf.MXScaling(format="e2m1"), id="mxfp4")])
def test_compiled_4bit_mlp_is_bitwise_eager_with_one_graph(recipe):
    test_compiled_mlp_is_bitwise_eager_with_one_graph(recipe)  # weights, grads and the whole state, sr_draws too


@pytest.mark.slow
def test_compiled_eval_forward_records_nothing():
    model = make(mf.DelayedScaling())
    fn = torch.compile(model, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, fn, opt, torch.randn(TOKENS, DIM))
    before = {k: v.clone() for k, v in model.state_dict().items() if "fp8_state" in k}
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fn(torch.randn(TOKENS, DIM) * 100)
    for key, value in before.items():
        assert torch.equal(model.state_dict()[key], value), key


def llama_step(model, call, opt, tokens) -> float:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = call(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


@pytest.mark.slow  # 68 s of compiling on 2 cores; the default suite keeps the trainer's one-graph Llama
@pytest.mark.parametrize("preset", ["fp8-delayed", "fp8-current"])  # (test_compile_graphs) and the bitwise MLPs
def test_compiled_policy_llama_matches_eager(preset):
    """The reference Llama under PrecisionPolicy.apply (fp32 islands, FP8 linears), compiled without fullgraph."""
    config = LlamaConfig(vocab_size=256, n_layer=2, n_head=4, d_model=128, d_ff=256, max_seq_len=64)

    def build():
        torch.manual_seed(0)
        return mf.PrecisionPolicy.preset(preset).apply(Llama(config))

    eager, compiled = build(), build()
    fn = torch.compile(compiled)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, compiled)]
    g = torch.Generator().manual_seed(2)
    with inductor_config.patch(emulate_precision_casts=True):
        for _ in range(3):
            tokens = torch.randint(0, 256, (4, 65), generator=g)
            eager_loss = llama_step(eager, eager, opts[0], tokens)
            compiled_loss = llama_step(compiled, fn, opts[1], tokens)
            assert compiled_loss == pytest.approx(eager_loss, rel=LLAMA_LOSS_RTOL)
    scales = [(k, a, compiled.state_dict()[k]) for k, a in eager.state_dict().items()
              if k.endswith("fp8_state.scale")]
    assert scales
    for key, a, b in scales:
        torch.testing.assert_close(b, a, rtol=LLAMA_SCALE_RTOL, atol=0, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["fp8-delayed", "nvfp4"])
def test_train_with_compile_follows_eager(tmp_path, preset):
    """`minifloat train --compile` (TrainConfig.compile): the compiled trainer's losses follow eager's. (One graph,
    compiled once, under every preset nvfp4 included: tests/test_compile_graphs.py.)"""
    from minifloat.training.loop import TrainConfig, train

    base = TrainConfig(model="tiny", preset=preset, steps=4, batch_size=4, seq_len=32, eval_every=4,
                       eval_batches=1, checkpoint_every=0, max_bytes=200_000, seed=0)
    eager = train(dataclasses.replace(base, out=str(tmp_path / "eager")), progress=False)
    compiled = train(dataclasses.replace(base, out=str(tmp_path / "compiled"), compile=True), progress=False)
    assert len(compiled.losses) == 4 and not compiled.skipped
    for e, c in zip(eager.losses, compiled.losses):
        assert c == pytest.approx(e, rel=LLAMA_LOSS_RTOL)


DYNAMIC_BATCHES = (32, 48, 40)  # the second shape makes dynamo trace again with a symbolic batch, the third reuses it


@pytest.mark.slow  # three compiles of forward and backward per recipe: about 5 minutes for mx on 2 cores
@pytest.mark.parametrize("recipe", [pytest.param(r, id=n) for n, r in RECIPES])
def test_compiled_model_follows_eager_across_batch_sizes(recipe):
    # torch.compile's default (dynamic=None) traces a second batch size with a symbolic batch; under MX the third
    # failed in the compiled backward with inductor's assert_size_stride (a saved operand's stride fixed at 48)
    eager, compiled = make(recipe), make(recipe)
    fn = torch.compile(compiled)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, compiled)]
    g = torch.Generator().manual_seed(1)
    with inductor_config.patch(emulate_precision_casts=True):
        for i, batch in enumerate(DYNAMIC_BATCHES):
            x = torch.randn(batch, DIM, generator=g)
            y_c, g_c = step(compiled, fn, opts[1], x)
            y_e, g_e = step(eager, eager, opts[0], x)
            assert torch.equal(y_c, y_e), f"batch {batch}: outputs differ"
            for k, (a, b) in enumerate(zip(g_c, g_e)):
                assert torch.equal(a, b), f"batch {batch}: gradient {k} differs"
