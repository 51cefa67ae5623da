"""Sibling FP8 layers reading the same input share its cast (minifloat.fp8.shared_input).

What must hold: a Llama's training steps are bitwise those of unshared casts (losses, every gradient, every scaling
buffer) for every recipe; q/k/v and gate/up cast their input once (every recipe), and their autograd
nodes save one FP8 copy of it; under delayed scaling a sibling whose own stored scale differs (edited by hand) takes
the first sibling's cast; a tensor changed in place between two layers is cast again; the shared entry keeps no
input alive.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import minifloat as mf
from minifloat.fp8 import caster as caster_module
from minifloat.fp8 import shared_input
from minifloat.fp8.recipes import Role
from minifloat.fp8.scaling import ROLE_INDEX
from minifloat.numerics.compiling import eager_kernels
from minifloat.training.model import Llama, LlamaConfig
from recipe_cases import RECIPES

CONFIG = LlamaConfig(n_layer=2, n_head=4, d_model=64, max_seq_len=32, attention="fp32")
BATCH, SEQ, STEPS = 2, 16, 2
# the layers of a block that read one input: q, k, v (the attention's) and gate, up (the MLP's)
SIBLINGS = (("attn.q_proj", "attn.k_proj", "attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))
SHARED = {"delayed", "delayed-e4m3", "current", "current-row", "current-pow2", "block", "block-no-pow2", "mx",
          "mx-floor", "mxfp4", "nvfp4"}


@pytest.fixture(autouse=True)
def _eager():
    shared_input.forget()
    with eager_kernels():
        yield
    shared_input.forget()


def make_model(recipe) -> nn.Module:
    torch.manual_seed(0)
    return mf.convert(Llama(CONFIG), recipe=recipe)


def casts_saved(model: nn.Module) -> int:
    """Input casts that sharing saves in one forward: in each group of siblings, all FP8 layers but the first (convert
    keeps block 0's q, k, v in high precision, for one)."""
    from minifloat.inference.layers import Fp8InferenceLinear

    fp8 = {name for name, m in model.named_modules() if isinstance(m, (mf.Fp8Linear, Fp8InferenceLinear))}
    saved = 0
    for block in range(CONFIG.n_layer):
        for group in SIBLINGS:
            saved += max(sum(f"blocks.{block}.{name}" in fp8 for name in group) - 1, 0)
    return saved


def tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def train(recipe, *, share: bool):
    """Losses, final gradients and the state dict after STEPS AdamW steps under bfloat16 autocast."""
    model = make_model(recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        idx, targets = tokens(step)
        with (torch.autocast("cpu", dtype=torch.bfloat16), (shared_input.unshared() if not share
                                                             else torch.enable_grad())):
            _, loss = model(idx, targets)
            loss.backward()
        losses.append(loss.detach())
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, {k: v.clone() for k, v in model.state_dict().items()}


# the 4-bit recipes too: MXFP4 and NVFP4 share (NVFP4's forward input is rounded to nearest, unrotated: a function
# of the input; its stochastically rounded gradients and rotated wgrad operands are each layer's own)
BITWISE = [*RECIPES, ("mxfp4", mf.MXScaling(format="e2m1")), ("nvfp4", mf.NVFP4Scaling())]


@pytest.mark.parametrize("recipe", [r for _, r in BITWISE], ids=[n for n, _ in BITWISE])
def test_shared_input_casts_change_no_bit(recipe):
    losses, grads, state = train(recipe, share=True)
    ref_losses, ref_grads, ref_state = train(recipe, share=False)
    assert [l.item() for l in losses] == [l.item() for l in ref_losses]
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name
    for name, t in ref_state.items():  # weights, amax histories, scales, non-finite counts
        assert torch.equal(state[name], t), name


def _count_casts(monkeypatch) -> list:
    """The shapes of the tensors the casters quantize (FP8 and MX through `quantize`, NVFP4 through `cast_nvfp4`)."""
    calls = []
    for name, at in (("quantize", 0), ("cast_nvfp4", 1)):
        original = getattr(caster_module, name)

        def counting(*args, _original=original, _at=at, **kwargs):
            calls.append(args[_at].shape)
            return _original(*args, **kwargs)

        monkeypatch.setattr(caster_module, name, counting)
    return calls


def _forward(model, share: bool) -> torch.Tensor:
    idx, targets = tokens(0)
    with torch.autocast("cpu", dtype=torch.bfloat16), (shared_input.unshared() if not share else torch.enable_grad()):
        return model(idx, targets)[1]


@pytest.mark.parametrize("name,recipe", BITWISE, ids=[n for n, _ in BITWISE])
def test_siblings_cast_their_input_once(monkeypatch, name, recipe):
    calls = _count_casts(monkeypatch)
    _forward(make_model(recipe), share=False)  # (fresh models: a second forward would take the cached weight casts)
    unshared = len(calls)
    calls.clear()
    model = make_model(recipe)
    _forward(model, share=True)
    expected = unshared - casts_saved(model) if name in SHARED else unshared
    assert casts_saved(model) == 4  # block 0's gate/up, block 1's q/k/v and gate/up
    assert len(calls) == expected


def _saved_bytes(model, share: bool) -> int:
    """Bytes of the distinct tensors autograd saves in one forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[tuple, int] = {}

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key[0] not in params:
            seen[key] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _forward(model, share)
    del loss
    return sum(seen.values())


def test_siblings_save_one_fp8_copy_of_their_input():
    model = make_model(mf.CurrentScaling())
    unshared, shared = _saved_bytes(model, share=False), _saved_bytes(model, share=True)
    # per input cast saved, one copy fewer of the input's (B·T, d) E4M3 bytes and of its 0-d float32 scale
    one_copy = BATCH * SEQ * CONFIG.d_model + 4
    assert unshared - shared == casts_saved(model) * one_copy


class _Pair(nn.Module):
    def __init__(self, d: int, inplace: bool):
        super().__init__()
        self.a, self.b, self.inplace = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False), inplace

    def forward(self, x):
        ya = self.a(x)
        if self.inplace:
            x.mul_(2.0)  # a new value under the same memory: b must not take a's cast
        return ya + self.b(x)


@pytest.mark.parametrize("inplace", [False, True], ids=["same-input", "changed-in-place"])
def test_an_input_changed_in_place_is_cast_again(monkeypatch, inplace):
    torch.manual_seed(0)
    model = mf.convert(_Pair(64, inplace), recipe=mf.CurrentScaling(), keep_first_last=False)
    x = torch.randn(32, 64)
    calls = _count_casts(monkeypatch)
    with torch.no_grad():
        y = model(x.clone())
    assert len(calls) == (2 if inplace else 1) + 2  # the inputs' casts and the two weights'
    with torch.no_grad(), shared_input.unshared():
        assert torch.equal(model(x.clone()), y)


def test_the_shared_entry_keeps_no_input_alive():
    torch.manual_seed(0)
    model = mf.convert(_Pair(64, inplace=False), recipe=mf.CurrentScaling(), keep_first_last=False)
    x = torch.randn(32, 64)
    alive = weakref.ref(x)
    with torch.no_grad():
        model(x)
    assert shared_input._holder().entry is not None  # the entry exists while x does
    del x
    gc.collect()
    assert alive() is None
    assert shared_input._holder().entry is None  # ... and went with it (its FP8 copy too)


class _Siblings(nn.Module):
    """Three layers reading one normalized input (q, k, v's pattern), run under activation checkpointing."""

    def __init__(self, d: int, reentrant: bool | None):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.reentrant = reentrant

    def block(self, x):
        h = self.norm(x)
        return self.q(h) * self.k(h) + self.v(h)

    def forward(self, x):
        if self.reentrant is None:
            return self.block(x)
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [None, False, True], ids=["plain", "non-reentrant", "reentrant"])
@pytest.mark.parametrize("recipe", [mf.CurrentScaling(), mf.CurrentScaling(granularity="row"), mf.DelayedScaling()],
                         ids=["current", "row", "delayed"])
def test_activation_checkpointing_recomputes_the_shared_cast_bitwise(recipe, reentrant):
    """The recompute casts the recomputed input once and the siblings take it, as in the forward: gradients and
    scaling state bitwise those of unshared casts, with checkpointing and without."""
    def run(share: bool):
        torch.manual_seed(0)
        model = mf.convert(_Siblings(64, reentrant), recipe=recipe, keep_first_last=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            x = (torch.randn(32, 64, generator=torch.Generator().manual_seed(step)) * (1 + step)).requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16), (shared_input.unshared() if not share
                                                                 else torch.enable_grad()):
                model(x).float().pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        return x.grad, model.state_dict()

    grad, state = run(share=True)
    ref_grad, ref_state = run(share=False)
    assert torch.equal(grad, ref_grad)
    for key, value in ref_state.items():
        assert torch.equal(state[key], value), key


def test_a_delayed_sibling_takes_the_first_siblings_cast_whatever_its_own_scale():
    """Delayed scaling shares the first sibling's cast, made with the first sibling's stored scale. Siblings record
    the same input's amaxes step by step, so their scales agree (the bitwise tests above); a scale edited by hand (or
    a sibling that also reads other tensors) is the case where they do not, and the documented rule decides."""
    torch.manual_seed(0)
    model = mf.convert(_Siblings(64, reentrant=None), recipe=mf.DelayedScaling(), keep_first_last=False)
    x = torch.randn(32, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().sum().backward()  # seeds every layer's scales
    col = ROLE_INDEX[Role.INPUT]
    model.k.fp8_state.scale[col].mul_(0.7)  # k's input scale no longer q's (a power of two would move no grid point)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        h = model.norm(x)
        shared = model.k(h) if model.q(h) is not None else None
        with shared_input.unshared():
            own = model.k(h)
        shared_input.forget()
        model.k.fp8_state.scale[col].copy_(model.q.fp8_state.scale[col])  # k with q's input scale: the cast it took
        with shared_input.unshared():
            with_q_scale = model.k(h)
    assert not torch.equal(shared, own)
    assert torch.equal(shared, with_q_scale)


def test_inference_mode_tensors_are_cast_by_every_layer():
    """A tensor made under torch.inference_mode has no version counter to prove it unchanged: every layer casts it
    (the same outputs as unshared), and nothing fails."""
    torch.manual_seed(0)
    model = mf.convert(_Siblings(64, reentrant=None), recipe=mf.CurrentScaling(), keep_first_last=False)
    with torch.inference_mode():
        x = torch.randn(32, 64)
        y = model(x)
        with shared_input.unshared():
            assert torch.equal(model(x), y)
    assert shared_input._holder().entry is None


def test_a_delayed_cast_is_retired_when_its_scale_moves(monkeypatch):
    """The same tensor read again after the FP8 step's end (a batch reused across steps) is cast anew with the new
    delayed scale, not taken from the previous step's entry; under current scaling the cast is the tensor's own."""
    calls = _count_casts(monkeypatch)
    for recipe, recast in ((mf.DelayedScaling(), True), (mf.CurrentScaling(), False)):
        torch.manual_seed(0)
        layer = mf.convert(nn.Linear(64, 64, bias=False), recipe=recipe, keep_first_last=False)
        x = torch.randn(32, 64) * 3
        with torch.no_grad():
            layer(x)
            layer.fp8_step()  # (a step's end moves the delayed scales: the first cast seeded from x's amax)
            calls.clear()
            y = layer(x)
        assert len(calls) == (2 if recast else 1)  # (the weight's cast, and x's where it is retired)
        with torch.no_grad(), shared_input.unshared():
            assert torch.equal(layer(x), y)


def test_a_backward_releases_the_forwards_last_cast():
    """Once a backward begins every sibling has been called: the entry is dropped, so the forward's last cast (its
    row-major FP8 bytes or bfloat16 operand, which autograd does not keep) does not live on with its input."""
    torch.manual_seed(0)
    layer = mf.convert(nn.Linear(64, 64, bias=False), recipe=mf.CurrentScaling(), keep_first_last=False)
    x = torch.randn(32, 64, requires_grad=True)
    y = layer(x)
    assert shared_input._holder().entry is not None  # x lives, and so would its cast
    y.sum().backward()
    assert shared_input._holder().entry is None


def _count_inference_casts(monkeypatch) -> list:
    from minifloat.inference import layers, nvfp4

    calls = []
    for module, name in ((layers, "quantize"), (nvfp4, "quantize_input")):
        original = getattr(module, name)

        def counting(*args, _original=original, **kwargs):
            calls.append(args[0].shape)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)
    return calls


INFERENCE = [("current", mf.CurrentScaling(), "dynamic"), ("row", mf.CurrentScaling(granularity="row"), "dynamic"),
             ("block", mf.BlockScaling(), "dynamic"), ("mx", mf.MXScaling(), "dynamic"),
             ("nvfp4", mf.NVFP4Scaling(), "dynamic"), ("current-static", mf.CurrentScaling(), "static")]


@pytest.mark.parametrize("name,recipe,activations", INFERENCE, ids=[c[0] for c in INFERENCE])
def test_prepared_inference_layers_share_a_dynamic_input_cast(monkeypatch, name, recipe, activations):
    """prepare_inference's FP8 layers: with dynamic activation scales (the input's own) q/k/v and gate/up cast their
    input once, with the logits bitwise those of unshared casts; static scales (each layer's own, calibrated) are
    not shared."""
    torch.manual_seed(0)
    model = Llama(CONFIG)
    idx, _ = tokens(0)
    calibration = [idx] if activations == "static" else None
    model = mf.prepare_inference(model, recipe=recipe, calibration=calibration, activations=activations)
    calls = _count_inference_casts(monkeypatch)
    with torch.no_grad(), shared_input.unshared():
        ref = model(idx)[0]
    unshared = len(calls)
    calls.clear()
    with torch.no_grad():
        logits = model(idx)[0]
    assert torch.equal(logits, ref)
    if activations == "static":
        assert len(calls) == unshared
    else:
        assert casts_saved(model) == 4  # (prepare_inference keeps block 0's q, k, v too)
        assert len(calls) == unshared - casts_saved(model)
