"""Host staging for paging tensors between a pool's device and the CPU (the trainer's adapter bank, the
sampler's adapter slots).

    pinned_paging(device) -> bool     whether copies to and from ``device`` go through pinned host memory
                                      with asynchronous (non_blocking) copies: a CUDA device torch can use
    to_host({name: t}) -> {name: c}   CPU copies, bit for bit; CUDA tensors land in pinned buffers by
                                      non_blocking copies, then ONE synchronize before they are returned
    to_device({name: c}, device)      the same bits on ``device``; to CUDA from pinned memory, non_blocking
                                      (ordered on the current stream before any later use there); on the
                                      CPU the tensors themselves (no copy)

Pinned memory lets the copy engine move the bytes while the host queues the next copy; the one
synchronize replaces one per tensor. Owns no state.
"""

from __future__ import annotations

import torch


def pinned_paging(device: str | torch.device) -> bool:
    """True when paging to or from ``device`` uses pinned host memory and non_blocking copies (CUDA only)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def to_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies of ``tensors`` (detached), from any device."""
    out, pending = {}, False
    for name, t in tensors.items():
        t = t.detach()
        if pinned_paging(t.device):
            out[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            out[name].copy_(t, non_blocking=True)
            pending = True
        else:
            out[name] = t.to("cpu", copy=True).contiguous()
    if pending:
        torch.cuda.synchronize()
    return out


def to_device(tensors: dict[str, torch.Tensor], device: str | torch.device) -> dict[str, torch.Tensor]:
    """``tensors`` on ``device``: host tensors pinned and non_blocking to CUDA; already there, unchanged."""
    if not pinned_paging(device):
        return {name: t.to(device) for name, t in tensors.items()}
    return {name: (t if t.is_pinned() or t.device.type != "cpu" else t.pin_memory()).to(device, non_blocking=True)
            for name, t in tensors.items()}
