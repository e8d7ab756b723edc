"""Cost of batch invariance: ``lathe.kernels.ops`` with invariant=True vs. invariant=False on CPU.

One SmolLM2-135M decoder layer (hidden 576, intermediate 1536, 9 query / 3 KV heads, head_dim 64)
and its LM head (vocab 49152), random weights, each case timed in both modes:
  layer forward, training-style: 8 sequences x 256 tokens packed, autograd recording
  LM head + log_softmax over those 2048 tokens, 256 rows at a time (as the trainer chunks them)
  layer decode step: 32 sequences, one new token each against a 256-token KV cache (batched decode
  attention, as the sampler runs it), and the same for a single sequence
  LM head + log_softmax of the 32 decoded tokens, and of one
  and, to split the layer figures, attention alone for the 8x256 prefill and the 32-sequence decode
Three modes, interleaved run by run: plain ops, invariant ops with the reference tiles (16-row linear,
4-row attention), and invariant ops with the tile ladders this machine's self-check chooses
(``choose_row_tiles``, ``choose_attention_tiles``, printed; what a pool runs). Prints the median wall time
of --repeats runs (after --warmup) per mode and each invariant mode's ratio to plain.

Run it alone: other processes on the same cores distort these timings badly.
Run: python bench/bench_invariance.py [--repeats 5 --warmup 1 --threads 2 --dtypes fp32 bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from machine import cpu_line

from lathe.kernels import attention as attn
from lathe.kernels import ops, tiling
from lathe.models.attention_tiles import choose_attention_tiles
from lathe.models.tiles import choose_row_tiles, head_block

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
Mode = tuple[bool, tuple[int, ...], tuple[int, ...]]
"""(invariant, the linears' tile ladder, prefill attention's tile ladder)."""


@dataclass(frozen=True, slots=True)
class Shapes:
    hidden: int = 576
    intermediate: int = 1536
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    vocab: int = 49152
    eps: float = 1e-5
    train_sequences: int = 8
    train_length: int = 256
    decode_sequences: int = 32
    decode_cache: int = 256
    logit_chunk: int = 256


SMOLLM2 = Shapes()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per case and mode (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before timing")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    args = p.parse_args(argv)
    for name in ("repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1; got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be at least 0; got {args.warmup}")
    return args


class Layer:
    """Random weights of one Llama-style layer and its LM head, and their forward in either mode."""

    def __init__(self, s: Shapes, dtype: torch.dtype, *, requires_grad: bool) -> None:
        gen = torch.Generator().manual_seed(0)

        def weight(*shape: int) -> torch.Tensor:
            w = (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(dtype)
            return w.requires_grad_(requires_grad)

        self.s = s
        self.norm1, self.norm2, self.final_norm = (torch.ones(s.hidden, dtype=dtype) for _ in range(3))
        self.q = weight(s.heads * s.head_dim, s.hidden)
        self.k = weight(s.kv_heads * s.head_dim, s.hidden)
        self.v = weight(s.kv_heads * s.head_dim, s.hidden)
        self.o = weight(s.hidden, s.heads * s.head_dim)
        self.gate = weight(s.intermediate, s.hidden)
        self.up = weight(s.intermediate, s.hidden)
        self.down = weight(s.hidden, s.intermediate)
        self.head = weight(s.vocab, s.hidden)

    def weights(self) -> list[torch.Tensor]:
        """The weights a pool's ``choose_row_tiles`` tries: each distinct linear shape and the LM head's start."""
        return [w.detach() for w in (self.q, self.k, self.gate, self.down, head_block(self.head))]

    def forward(
        self,
        x: torch.Tensor,
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        mode: Mode,
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; attend(q [T, Hq, D], k, v [T, Hkv, D]) -> [T, Hq, D]."""
        s, (invariant, tiles, _) = self.s, mode

        def linear(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return ops.linear(h, w, invariant=invariant, ladder=tiling.Ladder(tiles))

        h = ops.rms_norm(x, self.norm1, s.eps, invariant=invariant)
        q = linear(h, self.q).view(-1, s.heads, s.head_dim)
        k = linear(h, self.k).view(-1, s.kv_heads, s.head_dim)
        v = linear(h, self.v).view(-1, s.kv_heads, s.head_dim)
        x = x + linear(attend(q, k, v).reshape(x.shape[0], -1), self.o)
        h = ops.rms_norm(x, self.norm2, s.eps, invariant=invariant)
        return x + linear(F.silu(linear(h, self.gate)) * linear(h, self.up), self.down)

    def logprobs(self, x: torch.Tensor, mode: Mode) -> list[torch.Tensor]:
        """Full-vocabulary log-softmax of x [T, hidden], ``logit_chunk`` rows at a time."""
        (invariant, tiles, _), out = mode, []
        for rows in x.split(self.s.logit_chunk):
            h = ops.rms_norm(rows, self.final_norm, self.s.eps, invariant=invariant)
            out.append(ops.log_softmax(ops.linear(h, self.head, invariant=invariant, ladder=tiling.Ladder(tiles)),
                                       invariant=invariant))
        return out


def train_forward(layer: Layer, x: torch.Tensor, mode: Mode) -> torch.Tensor:
    s = layer.s

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pieces = (t.split(s.train_length) for t in (q, k, v))
        scale = s.head_dim**-0.5
        return torch.cat(
            [attn.attention(*qkv, q_offset=0, scale=scale, invariant=mode[0], tiles=mode[2])
             for qkv in zip(*pieces, strict=True)]
        )

    return layer.forward(x, attend, mode)


def decode_step(layer: Layer, x: torch.Tensor, cache: torch.Tensor, mode: Mode) -> torch.Tensor:
    """One token for each of the B sequences at position decode_cache, through ``attn.decode_attention`` (the
    sampler's pure-decode path); cache [2, B, N, Hkv, D] with N whole key chunks, zeros past the token."""
    s, t = layer.s, layer.s.decode_cache

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = cache[:, : q.shape[0]]
        keys[:, t], values[:, t] = k, v
        return attn.decode_attention(q, keys, values, [t] * q.shape[0], scale=s.head_dim**-0.5, invariant=mode[0])

    return layer.forward(x, attend, mode)


def median_ms(fn: Callable[[Mode], object], modes: list[Mode], repeats: int, warmup: int) -> list[float]:
    """Median ms of fn(mode) for each mode, the modes alternated run by run so that drift hits all alike."""
    for _ in range(warmup):
        for mode in modes:
            fn(mode)
    times: list[list[float]] = [[] for _ in modes]
    for _ in range(repeats):
        for i, mode in enumerate(modes):
            start = time.perf_counter()
            fn(mode)
            times[i].append(time.perf_counter() - start)
    return [1e3 * statistics.median(t) for t in times]


def cases(s: Shapes, infer_layer: Layer, dtype: torch.dtype) -> dict[str, Callable[[Mode], object]]:
    """Each case as fn(mode) -> result; inputs built once, shared by every mode."""
    gen = torch.Generator().manual_seed(1)
    train_layer = Layer(s, dtype, requires_grad=True)
    tokens = s.train_sequences * s.train_length
    x_train = torch.randn(tokens, s.hidden, generator=gen).to(dtype)
    x_decode = torch.randn(s.decode_sequences, s.hidden, generator=gen).to(dtype)
    slots = -(-(s.decode_cache + 1) // attn.KEY_CHUNK) * attn.KEY_CHUNK
    cache = torch.randn(2, s.decode_sequences, slots, s.kv_heads, s.head_dim, generator=gen).to(dtype)
    cache[:, :, s.decode_cache + 1 :] = 0  # spare slots hold zeros, as in the sampler's cache

    def train(mode: Mode) -> object:
        return train_forward(train_layer, x_train, mode)

    def train_head(mode: Mode) -> object:
        with torch.no_grad():
            return infer_layer.logprobs(x_train, mode)

    def decode(mode: Mode) -> object:
        with torch.no_grad():
            return decode_step(infer_layer, x_decode, cache, mode)

    def decode_one(mode: Mode) -> object:
        with torch.no_grad():
            return decode_step(infer_layer, x_decode[:1], cache, mode)

    def decode_one_head(mode: Mode) -> object:
        with torch.no_grad():
            return infer_layer.logprobs(x_decode[:1], mode)

    def decode_head(mode: Mode) -> object:
        with torch.no_grad():
            return infer_layer.logprobs(x_decode, mode)

    scale = s.head_dim**-0.5
    q_train = torch.randn(s.train_length, s.heads, s.head_dim, generator=gen).to(dtype)
    q_decode = torch.randn(s.decode_sequences, s.heads, s.head_dim, generator=gen).to(dtype)

    def prefill_attention(mode: Mode) -> object:
        with torch.no_grad():
            kv = cache[0, 0, : s.train_length]
            return [
                attn.attention(q_train, kv, kv, q_offset=0, scale=scale, invariant=mode[0], tiles=mode[2])
                for _ in range(s.train_sequences)
            ]

    def decode_attention(mode: Mode) -> object:
        with torch.no_grad():
            positions = [s.decode_cache] * s.decode_sequences
            return attn.decode_attention(q_decode, cache[0], cache[1], positions, scale=scale, invariant=mode[0])

    return {
        f"layer forward {s.train_sequences}x{s.train_length} (autograd on)": train,
        f"LM head + log_softmax, {tokens} tokens": train_head,
        f"layer decode step, {s.decode_sequences} seqs, cache {s.decode_cache}": decode,
        f"LM head + log_softmax, {s.decode_sequences} tokens": decode_head,
        f"layer decode step, 1 seq, cache {s.decode_cache}": decode_one,
        "LM head + log_softmax, 1 token": decode_one_head,
        f"attention only, {s.train_sequences}x{s.train_length} prefill": prefill_attention,
        f"attention only, {s.decode_sequences} decodes, cache {s.decode_cache}": decode_attention,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"torch {torch.__version__}, {args.threads} threads, CPU capability {cpu}; {cpu_line()}")
    for name in args.dtypes:
        layer = Layer(SMOLLM2, DTYPES[name], requires_grad=False)
        threads = sorted({1, args.threads})
        ladder = choose_row_tiles(layer.weights(), threads)
        attn = choose_attention_tiles(SMOLLM2.heads, SMOLLM2.kv_heads, SMOLLM2.head_dim, DTYPES[name],
                                      torch.device("cpu"), threads)
        reference = ((tiling.ROW_TILE,), (attn.ATTN_ROW_TILE,))
        modes: list[Mode] = [(False, *reference), (True, *reference), (True, ladder, attn)]
        print(f"{name}: tile ladders chosen by the self-check on this machine: linear {ladder}, attention {attn}")
        print(f"{'dtype':5}  {'case':48}  {'plain ms':>9}  {'ref ms':>9}  {'ratio':>6}  {'ladder ms':>9}  "
              f"{'ratio':>6}")
        for case, fn in cases(SMOLLM2, layer, DTYPES[name]).items():
            plain, ref, chosen = median_ms(fn, modes, args.repeats, args.warmup)
            print(f"{name:5}  {case:48}  {plain:9.2f}  {ref:9.2f}  {ref / plain:6.2f}  {chosen:9.2f}  "
                  f"{chosen / plain:6.2f}", flush=True)

if __name__ == "__main__":
    main()
