"""GPU tier: the FP8 step contract, torch.compile, optimizer states and master weights on the device.

The step contract of tests/test_step.py, on device tensors: K micro-batches record the max of their amaxes and advance
the scales once per optimizer step; activation checkpointing (reentrant and not) leaves weights and scaling state bit
for bit as without it; a compiled model is eager bit for bit (tests/test_compile.py's test). The low-precision
optimizer states (minifloat.optim) and the master-weight modes (fp32 masters, bf16 with stochastic rounding or Kahan
compensation) step device tensors as they step CPU tensors.

The device and the switch: tests/gpu_device.py (MINIFLOAT_GPU_TESTS_DEVICE=cpu runs the tier without a GPU).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo
import torch._inductor.config as inductor_config
from torch import nn

import minifloat as mf
from gpu_device import device  # noqa: F401  (the module's device fixture)
from gpu_device import (RECIPE_BY_NAME, RECIPE_NAMES, assert_same_bits, assert_same_state, autocast, fp8_state)
from host_syncs import CPU_ONLY_READS, WARMUP, HostSyncs, make_step
from minifloat.amp.lowp_weights import LowPrecisionWeightOptimizer
from minifloat.amp.master import MasterWeightOptimizer
from minifloat.numerics.compiling import eager_kernels
from minifloat.optim import SGD, AdamW, Lion
from residual_mlp import MLP

pytestmark = pytest.mark.gpu

SEED = 0
DIM, HIDDEN, TOKENS = 256, 512, 128  # activations of 32768+ elements: the device runs minifloat's compiled kernels
STEPS = 3
MICRO = 4
RECIPE_PARAMS = pytest.mark.parametrize("name", RECIPE_NAMES)
# compile costs a cold inductor/Triton compile per model (on an H100: delayed 39 s, MX 59 s, NVFP4 17 s with graph
# breaks); by default the stateful recipe and the 4-bit one with stochastic rounding and the RHT, and MX's fullgraph
# attempt; the others with -m "gpu and slow" (tests/conftest.py)
COMPILE_FAST = {("delayed", True), ("delayed", False), ("nvfp4", True), ("nvfp4", False), ("mx", True)}
CUDA_GRAPH_FAST = {"delayed", "current-row"}  # CUDA graphs (reduce-overhead): the stateful recipe, and row scaling


def make_model(name: str, device: str, **kwargs) -> nn.Module:
    """Built on the CPU from a fixed seed, converted, then moved to the device."""
    torch.manual_seed(SEED)
    return mf.convert(MLP(DIM, HIDDEN, **kwargs), recipe=RECIPE_BY_NAME[name], keep_first_last=False).to(device)


def batches(n: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 1)
    return [torch.randn(TOKENS, DIM, generator=g) * (1 + i) for i in range(n)]  # growing: delayed scales move


def loss_of(y: torch.Tensor) -> torch.Tensor:
    return (y.float() ** 2).sum() * 2.0**-10


def train(model: nn.Module, data, device: str, *, micro: int = 1) -> nn.Module:
    """One AdamW step per batch, over `micro` micro-batches, under bfloat16 autocast."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x in data:
        for chunk in x.to(device).chunk(micro):
            chunk = chunk.clone().requires_grad_(True)  # reentrant checkpointing needs an input that wants grad
            with autocast(device):
                y = model(chunk)
            loss_of(y).backward()
        opt.step()
        opt.zero_grad()
    return model


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------------- step contract


@RECIPE_PARAMS
@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_activation_checkpointing_is_bitwise_neutral_on_the_device(device, name, mode):
    """The recompute records nothing new and casts with the forward's scales: weights and scaling state as without
    checkpointing, bit for bit."""
    data = batches()
    plain = train(make_model(name, device), data, device)
    checkpointed = train(make_model(name, device, checkpoint=mode), data, device)
    assert_same_state(state(checkpointed), state(plain))


@RECIPE_PARAMS
def test_micro_batches_record_their_max_and_advance_once_per_step_on_the_device(device, name):
    """K micro-batches: one completed history row per optimizer step, holding the max over the micro-batches (the
    whole batch's amax, exactly). From the same weights and scales, the scaling state of one step over the whole
    batch (delayed recipes, whose scales are fixed for the step: all of it; others: what does not depend on the
    micro-batch's own scale, the weights' amaxes and the first layer's input)."""
    data = batches()
    model = make_model(name, device)
    first = mf.fp8_layers(model)[0]
    for step, x in enumerate(data):
        train(model, [x], device, micro=MICRO)
        h = first.fp8_state.amax_history
        assert int((h[1:, 0] > 0).sum()) == min(step + 1, h.shape[0] - 1)  # one completed row per optimizer step
        assert (h[0] == 0).all()  # the step ended
        assert torch.equal(h[-1, 0].cpu(), x.abs().max())  # max over the micro-batches = the batch's amax
    whole, split = train(make_model(name, device), data[:1], device), train(make_model(name, device), data[:1], device)
    for x in data[1:]:
        split.load_state_dict(whole.state_dict())
        train(whole, [x], device)
        train(split, [x], device, micro=MICRO)
        a, b = fp8_state(whole), fp8_state(split)
        if RECIPE_BY_NAME[name].delayed:
            assert_same_state(b, a)
            continue
        for key in a:
            if key.endswith("amax_history"):
                assert_same_bits(b[key][:, 1], a[key][:, 1], f"{key} weight column")
        key = "blocks.0.up.fp8_state.amax_history"
        assert_same_bits(b[key][:, 0], a[key][:, 0], f"{key} input column")


@RECIPE_PARAMS
def test_shared_input_casts_are_bitwise_unshared_on_the_device(device, name):
    """q, k, v and gate, up take their sibling's cast of the input they share (minifloat.fp8.shared_input) on the
    device's kernels (the one-pass casts recording in their own launch; a sibling records with its own fold) as on
    the CPU: losses, gradients and the whole state as when every layer casts itself, bit for bit, and fewer casts."""
    from minifloat.fp8 import shared_input
    from minifloat.training.model import Llama, LlamaConfig

    # 4 x 64 tokens of d 256: activations of 65536 elements, above EAGER_BELOW (the device's compiled kernels)
    config = LlamaConfig(n_layer=2, n_head=4, d_model=256, max_seq_len=64)
    g = torch.Generator().manual_seed(SEED + 1)
    idx = torch.randint(0, config.vocab_size, (4, 65), generator=g).to(device)

    def run(share: bool):
        torch.manual_seed(SEED)
        model = mf.convert(Llama(config), recipe=RECIPE_BY_NAME[name]).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(2):
            with autocast(device), (shared_input.unshared() if not share else torch.enable_grad()):
                loss = model(idx[:, :-1], idx[:, 1:])[1]
                loss.backward()
            losses.append(loss.detach().cpu())
            grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad(set_to_none=True)
        return losses, grads, state(model)

    losses, grads, after = run(share=True)
    ref_losses, ref_grads, ref_after = run(share=False)
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_same_bits(a, b, f"loss at step {step}")
    assert_same_state(grads, ref_grads, "grad ")
    assert_same_state(after, ref_after)


def test_delayed_scales_follow_the_history_on_the_device(device):
    """The TE rule over the device's history: scale = fp8_max / max(amax history) per role."""
    model = train(make_model("delayed", device), batches(), device, micro=MICRO)
    for layer in mf.fp8_layers(model):
        h = layer.fp8_state.amax_history.cpu()
        want = torch.stack([mf.E4M3.max / h[:, 0].max(), mf.E4M3.max / h[:, 1].max(), mf.E5M2.max / h[:, 2].max()])
        torch.testing.assert_close(layer.fp8_state.scale.cpu(), want, rtol=2.0**-23, atol=0)


# Where the graph breaks (CUDA, torch 2.11, H100), the delayed model's compiled step-2 output differed from eager's
# in 1 of 32768 bfloat16 elements, on both runs there. (Once, not reproduced, Triton also failed to compile the MX
# model's fused cast kernel there: "PassManager::run failed".) torch 2.13 on the CPU is bitwise.
# Those graph breaks came from minifloat.core.autocast asking torch.amp.is_autocast_available inside the graph (torch
# 2.11's dynamo refuses it; fixed since, and fullgraph compiles then failed outright). Not re-run on a GPU after the
# fix: not strict, so the next GPU run shows whether the difference is gone (XPASS) or stays (XFAIL).
GRAPH_BREAK_XFAILS = {
    "delayed": pytest.mark.xfail("torch.cuda.is_available()", strict=False, raises=AssertionError,
                                 reason="compiled with graph breaks, 1 of 32768 bf16 outputs apart from eager on an "
                                        "H100 with torch 2.11 (before the autocast fix)"),
}


def _compile_params():
    return [pytest.param(name, fullgraph, id=f"{name}-{'fullgraph' if fullgraph else 'graph-breaks'}",
                         marks=(() if (name, fullgraph) in COMPILE_FAST else (pytest.mark.slow,))
                         + ((GRAPH_BREAK_XFAILS[name],) if not fullgraph and name in GRAPH_BREAK_XFAILS else ()))
            for name in RECIPE_NAMES for fullgraph in (True, False)]


@pytest.mark.parametrize("name, fullgraph", _compile_params())
def test_compiled_model_is_bitwise_eager_on_the_device(device, name, fullgraph):
    """tests/test_compile.py's check on the device: outputs, gradients, weights and scaling state bit for bit;
    with fullgraph, no recompile after the first step (without, the graph breaks are the compiler's to place).
    `emulate_precision_casts` makes inductor round fused intermediates to bfloat16 where eager does (any bfloat16
    model needs it)."""
    torch._dynamo.reset()
    eager, compiled = make_model(name, device), make_model(name, device)
    fn = torch.compile(compiled, fullgraph=fullgraph)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, compiled)]

    def step(model, call, opt, x):
        with autocast(device):
            y = call(x)
        loss_of(y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        return y.detach(), grads

    try:
        with inductor_config.patch(emulate_precision_casts=True):
            for i, x in enumerate(batches(STEPS + 1)):
                x = x.to(device)
                with torch._dynamo.config.patch(error_on_recompile=fullgraph and i > 0):  # step 0 compiled it
                    y_c, g_c = step(compiled, fn, opts[1], x)
                y_e, g_e = step(eager, eager, opts[0], x)
                assert_same_bits(y_c, y_e, f"step {i} output")
                for k, (a, b) in enumerate(zip(g_c, g_e)):
                    assert_same_bits(a, b, f"step {i} gradient {k}")
    finally:
        torch._dynamo.reset()
    assert_same_state(state(compiled), state(eager))


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in CUDA_GRAPH_FAST else pytest.mark.slow)
                                  for n in RECIPE_NAMES])
def test_cuda_graphs_capture_the_compiled_step(device, name):
    """torch.compile(mode="reduce-overhead") (the trainer's --compile-mode reduce-overhead, for small steps) captures
    the converted model's forward and backward in CUDA graphs, skipping none (a graph that reads a value on the host,
    takes a CPU tensor or mutates an input the graph does not own is skipped, and a warning says why), and the
    replayed steps give eager's bits: outputs, gradients, weights and scaling state."""
    if torch.device(device).type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, compiled = make_model(name, device), make_model(name, device)
    fn = torch.compile(compiled, mode="reduce-overhead")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, compiled)]
    try:
        with inductor_config.patch(emulate_precision_casts=True):
            for i, x in enumerate(batches(STEPS + 1)):
                x = x.to(device)
                outs = []
                for model, call, opt in ((compiled, fn, opts[1]), (eager, eager, opts[0])):
                    torch.compiler.cudagraph_mark_step_begin()
                    with autocast(device):
                        y = call(x)
                    loss_of(y).backward()
                    outs.append((y.detach().clone(), [p.grad.clone() for p in model.parameters()]))
                    opt.step()
                    opt.zero_grad()
                (y_c, g_c), (y_e, g_e) = outs
                assert_same_bits(y_c, y_e, f"step {i} output")
                for k, (a, b) in enumerate(zip(g_c, g_e)):
                    assert_same_bits(a, b, f"step {i} gradient {k}")
    finally:
        torch._dynamo.reset()
    assert counters["inductor"]["cudagraph_skips"] == 0, "CUDA graphs were skipped (the log above says why)"
    assert_same_state(state(compiled), state(eager))


@pytest.mark.parametrize("name", ["delayed", "current", "current-row", "block", "mx"])
def test_eager_graph_replays_give_eagers_bits(device, name):
    """torch.cuda.graph around an eager (uncompiled) FP8 model's forward and backward, PyTorch's whole-network
    capture: after warm-up steps on a side stream, one capture; then each step copies its batch into the static
    input and replays, the optimizer (and with it the FP8 step's end) running eagerly between replays. Outputs,
    gradients, weights and scaling state are eager's bit for bit: the capture took nothing from a host cache (the
    step's weight cast, the delayed reciprocals, a sibling's cast: minifloat.core.capture), so every replay reads the
    scales and weights as they are at that step."""
    if torch.device(device).type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    warmup, data = 2, batches(STEPS + 3)
    eager, graphed = make_model(name, device), make_model(name, device)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, graphed)]
    cast = lambda: torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)  # noqa: E731 (as captures need)

    reference = []
    for x in data:
        with cast():
            y = eager(x.to(device))
        loss_of(y).backward()
        reference.append((y.detach().clone(), [p.grad.clone() for p in eager.parameters()]))
        opts[0].step()
        opts[0].zero_grad(set_to_none=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: seeds delayed scales, compiles and tunes the kernels for these shapes
        for x in data[:warmup]:
            with cast():
                y = graphed(x.to(device))
            loss_of(y).backward()
            opts[1].step()
            opts[1].zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    static_x = data[warmup].to(device).clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # records only: the step runs at its first replay
        with cast():
            static_y = graphed(static_x)
        loss_of(static_y).backward()
    for i, x in enumerate(data[warmup:], start=warmup):
        static_x.copy_(x.to(device))
        graph.replay()
        y_e, g_e = reference[i]
        assert_same_bits(static_y, y_e, f"step {i} output")
        for k, (p, g) in enumerate(zip(graphed.parameters(), g_e)):
            assert_same_bits(p.grad, g, f"step {i} gradient {k}")
        opts[1].step()  # the replayed backward writes the gradients afresh: no zero_grad between replays
    assert_same_state(state(graphed), state(eager))


@pytest.mark.parametrize("name", ["delayed"])
def test_eager_graph_replays_refuse_a_capture_before_the_first_step(device, name):
    """A capture before the first training step would have to read the delayed layers' state on the host to seed
    their scales, which a capture cannot: one RuntimeError naming the layer and the fix, not torch's capture error."""
    if torch.device(device).type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    model = make_model(name, device)
    x = batches(1)[0].to(device)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="run one training step eagerly before capturing") as info:
        with torch.cuda.graph(graph), torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            model(x)
    assert "\n" not in str(info.value) and "blocks.0" in str(info.value)


# ---------------------------------------------------------------------------------------------------- host syncs


@RECIPE_PARAMS
def test_a_steady_state_fp8_step_does_not_synchronise_the_device(device, name):
    """tests/test_host_syncs.py's check on the device, at sizes where the device runs minifloat's Triton and compiled
    kernels: after warm-up, a step (forward, backward, SGD, the FP8 step's end) makes no synchronising CUDA call
    (torch.cuda.set_sync_debug_mode("error") raises on the first: a read of a value, a copy to or from pageable host
    memory, a stream synchronisation). A step that synchronises stalls the host and cannot be captured in a CUDA
    graph. On the CPU stand-in, the dispatch-mode counter of tests/host_syncs.py instead."""
    step = make_step(name, device, dim=DIM, hidden=HIDDEN, tokens=TOKENS)
    for _ in range(WARMUP):
        step()
    if torch.device(device).type != "cuda":
        with HostSyncs() as syncs:
            step()
        assert set(syncs.sites) <= CPU_ONLY_READS, syncs.sites
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------- optimizers


OPT_LR = 1e-2
# Per optimizer step, device against CPU. The rules are elementwise fp32 arithmetic in one order (decode, torch's
# update, encode) and IEEE +, -, ·, /, √ are correctly rounded on both; a GPU kernel may contract a·b + c into one
# FMA (lerp_, addcmul_, addcdiv_), which rounds once where the CPU rounds twice: a relative difference of a few fp32
# ulps in a moment or an update. A parameter then differs by at most lr·(a few · 2^-23) per step; 2^-18·lr per step
# bounds it. A quantized state's code flips only where that tiny difference crosses a rounding boundary of its
# format: a small fraction of its elements, by one code, and only those elements' updates then differ visibly.
# Measured on an H100 over two steps: exp_avg_sq one fp32 ulp apart (fp32 states) or one bfloat16 ulp (bf16
# states, hence rtol 2^-6 for float states), no FP8 / int code flipped, 1 of 131072 weights apart (by 6.6e-4·lr).
PARAM_ATOL_PER_STEP = OPT_LR * 2.0**-18
MAX_FLIPPED_CODE_FRACTION = 1e-3
# AdamW over fixed gradients (torch.optim's implementation on each device: for-each on CUDA, per tensor on the CPU)
OPT_STEPS = 2

STATE_CASES = [
    ("adamw-fp32", AdamW, ("fp32", "fp32")),
    ("adamw-bf16", AdamW, ("bf16", "bf16")),
    ("adamw-e4m3-bf16", AdamW, ("e4m3", "bf16")),
    ("adamw-e4m3-e5m2", AdamW, ("e4m3", "e5m2")),
    ("adamw-int8-int8dyn", AdamW, ("int8", "int8-dynamic")),
    ("adamw-int4dyn-int4", AdamW, ("int4-dynamic", "int4")),
    ("sgd-e4m3", SGD, "e4m3"),
    ("lion-int8", Lion, "int8"),
]


def params_and_grads(seed: int = SEED) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """A quantized-state weight (256×512), a bias small enough for fp32 state, and OPT_STEPS gradients for each."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(256, 512, generator=g) * 0.05, torch.randn(512, generator=g) * 0.01]
    grads = [[torch.randn(p.shape, generator=g) * 2.0**-(4 + i) for p in params] for i in range(OPT_STEPS)]
    return params, grads


def run_optimizer(cls, formats, device: str) -> tuple[list[torch.Tensor], dict]:
    params, grads = params_and_grads()
    params = [nn.Parameter(p.to(device)) for p in params]
    opt = cls(params, lr=OPT_LR, state_formats=formats)
    for step in grads:
        for p, gr in zip(params, step):
            p.grad = gr.to(device)
        opt.step()
    states = {f"{i}.{k}": v.detach().cpu() for i, p in enumerate(params) for k, v in opt.state[p].items()}
    return [p.detach().cpu() for p in params], states


@pytest.mark.parametrize("case, cls, formats", STATE_CASES, ids=[c[0] for c in STATE_CASES])
def test_low_precision_optimizer_states_step_device_tensors_as_cpu_tensors(device, case, cls, formats):
    with eager_kernels():
        expected_params, expected_states = run_optimizer(cls, formats, "cpu")
    params, states = run_optimizer(cls, formats, device)
    assert states.keys() == expected_states.keys()
    for key, expected in expected_states.items():
        got = states[key]
        assert got.dtype == expected.dtype and got.shape == expected.shape, key
        if not got.is_floating_point() or got.element_size() == 1:  # codes: equal but for rare one-code flips
            flipped = float((got.view(torch.uint8) != expected.view(torch.uint8)).float().mean()) \
                if got.element_size() == 1 else float((got != expected).float().mean())
            assert flipped <= MAX_FLIPPED_CODE_FRACTION, f"{key}: {flipped:.2e} of the codes differ"
        else:
            torch.testing.assert_close(got.float(), expected.float(), rtol=2.0**-6, atol=0, msg=key)
    for i, (got, expected) in enumerate(zip(params, expected_params)):
        apart = float(((got - expected).abs() > PARAM_ATOL_PER_STEP * OPT_STEPS).float().mean())
        assert apart <= MAX_FLIPPED_CODE_FRACTION, f"param {i}: {apart:.2e} of the elements moved apart"


def bf16_params(device: str) -> list[nn.Parameter]:
    """A weight and a bias in bfloat16 on `device` (the same values on every device)."""
    g = torch.Generator().manual_seed(SEED)
    return [nn.Parameter((torch.randn(shape, generator=g) * 0.05).to(device, torch.bfloat16))
            for shape in ((256, 512), (512,))]


def step_bf16(params: list[nn.Parameter], opt, device: str) -> list[torch.Tensor]:
    """OPT_STEPS steps over fixed bfloat16 gradients (the same bits on every device); the weights, on the CPU."""
    g = torch.Generator().manual_seed(SEED + 2)
    for _ in range(OPT_STEPS):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 2.0**-6).to(device, torch.bfloat16)
        opt.step()
        opt.zero_grad()
    return [p.detach().float().cpu() for p in params]


def bf16_ulp(w: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 values at |w| (7 explicit mantissa bits), for float32 w on the bfloat16 grid."""
    return torch.exp2(torch.floor(torch.log2(w.abs().clamp(min=2.0**-126))) - 7)


MASTER_MODES = {
    "fp32-master": lambda ps: MasterWeightOptimizer(torch.optim.AdamW, ps, lr=1e-3),
    "bf16-kahan": lambda ps: LowPrecisionWeightOptimizer(torch.optim.AdamW, ps, update="kahan", lr=1e-3),
    "bf16-sr": lambda ps: LowPrecisionWeightOptimizer(torch.optim.AdamW, ps, update="stochastic", seed=0, lr=1e-3),
}


@pytest.mark.parametrize("mode", list(MASTER_MODES))
def test_master_weight_modes_step_device_tensors(device, mode):
    """bf16 weights on the device, two AdamW steps over the same gradients as on the CPU. fp32 master weights and
    Kahan compensation round (nearly: torch's AdamW runs for-each kernels on CUDA, per tensor on the CPU) the same
    fp32 update, so a weight is the CPU's but where that update lies within a few fp32 ulps of a bfloat16 rounding
    boundary, then one bfloat16 ulp away. Stochastic rounding draws from the device's generator: each step rounds the
    same value up or down, so a weight is at most one bfloat16 ulp per step from the CPU's, an ulp at the largest
    magnitude the weight passes through (|start| + lr per AdamW step, whose first step moves by ±lr exactly)."""
    before = [p.detach().float().cpu() for p in bf16_params("cpu")]
    results = {}
    for where in ("cpu", device):
        params = bf16_params(where)
        results[where] = step_bf16(params, MASTER_MODES[mode](params), where)
        assert all(p.dtype == torch.bfloat16 and p.device.type == torch.device(where).type for p in params)
    for i, (start, got, expected) in enumerate(zip(before, results[device], results["cpu"])):
        assert not torch.equal(got, start), "the steps changed nothing"
        reach = torch.maximum(got.abs(), expected.abs())
        if mode == "bf16-sr":  # a rounding made on the way may be coarser than the final weight's grid
            reach = torch.maximum(reach, start.abs() + OPT_STEPS * 2 * 1e-3)
        ulps = (got - expected).abs() / bf16_ulp(reach)
        limit = OPT_STEPS if mode == "bf16-sr" else 1
        assert float(ulps.max()) <= limit, f"param {i}: {float(ulps.max())} bf16 ulps from the CPU's weights"
        if mode != "bf16-sr":
            assert float((ulps > 0).float().mean()) <= MAX_FLIPPED_CODE_FRACTION, f"param {i}"


def test_stochastic_rounding_keeps_updates_round_to_nearest_drops_on_the_device(device):
    """tests/test_master_lowp.py's check with the device's generator: 100 SGD steps of 1e-4 (below half a bf16 ulp
    of 1.0, 2^-9) on 4096 weights at 1.0. Round to nearest leaves them at 1.0; stochastic rounding's mean lands
    within 5 standard errors (sqrt(S)·ulp/2/sqrt(n), ulp = 2^-8) of the fp32 result 1 - S·lr."""
    n, steps, lr = 4096, 100, 1e-4
    results = {}
    for name, make in (("sr", lambda p: LowPrecisionWeightOptimizer(torch.optim.SGD, p, lr=lr, seed=0)),
                       ("nearest", lambda p: torch.optim.SGD(p, lr=lr))):
        w = nn.Parameter(torch.ones(n, dtype=torch.bfloat16, device=device))
        opt = make([w])
        for _ in range(steps):
            w.grad = torch.ones_like(w)
            opt.step()
            opt.zero_grad()
        results[name] = w.detach().float().cpu()
    stderr = math.sqrt(steps) * 2.0**-8 / 2 / math.sqrt(n)
    assert abs(float(results["sr"].mean()) - (1.0 - steps * lr)) <= 5.0 * stderr
    assert bool((results["nearest"] == 1.0).all())


# FP8 experts (minifloat.fp8.experts) on the device against the same module on the CPU: the casts are bitwise, the
# GEMMs native where the GPU has them (fast accumulation, another summation order), so a floor, not bits. Not yet run
# on a GPU; the CPU's own FP8 experts sit 23.7-24.0 dB from fp32 (tests/test_moe.py), the floor is below that
MOE_CROSS_DEVICE_SQNR_DB = 20.0


@pytest.mark.parametrize("name", ["current", "delayed"])
def test_moe_experts_train_in_fp8_on_the_device(device, name):
    transformers = pytest.importorskip("transformers")
    from test_moe import MODELS, experts_of, routing

    config_name, class_name, fields = MODELS["mixtral"]
    torch.manual_seed(SEED)
    model = getattr(transformers, class_name)(getattr(transformers, config_name)(**fields))
    on_cpu = mf.convert(model, recipe=RECIPE_BY_NAME[name])
    on_device = mf.convert(getattr(transformers, class_name)(model.config).to(device), recipe=RECIPE_BY_NAME[name])
    on_device.load_state_dict(on_cpu.state_dict())
    ours, theirs = experts_of(on_device)[0], experts_of(on_cpu)[0]
    x, index, weights = routing()
    y_cpu = theirs(x, index, weights)
    y_dev = ours(x.to(device), index.to(device), weights.to(device))
    assert mf.sqnr_db(y_cpu.detach(), y_dev.detach().cpu()) >= MOE_CROSS_DEVICE_SQNR_DB
    y_dev.sum().backward()
    assert all(bool(torch.isfinite(p.grad).all()) for p in ours.parameters(recurse=False))
    optimizer = torch.optim.SGD(ours.parameters(), lr=0.0)
    optimizer.step()
    history = ours.fp8_state[0].amax_history  # the step ended: its amaxes rolled to the last row, row 0 empty again
    assert bool(history[-1].all()) and not bool(history[0].any()) and history.device.type == torch.device(device).type
