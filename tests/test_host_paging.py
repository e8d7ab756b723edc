"""Paging through host memory (``lathe.models.host``), as the trainer's adapter bank uses it.

Protects: the choice of pinned memory and non_blocking copies (CUDA only, never on the CPU); host copies
are copies (bits equal, independent of the source, contiguous, any dtype or view); an adapter paged out
and back through the bank's code path keeps its weights, optimizer state and gradients bit for bit. The
CUDA case (pinned buffers, the same round trip) is marked ``gpu``; its CPU twin is the test above it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lathe.models.config import ModelConfig
from lathe.models.host import pinned_paging, to_device, to_host
from lathe.models.lora import LoraSpec
from lathe.trainer.bank import Adapter
from lathe.trainer.optim_state import state_tensors

CUDA = [pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: torch sees none here")]


def test_pinned_paging_is_chosen_for_cuda_only() -> None:
    assert not pinned_paging("cpu") and not pinned_paging(torch.device("cpu"))
    assert pinned_paging("cuda") == torch.cuda.is_available()
    assert pinned_paging("cuda:0") == torch.cuda.is_available()


def _tensors(device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=gen)
    return {"fp32": base.to(device), "bf16": base.to(torch.bfloat16).to(device), "view": base.t().to(device)[:, 1:5]}


def _round_trip(device: str) -> None:
    src = _tensors(device)
    host = to_host(src)
    for name, t in src.items():
        assert host[name].device.type == "cpu" and host[name].is_contiguous()
        assert host[name].is_pinned() == pinned_paging(device)
        assert torch.equal(host[name], t.cpu()) and host[name].dtype == t.dtype
    back = to_device(host, device)
    src["fp32"].add_(1.0)  # the host copy does not follow its source
    assert not torch.equal(host["fp32"], src["fp32"].cpu())
    assert all(torch.equal(back[n].cpu(), host[n]) and back[n].device.type == device for n in host)


def test_host_round_trip_keeps_bits_on_cpu() -> None:
    _round_trip("cpu")


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_host_round_trip_keeps_bits_pinned_on_cuda(device: str) -> None:
    _round_trip(device)


def _adapter_round_trip(tiny_dir: Path, device: str) -> None:
    cfg = ModelConfig.from_dir(tiny_dir)
    a = Adapter.fresh("m", "t", "lathe/tiny-llama", cfg, LoraSpec(rank=4), seed=3, device=device)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in a.weights.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
            p.grad = torch.randn(p.shape, generator=gen).to(device)
        for t in state_tensors(a.opt).values():
            t.copy_(torch.randn(t.shape, generator=gen))
    files = a.page_files("float32")
    b = Adapter.fresh("m", "t", "lathe/tiny-llama", cfg, LoraSpec(rank=4), seed=9, device=device)
    b.restore_page(files)
    for (n, p), q in zip(a.weights.named_parameters().items(), b.weights.named_parameters().values(), strict=True):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad) and q.device.type == device, n
    want, got = state_tensors(a.opt), state_tensors(b.opt)
    assert want.keys() == got.keys() and all(torch.equal(want[k].cpu(), got[k].cpu()) for k in want)


def test_bank_paging_round_trips_bits_on_cpu(tiny_dir: Path) -> None:
    _adapter_round_trip(tiny_dir, "cpu")


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_bank_paging_round_trips_bits_on_cuda(tiny_dir: Path, device: str) -> None:
    _adapter_round_trip(tiny_dir, device)
