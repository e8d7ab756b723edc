"""Host staging for paging tensors between a pool's device and the CPU (the trainer's adapter bank, the
sampler's adapter slots).

    pinned_paging(device) -> bool     whether copies to and from ``device`` go through pinned host memory
                                      with asynchronous (non_blocking) copies: a CUDA device torch can use
    to_device({name: c}, device)      the same bits on ``device``; to CUDA from pinned memory, non_blocking
                                      (ordered on the current stream before any later use there); on the
                                      CPU the tensors themselves (no copy)
    safetensors_bytes({name: t})      the safetensors file of the tensors, byte for byte what
                                      ``safetensors.torch.save`` writes, each tensor's bytes copied once, from
                                      its device straight into its place in the file

Pinned memory lets the copy engine move the bytes to the device while the host queues the next copy. Owns no
state.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

import torch

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.int32: "I32", torch.float32: "F32", torch.float64: "F64", torch.int64: "I64",
}
"""The dtypes ``safetensors_bytes`` writes, by their names in the file, in the order the safetensors library ranks
them (it lays tensors out by that rank, highest first, then by name)."""


def pinned_paging(device: str | torch.device) -> bool:
    """True when paging to or from ``device`` uses pinned host memory and non_blocking copies (CUDA only)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def to_device(tensors: dict[str, torch.Tensor], device: str | torch.device) -> dict[str, torch.Tensor]:
    """``tensors`` on ``device``: host tensors pinned and non_blocking to CUDA; already there, unchanged."""
    if not pinned_paging(device):
        return {name: t.to(device) for name, t in tensors.items()}
    return {name: (t if t.is_pinned() or t.device.type != "cpu" else t.pin_memory()).to(device, non_blocking=True)
            for name, t in tensors.items()}


def safetensors_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The safetensors file of ``tensors`` (no metadata), equal byte for byte to ``safetensors.torch.save``'s.

    That library copies each tensor to host memory, then to a byte string, then into the file: three copies of
    every byte. Here each tensor is copied once, from wherever it lives into its place in the file, and the file
    once more into the returned bytes."""
    rank = {dtype: i for i, dtype in enumerate(SAFETENSORS_DTYPES)}
    for name, t in tensors.items():
        if t.dtype not in rank:
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name here")
    names = sorted(tensors, key=lambda n: (-rank[tensors[n].dtype], n))
    header, offset = {}, 0
    for n in names:
        t = tensors[n]
        size = t.numel() * t.element_size()
        header[n] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                     "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the library pads it
    start = 8 + len(text)
    file = bytearray(start + offset)
    file[:start] = struct.pack("<Q", len(text)) + text
    data = torch.frombuffer(file, dtype=torch.uint8, offset=start) if offset else None
    for n in names:
        begin, end = header[n]["data_offsets"]
        if end > begin:
            t = tensors[n].detach()
            data[begin:end].view(t.dtype).view(t.shape).copy_(t)
    return bytes(file)
