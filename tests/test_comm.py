"""fp32 gradient reduction hook, on a single-process gloo group (what can run on one CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from minifloat.distributed.comm import fp32_allreduce_hook


@pytest.fixture
def gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_with_hook_gives_the_local_gradients(gloo):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).bfloat16()
    local = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).bfloat16()
    local.load_state_dict(model.state_dict())
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, fp32_allreduce_hook)
    x = torch.randn(5, 8).bfloat16()
    ddp(x).float().pow(2).sum().backward()
    local(x).float().pow(2).sum().backward()
    for p, q in zip(model.parameters(), local.parameters()):
        assert p.grad.dtype == torch.bfloat16
        assert torch.equal(p.grad, q.grad)  # world size 1: averaging in fp32 and narrowing back is exact


def test_hook_reduces_in_fp32(gloo, monkeypatch):
    seen = []
    real = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        seen.append(tensor.dtype)
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", spy)
    model = nn.Linear(8, 4).bfloat16()
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, fp32_allreduce_hook)
    ddp(torch.randn(3, 8).bfloat16()).float().sum().backward()
    assert seen and all(d == torch.float32 for d in seen)
