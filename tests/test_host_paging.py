"""Paging through host memory (``lathe.models.host``), as the trainer's adapter bank uses it.

Protects: the choice of pinned memory and non_blocking copies (CUDA only, never on the CPU); the files the bank
writes are the safetensors library's, byte for byte, from tensors of any dtype or view on any device, and copies
(independent of their source); an adapter paged out and back through the bank's code path keeps its weights,
optimizer state and gradients bit for bit, and its copy (a recovery snapshot's, written while the adapter trains
on) keeps the files it had when copied. The CUDA case (pinned buffers, the same round trip) is marked ``gpu``; its
CPU twin is the test above it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from lathe.models.config import ModelConfig
from lathe.models.host import pinned_paging, safetensors_bytes, to_device
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
    file = safetensors_bytes(src)
    assert file == st_save({n: t.cpu().contiguous() for n, t in src.items()})
    host = st_load(file)
    assert all(torch.equal(host[n], t.cpu()) and host[n].dtype == t.dtype for n, t in src.items())
    back = to_device(host, device)
    src["fp32"].add_(1.0)  # the file does not follow its source
    assert st_load(file)["fp32"].equal(host["fp32"]) and not torch.equal(host["fp32"], src["fp32"].cpu())
    assert all(torch.equal(back[n].cpu(), host[n]) and back[n].device.type == device for n in host)


def test_safetensors_bytes_equal_the_librarys_for_every_dtype_and_shape() -> None:
    gen = torch.Generator().manual_seed(2)
    tensors = {"f32": torch.randn(3, 5, generator=gen), "bf16": torch.randn(7, generator=gen).bfloat16(),
               "f16": torch.randn(2, 2, generator=gen).half(), "f64": torch.randn(2, generator=gen).double(),
               "i64": torch.arange(5), "i32": torch.arange(3, dtype=torch.int32),
               "u8": torch.arange(4, dtype=torch.uint8),
               "i16": torch.tensor([3], dtype=torch.int16), "i8": torch.tensor([-1, 2], dtype=torch.int8),
               "bool": torch.tensor([True, False]), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
               "strided": torch.randn(4, 6, generator=gen)[:, ::2]}
    assert safetensors_bytes(tensors) == st_save({n: t.contiguous() for n, t in tensors.items()})
    assert safetensors_bytes({}) == st_save({})
    with pytest.raises(TypeError, match="tensor 'c': dtype torch.complex64"):
        safetensors_bytes({"c": torch.zeros(2, dtype=torch.complex64)})


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
    files = a.page_files("float32")  # what a recovery snapshot writes later, on another thread, while ``a`` trains on
    taken = {name: bytes(data) for name, data in files.items()}
    b = Adapter.fresh("m", "t", "lathe/tiny-llama", cfg, LoraSpec(rank=4), seed=9, device=device)
    b.restore_page(files)
    for (n, p), q in zip(a.weights.named_parameters().items(), b.weights.named_parameters().values(), strict=True):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad) and q.device.type == device, n
    want, got = state_tensors(a.opt), state_tensors(b.opt)
    assert want.keys() == got.keys() and all(torch.equal(want[k].cpu(), got[k].cpu()) for k in want)
    with torch.no_grad():  # a trains on: the files share none of its tensors
        for p in a.weights.parameters():
            p.add_(1.0)
            p.grad.add_(1.0)
        for t in a.opt.exp_avg.values():
            t.add_(1.0)
    a.opt.step += 1
    assert files == taken and a.page_files("float32") != taken


def test_bank_paging_round_trips_bits_on_cpu(tiny_dir: Path) -> None:
    _adapter_round_trip(tiny_dir, "cpu")


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_bank_paging_round_trips_bits_on_cuda(tiny_dir: Path, device: str) -> None:
    _adapter_round_trip(tiny_dir, device)
