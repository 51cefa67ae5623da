"""benchmarks/optimizer_states.py --external: the optimizer-state byte count on states of known layout, and an
optimizer that does not import recorded as unavailable. torchao and bitsandbytes are optional (the `bench` extra,
or `pip install --no-deps torchao bitsandbytes`); their cases are skipped without them."""

import importlib.util
import pathlib
import sys

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "optimizer_states.py"
WEIGHT = (512, 256)  # 131,072 elements: quantized by torchao and bitsandbytes (>= 4096, a multiple of their blocks)
N = WEIGHT[0] * WEIGHT[1]
STEP = 4  # torch's and torchao's step counter: a 0-d fp32 tensor per parameter (bitsandbytes keeps a Python int)


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_optimizer_states", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while the class is made
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def one_step(optimizer: torch.optim.Optimizer, layer: torch.nn.Module) -> None:
    torch.manual_seed(0)
    layer(torch.randn(4, WEIGHT[1])).square().mean().backward()
    optimizer.step()


def test_torch_adamw_counts_its_two_fp32_moments_and_step(bench):
    layer = torch.nn.Linear(WEIGHT[1], WEIGHT[0])
    optimizer = torch.optim.AdamW(layer.parameters())
    one_step(optimizer, layer)
    assert bench.state_bytes(optimizer) == 2 * 4 * (N + WEIGHT[0]) + 2 * STEP


def torchao_states():
    """(name, state tensor factory, its real bytes) for torchao's three optimizer-state subclasses."""
    sub8 = pytest.importorskip("torchao.optim.subclass_8bit", reason="torchao is not installed")
    sub4 = pytest.importorskip("torchao.optim.subclass_4bit", reason="torchao is not installed")
    subfp8 = pytest.importorskip("torchao.optim.subclass_fp8", reason="torchao is not installed")
    return [  # codes, fp32 scale per block, fp32 code map (256 entries for 8 bits, 16 for 4, none for FP8)
        ("8bit", lambda: sub8.OptimState8bit.zeros(WEIGHT, signed=True, block_size=256), N + 4 * N // 256 + 4 * 256),
        ("4bit", lambda: sub4.OptimState4bit.zeros(WEIGHT, signed=True, block_size=128),
         N // 2 + 4 * N // 128 + 4 * 16),
        ("fp8", lambda: subfp8.OptimStateFp8.zeros(WEIGHT, block_size=256), N + 4 * N // 256),
    ]


@pytest.mark.parametrize("case", ["8bit", "4bit", "fp8"])
def test_torchao_state_counts_codes_scales_and_map_not_its_fp32_size(bench, case):
    name, make, expected = next(c for c in torchao_states() if c[0] == case)
    weight = torch.nn.Parameter(torch.zeros(WEIGHT))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    state = make()
    assert state.dtype == torch.float32 and state.shape == WEIGHT  # it poses as an fp32 tensor (4 B/element)
    optimizer.state[weight] = {"step": torch.tensor(1.0), "exp_avg": state}
    assert bench.state_bytes(optimizer) == expected + STEP, name


def test_bitsandbytes_adamw8bit_counts_codes_absmax_and_a_shared_map_once(bench):
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    layer = torch.nn.Sequential(torch.nn.Linear(WEIGHT[1], WEIGHT[0], bias=False),  # two quantized weights
                                torch.nn.Linear(WEIGHT[0], WEIGHT[1], bias=False))
    optimizer = bnb.optim.AdamW8bit(layer.parameters())
    one_step(optimizer, layer)
    per_weight = 2 * (N + 4 * N // 256)  # uint8 m and v, an fp32 absmax per block of 256 each
    maps = 2 * 4 * 256  # the signed and unsigned dynamic maps, one object each for every parameter
    assert bench.state_bytes(optimizer) == 2 * per_weight + maps


def test_an_optimizer_that_does_not_import_is_unavailable_with_the_reason(bench):
    missing = bench.External("nowhere AdamW", "nowhere", "nowhere_such_module.optim", "AdamW")
    assert bench.probe(missing) == "ModuleNotFoundError: No module named 'nowhere_such_module'"
    assert missing.version() is None
