"""minifloat.training.memory and `minifloat memory`: every measured figure against what it must be by construction."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

from minifloat.amp.master import MasterWeightOptimizer
from minifloat.cli import common, main
from minifloat.fp8.scaling import scaling_states
from minifloat.training.config import TrainConfig
from minifloat.training.loop import build
from minifloat.training.memory import memory_report, measure, unique_params

FP32 = 4  # bytes of a float32 element; also of torch's AdamW step counter (a 0-dim float32 tensor per parameter)
BF16 = 2
TABLE_WIDTH = 100  # columns the printed table must fit in
# second difference of saved bytes over batch 2, 4, 8, relative to the increment: 0 for bytes exactly linear in the
# batch; 1% leaves room for a size-dependent kernel choice saving an extra workspace
LINEAR_TOLERANCE = 0.01
USER_ERROR = 2


def tiny(preset: str = "fp8-delayed", batch_size: int = 4, **fields) -> TrainConfig:
    return TrainConfig(model="tiny", preset=preset, batch_size=batch_size, seq_len=32, max_bytes=100_000,
                       device="cpu", **fields)


def parameter_tensors(config: TrainConfig) -> tuple[int, int]:
    """(parameters, parameter tensors) of config's model, a tied embedding once."""
    model = build(config).model
    return unique_params(model), len({id(p) for p in model.parameters()})


@pytest.mark.parametrize("preset", ["fp32", "bf16", "fp8-delayed"])
def test_weights_gradients_and_adamw_state_are_the_computed_bytes(preset):
    config = tiny(preset)
    n, tensors = parameter_tensors(config)
    m = measure(config)
    assert m.params == n
    assert m.footprint.weights == FP32 * n  # fp32 parameters under every preset (autocast casts per op)
    assert m.footprint.master_weights == 0  # fp32 parameters are their own master
    assert m.footprint.gradients == FP32 * n
    # AdamW: exp_avg and exp_avg_sq in the parameter's dtype, and a float32 step counter per parameter tensor
    assert m.footprint.optimizer_state == 2 * FP32 * n + FP32 * tensors
    assert m.optimizer == "AdamW"


def test_an_optimizer_factory_is_measured_as_given():
    """SGD with momentum keeps one buffer per parameter; bf16 block linears under MasterWeightOptimizer add fp32
    masters of them, their fp32 gradient copies and the inner optimizer's fp32 state."""
    config = tiny("bf16")
    n, tensors = parameter_tensors(config)

    def sgd(_model, groups):
        return torch.optim.SGD(groups, lr=1e-3, momentum=0.9)

    assert measure(config, optimizer=sgd).footprint.optimizer_state == FP32 * n

    low = 0  # parameters made bf16

    def bf16_masters(model, groups):
        nonlocal low
        for module in model.blocks.modules():
            if isinstance(module, torch.nn.Linear):
                module.to(torch.bfloat16)  # the parameters stay the same objects (in the groups), now bf16
                low += sum(p.numel() for p in module.parameters())
        return MasterWeightOptimizer(torch.optim.AdamW, groups, lr=1e-3)

    m = measure(config, optimizer=bf16_masters)
    assert m.optimizer == "MasterWeightOptimizer" and 0 < low < n
    assert m.footprint.weights == FP32 * n - (FP32 - BF16) * low
    assert m.footprint.master_weights == FP32 * low
    assert m.footprint.gradients == FP32 * n - (FP32 - BF16) * low + FP32 * low
    assert m.footprint.optimizer_state == 2 * FP32 * n + FP32 * tensors


def test_fp8_scaling_buffers_are_counted():
    model = build(tiny("fp8-delayed")).model
    expected = sum(b.numel() * b.element_size() for s in scaling_states(model) for b in s.buffers())
    assert expected > 0
    assert measure(tiny("fp8-delayed")).footprint.fp8_scaling == expected
    assert measure(tiny("bf16")).footprint.fp8_scaling == 0


def saved_bytes(preset: str) -> dict[int, int]:
    return {b: measure(tiny(preset, batch_size=b)).footprint.saved for b in (2, 4, 8)}


@pytest.mark.parametrize("preset", ["fp32", "bf16", "fp8-delayed"])
def test_saved_bytes_grow_linearly_with_the_batch(preset):
    """saved(B) = a + b·B: activations scale with the batch; the constant a is what autocast saves once per step,
    its bf16 copies of the weights (none in fp32; in FP8 only the non-FP8 layers' as the FP8 linears save the weight
    parameter itself), so at most 2 B/param."""
    s = saved_bytes(preset)
    assert s[2] > 0
    step = s[4] - s[2]
    assert abs((s[8] - s[4]) - 2 * step) <= LINEAR_TOLERANCE * step
    constant = s[2] - step
    n, _ = parameter_tensors(tiny(preset))
    assert 0 <= constant <= BF16 * n
    if preset == "fp32":
        assert constant <= LINEAR_TOLERANCE * step


def test_fp8_saves_fewer_bytes_per_sequence_than_bf16():
    """An FP8 linear layer saves its input as E4M3 bytes plus a scale (1 B/element, minifloat.fp8.autograd) and the
    weight parameter itself; a bf16 linear under autocast saves its bf16 input (2 B/element) and a bf16 weight copy.
    Everything else (norms, attention, logits) saves the same, so FP8 saves less per sequence and less in all."""
    fp8, bf16 = saved_bytes("fp8-delayed"), saved_bytes("bf16")
    assert fp8[4] - fp8[2] < bf16[4] - bf16[2]
    assert all(fp8[b] < bf16[b] for b in fp8)


def test_report_has_both_baselines_and_fp8_saves_against_them():
    report = memory_report(tiny("fp8-delayed"))
    assert set(report.baselines) == {"fp32 AdamW", "bf16 AdamW"}
    fp32 = report.baselines["fp32 AdamW"]
    assert report.per_param("weights", fp32) == FP32
    assert report.measured.saved < report.baselines["bf16 AdamW"].saved < fp32.saved
    assert report.to_dict()["measured"]["total"] == report.measured.total


@pytest.fixture
def console(monkeypatch) -> Console:
    """The CLI's console, recording and wider than the table may be."""
    wide = Console(width=2 * TABLE_WIDTH, record=True)
    monkeypatch.setattr(common, "console", wide)
    return wide


def test_cli_prints_a_table_within_100_columns_and_writes_json(console, tmp_path):
    path = tmp_path / "memory.json"
    argv = ["memory", "--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--max-bytes", "100000",
            "--device", "cpu", "--json", str(path)]
    assert main(argv) == 0
    lines = console.export_text().splitlines()
    table = [line for line in lines if line[:1] in "┃│┏┡├└"]
    assert any(line.split("│")[1].strip() == "optimizer state" for line in table if "│" in line)
    assert max(len(line.rstrip()) for line in table) <= TABLE_WIDTH
    assert not any("…" in line for line in lines)
    report = json.loads(path.read_text())
    assert report["config"]["preset"] == "fp8-delayed" and report["optimizer"] == "AdamW"
    assert set(report["baselines"]) == {"fp32 AdamW", "bf16 AdamW"}
    assert report["measured"]["fp8_scaling"] > 0


# (name, argv, words the error line holds)
BAD_FLAGS = [
    ("one state format", ["--optimizer-state", "e4m3"], ["--optimizer-state", "got e4m3"]),
    ("unknown state format", ["--optimizer-state", "e4m3,fp7"], ["--optimizer-state", "fp7"]),
    ("unknown master mode", ["--master", "bf16"], ["--master", "'bf16'"]),
    ("bf16 master with fp16", ["--master", "bf16-sr", "--preset", "fp16"], ["master bf16-sr", "'fp16'"]),
    ("batch size 0", ["--batch-size", "0"], ["--batch-size", "0"]),
    ("unknown preset", ["--preset", "fp9"], ["preset", "'fp9'"]),
]


@pytest.mark.parametrize("name, argv, words", BAD_FLAGS, ids=[c[0] for c in BAD_FLAGS])
def test_bad_flags_are_one_error_line(capsys, name, argv, words):
    status = main(["memory", "--model", "tiny", *argv])
    err = capsys.readouterr().err.splitlines()
    assert status == USER_ERROR
    assert len(err) == 1 and err[0].startswith("minifloat: error: "), err
    assert all(w in err[0] for w in words), err[0]


def test_low_precision_states_are_measured():
    """--optimizer-state e4m3,bf16: the report measures what the low-precision AdamW holds after its step (codes,
    block scales, step counters), less than torch AdamW's fp32 moments."""

    from minifloat.optim.blockwise import BlockwiseOptimizer
    from minifloat.training.loop import forward_backward
    from minifloat.training.memory import first_batch

    config = tiny(optimizer_state="e4m3,bf16")
    measured = measure(config).footprint.optimizer_state
    run = build(config)
    assert isinstance(run.optimizer, BlockwiseOptimizer)
    forward_backward(run, run.model, [first_batch(config, run.device)[0]], 0)
    run.optimizer.step()
    assert measured == run.optimizer.state_bytes() > 0
    assert measured < measure(tiny()).footprint.optimizer_state


@pytest.mark.parametrize("master", ["bf16-sr", "bf16-kahan"])
def test_bf16_weights_are_measured_without_a_master_copy(master):
    """--master bf16-sr / bf16-kahan: the block matrices are bf16 (2 B/param, their gradients too), the fp32 islands
    (norms, the tied embedding) 4; no master copy (bf16-sr: the fp32 temporaries hold no storage between steps) or a
    bf16 compensation per bf16 weight (bf16-kahan); fp32 AdamW moments over all of them."""
    config = tiny("bf16", master=master)
    model = build(config).model
    params = {id(p): p for p in model.parameters()}.values()
    low = sum(p.numel() for p in params if p.dtype == torch.bfloat16)
    n, tensors = parameter_tensors(config)
    assert 0 < low < n and all(p.dtype in (torch.bfloat16, torch.float32) for p in params)
    m = measure(config)
    assert m.optimizer == "LowPrecisionWeightOptimizer"
    assert m.footprint.weights == sum(p.numel() * p.element_size() for p in params) == FP32 * n - (FP32 - BF16) * low
    assert m.footprint.master_weights == (BF16 * low if master == "bf16-kahan" else 0)
    assert m.footprint.gradients == m.footprint.weights
    assert m.footprint.optimizer_state == 2 * FP32 * n + FP32 * tensors
    fp32 = measure(tiny("bf16"))
    assert fp32.footprint.weights - m.footprint.weights == (FP32 - BF16) * low


def test_cli_measures_bf16_weights_beside_fp32_weight_baselines(console, tmp_path):
    path = tmp_path / "memory.json"
    argv = ["memory", "--model", "tiny", "--preset", "bf16", "--master", "bf16-sr", "--batch-size", "4", "--seq-len",
            "32", "--max-bytes", "100000", "--device", "cpu", "--json", str(path)]
    assert main(argv) == 0
    assert "master bf16-sr" in console.export_text()
    report = json.loads(path.read_text())
    assert report["config"]["master"] == "bf16-sr" and report["optimizer"] == "LowPrecisionWeightOptimizer"
    measured, bf16 = report["measured"], report["baselines"]["bf16 AdamW"]
    assert measured["master_weights"] == bf16["master_weights"] == 0
    assert measured["weights"] < bf16["weights"] == FP32 * report["params"]  # the baselines keep fp32 weights


def test_cli_table_is_whole_in_a_log(monkeypatch, tmp_path):
    """Output that is not a terminal (rich assumes 80 columns there) still gets whole headers and numbers."""
    log = io.StringIO()
    monkeypatch.setattr(common, "console", Console(file=log, width=80))
    argv = ["memory", "--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--max-bytes", "100000",
            "--device", "cpu", "--preset", "bf16"]
    assert main(argv) == 0
    text = log.getvalue()
    assert "…" not in text and "fp32 AdamW" in text and "this run" in text
    assert common.console.width == 80  # restored


@pytest.mark.parametrize("device, words", [("meta", ["--device meta", "cannot take a training step"]),
                                            ("tpu", ["--device", "'tpu'"])])
def test_a_device_that_cannot_step_is_one_line(capsys, device, words):
    argv = ["memory", "--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--max-bytes", "100000",
            "--device", device]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("minifloat: error:") and all(w in err for w in words), err


class Wrapped(torch.Tensor):
    """A wrapper tensor subclass posing as fp32 (as torchao's quantized optimizer states do) over uint8 codes and an
    fp32 scale per block of 64."""

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=torch.float32)
        t.codes, t.scale = codes, scale
        return t

    def __tensor_flatten__(self):
        return ["codes", "scale"], None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"Wrapped does not compute ({func})")


def test_ledger_counts_a_wrapper_subclass_by_what_it_wraps():
    from minifloat.training.memory import StorageLedger

    codes = torch.zeros(256, 64, dtype=torch.uint8)
    state = Wrapped(codes, torch.ones(256))
    plain = torch.zeros(10)
    assert StorageLedger().add([state, plain]) == 256 * 64 + 4 * 256 + 4 * 10  # not 4 B per logical element
    ledger = StorageLedger()
    assert ledger.add([state]) > 0 and ledger.add([Wrapped(codes, torch.ones(256))]) == 4 * 256  # codes once


def test_memory_reads_text_with_a_tokenizer(tmp_path, capsys):
    """--data text with --tokenizer, as train reads it: the model's vocabulary (and so its embedding) is the
    tokenizer's, so the weights differ from the byte run's."""
    from minifloat.training.tokenizer import train_bpe

    text = tmp_path / "text"
    text.mkdir()
    for i in range(4):
        (text / f"doc{i}.txt").write_text(" ".join(f"word{(i * 7 + j) % 50}" for j in range(800)), encoding="utf-8")
    tokenizer = tmp_path / "tokenizer.json"
    train_bpe([p.read_text(encoding="utf-8") for p in sorted(text.iterdir())], vocab_size=300).save(str(tokenizer))
    reports = {}
    for name, extra in (("bytes", []), ("tokens", ["--tokenizer", str(tokenizer)])):
        path = tmp_path / f"{name}.json"
        argv = ["memory", "--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--data", str(text),
                "--device", "cpu", "--preset", "bf16", "--json", str(path), *extra]
        assert main(argv) == 0, capsys.readouterr().err
        reports[name] = json.loads(path.read_text())
    assert reports["tokens"]["config"]["tokenizer"] == str(tokenizer)
    assert reports["bytes"]["config"]["tokenizer"] is None
    # tiny's embedding (tied to its head) holds 64 weights per id: 256 byte ids against 304 (300 padded to 16)
    assert reports["tokens"]["params"] - reports["bytes"]["params"] == (304 - 256) * 64
