"""Tests for minifloat.safety.audit: op-precision audit against AuditRules, and the FP16/BF16 preflight."""

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import minifloat as mf
from minifloat.core.roles import output_head
from minifloat.safety.audit import BACKWARD, LOSS, AuditRules, OpRecord, audit, check
from minifloat.safety.preflight import bf16_support, preflight
from minifloat.numerics.formats import FP16

VOCAB, DIM, SEQ = 64, 32, 16


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


class ManualNorm(nn.Module):
    """A layer norm written out by hand; `dtype` is the dtype its statistics are computed in."""

    def __init__(self, dim, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.dtype = dtype

    def forward(self, x):
        h = x.to(self.dtype)
        mu = h.mean(-1, keepdim=True)
        var = (h - mu).pow(2).mean(-1, keepdim=True)
        return ((h - mu) * torch.rsqrt(var + 1e-5)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, softmax_dtype):
        super().__init__()
        self.q = nn.Linear(DIM, DIM)
        self.softmax_dtype = softmax_dtype

    def forward(self, x):  # x: (B, T, C)
        scores = self.q(x) @ x.transpose(-1, -2)  # (B, T, T)
        p = scores.to(self.softmax_dtype).softmax(-1)
        return p.to(x.dtype) @ x


class TinyLM(nn.Module):
    def __init__(self, *, softmax_dtype=torch.float32, norm=None):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.attn = Attention(softmax_dtype)
        self.norm = norm if norm is not None else nn.LayerNorm(DIM)
        self.mlp = nn.Linear(DIM, DIM)
        self.lm_head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        h = self.emb(idx)
        h = h + self.attn(h)
        h = self.norm(h)
        h = h + self.mlp(h)
        return self.lm_head(h)  # (B, T, V)


def lm_loss(logits, idx):
    return F.cross_entropy(logits.float().flatten(0, 1), idx.flatten())


def run_audit(model, **kw):
    idx = torch.randint(0, VOCAB, (2, SEQ))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return audit(model, idx, loss_fn=lm_loss, **kw)


def rules_broken(report):
    return {(v.rule, v.module, v.phase) for v in report.violations}


def test_correct_model_passes():
    model = mf.convert(TinyLM(), keep_first_last=True)  # attn.q and mlp in FP8, lm_head kept high precision
    report = run_audit(model)
    assert report.violations == [], report.violations
    assert report.ok and report.head == "lm_head"
    fp8 = {(r.module, r.phase) for r in report.records if r.precision == "fp8"}
    assert fp8 == {("mlp", "forward"), ("mlp", "backward")}  # keep_first_last keeps attn.q (the first) too
    # torch's CPU autocast leaves a bf16 GEMM in bf16 and runs cross-entropy in fp32
    assert any(r.module == "lm_head" and r.op == "aten.addmm.default" and r.precision == "bfloat16"
               for r in report.records)
    assert any(r.module == LOSS and r.op == "aten._log_softmax.default" and r.precision == "float32"
               for r in report.records)


@pytest.mark.parametrize("recipe", [mf.DelayedScaling(), mf.CurrentScaling(granularity="row"), mf.BlockScaling(),
                                    mf.BlockScaling(power_of_two=False), mf.MXScaling(), mf.NVFP4Scaling()],
                         ids=["delayed", "row", "block", "block-no-pow2", "mx", "nvfp4"])
def test_every_recipe_gemm_is_reported_as_fp8(recipe):
    """Each recipe's emulated GEMM kernels (mm, minifloat::mm_fp32, addmm_bf16, and k_block_mm for block scales that
    vary along K) are reported as FP8 GEMMs in both phases: the recipe's products, not float32 or bfloat16 ones."""
    model = mf.convert(TinyLM(), recipe=recipe, keep_first_last=True)
    report = run_audit(model)
    fp8 = {(r.module, r.phase) for r in report.records if r.precision == "fp8"}
    assert fp8 == {("mlp", "forward"), ("mlp", "backward")}, fp8
    assert not any(r.module == "mlp" and r.precision == "float32" and "mm" in r.op for r in report.records)


def test_wrong_model_is_flagged_with_module_names():
    model = TinyLM(softmax_dtype=torch.bfloat16, norm=ManualNorm(DIM, torch.bfloat16))
    mf.convert(model, keep_first_last=False)  # the head too: a violation
    report = run_audit(model)
    broken = rules_broken(report)
    expected = {
        ("softmax_fp32", "attn", "forward"), ("softmax_fp32", "attn", "backward"),
        ("norms_fp32", "norm", "forward"),
        ("head_not_fp8", "lm_head", "forward"), ("head_not_fp8", "lm_head", "backward"),
    }
    assert expected <= broken
    assert {rule for rule, module, _ in broken} == {"softmax_fp32", "norms_fp32", "head_not_fp8"}
    assert {module for _, module, _ in broken} == {"attn", "norm", "lm_head"}
    assert report.table().row_count >= len({(v.module, v.phase, v.op) for v in report.violations})


def test_fp32_manual_norm_passes():
    report = run_audit(TinyLM(norm=ManualNorm(DIM, torch.float32)))
    assert report.ok, report.violations


def test_torch_autocast_runs_layer_norm_statistics_in_fp32():
    """Observed on torch's CPU autocast: native_layer_norm takes the bf16 input as is, with fp32 statistics."""
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.LayerNorm(DIM))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = audit(model, torch.randn(4, DIM))
    ln = [r for r in report.records if r.op == "aten.native_layer_norm.default"]
    assert ln and ln[0].in_dtypes[0] == "bfloat16" and ln[0].out_dtypes[1:] == ["float32", "float32"]
    assert ln[0].precision == "float32" and report.ok


def test_fp8_disabled_is_not_fp8():
    model = mf.convert(TinyLM(), keep_first_last=False)
    with mf.autocast(enabled=False):
        report = run_audit(model)
    assert report.ok and not any(r.precision == "fp8" for r in report.records)


def test_model_left_as_found():
    model = mf.convert(TinyLM(), keep_first_last=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run_audit(model)
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)


def test_json_round_trip():
    report = run_audit(TinyLM(softmax_dtype=torch.bfloat16))
    data = json.loads(report.to_json())
    assert data["head"] == "lm_head"
    assert {v["rule"] for v in data["violations"]} == {"softmax_fp32"}
    assert len(data["records"]) == len(report.records)


def test_loss_ops_attributed_to_loss():
    report = run_audit(TinyLM())
    phases = {r.phase for r in report.records if r.module == LOSS}
    assert phases == {"forward", "backward"}
    assert not [r for r in report.records if r.module == BACKWARD and r.op.startswith("aten.mm")]


@pytest.fixture
def gloo_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class AllReduceBlock(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.dtype = dtype

    def forward(self, x):
        y = self.lin(x)
        dist.all_reduce(y.detach().to(self.dtype))  # stands in for a gradient reduction
        return y


@pytest.mark.parametrize("dtype, flagged", [("float32", False), ("bfloat16", True)])
def test_collectives_rule(gloo_group, dtype, flagged):
    model = nn.Sequential(AllReduceBlock(getattr(torch, dtype)))
    report = audit(model, torch.randn(4, DIM))
    assert any(r.op.startswith("c10d.allreduce_") for r in report.records)
    assert rules_broken(report) == ({("collectives_fp32", "0", "forward")} if flagged else set())


def rec(op, precision, module="m", module_type="", in_dtypes=("float32",)):
    return OpRecord(module, module_type, "forward", op, list(in_dtypes), [], precision)


# (name, record, head, expected rules broken)
RULE_CASES = [
    ("softmax bf16", rec("aten._softmax.default", "bfloat16"), None, {"softmax_fp32"}),
    ("softmax fp32", rec("aten._softmax.default", "float32"), None, set()),
    ("nll fp16", rec("aten.nll_loss_forward.default", "float16"), None, {"softmax_fp32"}),
    ("layer_norm bf16 stats", rec("aten.native_layer_norm.default", "bfloat16"), None, {"norms_fp32"}),
    ("group_norm fp32", rec("aten.native_group_norm.default", "float32"), None, set()),
    ("mean in RMSNorm bf16", rec("aten.mean.dim", "bfloat16", module_type="RMSNorm"), None, {"norms_fp32"}),
    ("mean elsewhere bf16", rec("aten.mean.dim", "bfloat16", module_type="Linear"), None, set()),
    ("fp8 embedding", rec("aten.embedding.default", "float32", in_dtypes=("float8_e4m3fn",)), None,
     {"embedding_not_fp8"}),
    ("fp8 gemm in head", rec("aten.mm.default", "fp8", module="lm_head"), "lm_head", {"head_not_fp8"}),
    ("fp8 gemm in body", rec("aten.mm.default", "fp8", module="mlp"), "lm_head", set()),
    ("bf16 all_reduce", rec("_c10d_functional.all_reduce.default", "bfloat16"), None, {"collectives_fp32"}),
    ("fp32 reduce_scatter", rec("c10d.reduce_scatter_.default", "float32"), None, set()),
    # a softmax written by hand (exp, sum, divide) in bf16 passed: only the ATen softmax was matched
    ("exp bf16", rec("aten.exp.default", "bfloat16"), None, {"softmax_fp32"}),
    ("exp fp32", rec("aten.exp.default", "float32"), None, set()),
    ("logsumexp fp16", rec("aten.logsumexp.default", "float16"), None, {"softmax_fp32"}),
]


class HandSoftmaxAttention(Attention):
    def forward(self, x):
        scores = (self.q(x) @ x.transpose(-1, -2)).to(self.softmax_dtype)
        e = (scores - scores.amax(-1, keepdim=True)).exp()
        return (e / e.sum(-1, keepdim=True)).to(x.dtype) @ x


@pytest.mark.parametrize("dtype, flagged", [(torch.bfloat16, True), (torch.float32, False)], ids=["bf16", "fp32"])
def test_a_softmax_written_by_hand_is_checked(dtype, flagged):
    model = TinyLM()
    model.attn = HandSoftmaxAttention(dtype)
    report = run_audit(mf.convert(model, keep_first_last=True))
    assert (("softmax_fp32", "attn", "forward") in rules_broken(report)) == flagged, report.violations
    assert report.ok == (not flagged)


@pytest.mark.parametrize("name, record, head, expected", RULE_CASES, ids=[c[0] for c in RULE_CASES])
def test_rule_table(name, record, head, expected):
    assert {v.rule for v in check([record], AuditRules(), head)} == expected


def test_rules_can_be_switched_off():
    record = rec("aten._softmax.default", "bfloat16")
    assert check([record], AuditRules(softmax_fp32=False)) == []


@pytest.mark.parametrize("field, value", [("softmax_fp32", 1), ("head_names", "lm_head"), ("norm_stat_ops", [1])])
def test_rules_validation(field, value):
    with pytest.raises(ValueError, match=field):
        AuditRules(**{field: value})


def test_find_head_falls_back_to_last_linear():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert output_head(model, names=AuditRules().head_names) == "2"
    assert output_head(TinyLM(), names=AuditRules().head_names) == "lm_head"


# ---------------------------------------------------------------------------------------------------- preflight


def test_preflight_clean_model():
    report = preflight(TinyLM(), torch.randint(0, VOCAB, (2, SEQ)))
    assert report.fp16_safe, report.issues
    kinds = {r.kind for r in report.tensors}
    assert kinds == {"weight", "activation"}
    assert any(r.name == "lm_head" and r.kind == "activation" for r in report.tensors)
    json.loads(report.to_json())


def test_preflight_flags_overflow_and_underflow_in_state_dict():
    state = {
        "big": torch.tensor([1.0, FP16.max * 4]),
        "edge": torch.tensor([FP16.max, -FP16.max]),  # representable: not an overflow
        # rounds to 65504 (was counted as an overflow), and the first value that rounds to inf
        "rounding": torch.tensor([65519.99, 65520.0]),
        "tiny": torch.full((10,), FP16.min_subnormal / 4),  # flushes to zero
        "subnormal": torch.full((10,), FP16.min_subnormal),  # survives
    }
    report = preflight(state)
    by_name = {r.name: r for r in report.tensors}
    assert by_name["big"].overflow == 1 and by_name["edge"].overflow == 0 and by_name["rounding"].overflow == 1
    assert by_name["tiny"].underflow == 1.0 and by_name["subnormal"].underflow == 0.0
    assert len(report.issues) == 3 and not report.fp16_safe
    # cross-check against torch's own FP16 cast
    assert torch.isinf(state["big"].half()).sum() == 1 and (state["tiny"].half() == 0).all()


def test_preflight_leaves_out_fp8_scaling_state():
    # a delayed scale fp8_max / amax is often far above FP16's max, and it stays fp32 under every policy: every
    # FP8 model was reported as not fp16_safe, its scales called weights beyond FP16's range
    model = mf.convert(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                     nn.Linear(64, 16)), recipe=mf.DelayedScaling())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model(torch.randn(16, 32) * 1e-3).pow(2).mean().backward()
    opt.step()
    state = model.state_dict()
    assert max(v.max().item() for k, v in state.items() if "fp8_state" in k) > FP16.max  # the case is real
    for given in (model, state):
        report = preflight(given)
        assert report.fp16_safe, report.issues
        assert not any("fp8_state" in r.name for r in report.tensors)
    assert not preflight({**state, "big": torch.tensor([FP16.max * 4])}).fp16_safe


def test_preflight_flags_activation_overflow():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with torch.no_grad():
        model[1].weight.fill_(FP16.max)
    report = preflight(model, torch.ones(2, 4))
    assert any(i.startswith("activation 1:") for i in report.issues), report.issues
    assert not any(i.startswith("weight") for i in report.issues)


def test_preflight_argument_errors():
    with pytest.raises(ValueError, match="sample_batch"):
        preflight({"w": torch.ones(2)}, torch.ones(2))
    with pytest.raises(ValueError, match="underflow_tolerance"):
        preflight({"w": torch.ones(2)}, underflow_tolerance=2.0)


def test_bf16_support_reads_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags : fpu sse avx512f avx512_bf16\n")
    assert bf16_support(str(info)).cpu_flags == ["avx512_bf16"] and bf16_support(str(info)).native
    info.write_text("processor : 0\nflags : fpu sse avx2\n")
    assert not bf16_support(str(info)).native
    assert not bf16_support(str(tmp_path / "missing")).native


def test_backward_is_recorded_outside_torch_autocast():
    """A training loop runs backward outside torch.autocast, so the fp32 head's backward matmuls are fp32; run inside
    the caller's autocast they would be recast to bf16 and the report would be wrong about the backward."""
    from minifloat.training.model import Llama, LlamaConfig

    policy = mf.PrecisionPolicy.preset("bf16")
    model = policy.apply(Llama(LlamaConfig.preset("tiny")))
    x = torch.randint(0, 256, (2, SEQ))
    with policy.autocast("cpu"):
        report = audit(model, (x, x), loss_fn=lambda out, _batch: out[1])
    head_mm = [r for r in report.records if r.phase == "backward" and r.module == "lm_head" and "mm" in r.op]
    assert head_mm and {r.precision for r in head_mm} == {"float32"}
    proj_mm = [r for r in report.records if r.phase == "backward" and r.module.endswith("q_proj") and "mm" in r.op]
    assert proj_mm and {r.precision for r in proj_mm} == {"bfloat16"}  # autocast's bf16 weights, saved in forward
    assert report.ok


class SoftmaxThenProject(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.proj(F.softmax(x, -1))


def test_a_modules_backward_behind_a_child_is_its_own():
    # the walk from a module's output stopped at its child's nodes: the softmax's backward went to "<backward>"
    model = nn.Sequential(nn.Linear(DIM, DIM), SoftmaxThenProject())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = audit(model, torch.randn(2, SEQ, DIM))
    assert {(v.module, v.phase) for v in report.violations if v.rule == "softmax_fp32"} == {("1", "forward"),
                                                                                           ("1", "backward")}
