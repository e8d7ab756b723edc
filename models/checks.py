"""The comparisons of a pool's exactness self-check (``lathe.models.exactness``), each on the decoder it is given
with the tiles ``lathe.models.tiles`` chose, each returning ``Check``s that name what differed:

- ``op_checks``: every op at the model's shapes, rows alone vs in batches (``rows_check``): the base linears and the
  LM head, a sparse layer's routing, ``lora_checks`` (the shrink and expand products at a rank, and the grouped
  path against the per-segment one), ``rms_norm``, ``log_softmax``, and attention (prefill vs each token decoded
  alone, chunked prefill, batched decode);
- ``model_checks``: the decoder end to end with two adapters, packed vs each sequence alone, and prefill vs
  token-by-token decode through a KV cache; its packed batch (``packed_logprobs``) is what the fingerprint hashes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lathe.kernels import attention as attn
from lathe.kernels import ops, tiling
from lathe.models import moe
from lathe.models.decoder import Decoder, Packed, router_name, shape_weight_names
from lathe.models.lora import REFERENCE_TILES, LoraSpec, LoraWeights, module_shape, shape_keys
from lathe.models.lora_batch import LoraBatch
from lathe.models.trials import ATTENTION_LENGTH, ATTENTION_SPLITS, BATCH_ROWS, differing, lone_row_failure

SEQ_LENGTHS = (1, 3, 13, 17, 64)
"""Sequence lengths of the end-to-end check (packed together, then each alone)."""

GROUPED_LENGTHS = (1, 5, 16, 17, 40)
"""Segment lengths of the grouped-LoRA check: under, at and over one tile, and several tiles."""

DECODED = 6
"""Tokens of each longer sequence that the end-to-end check decodes one at a time after its prefill."""


@dataclass(slots=True)
class Check:
    """One comparison: ``name`` (op and shape), ``ok``, and what differed when not ok."""

    name: str
    ok: bool
    detail: str = ""


def rows_check(name: str, op: Callable[[torch.Tensor], torch.Tensor], pool: torch.Tensor) -> Check:
    """op's rows over ``pool [300, ...]``: the batch shifted by one row (every row moves to the neighbouring
    tile position, so all positions are chained), lone rows, and batches of the other BATCH_ROWS sizes."""
    full = op(pool)
    bad = differing(op(pool[1:]), full[1:])
    if bad:
        return Check(name, False, f"rows {[i + 1 for i in bad[:4]]} differ when the batch is shifted by one row "
                                  f"(a row's position inside a tile changes its bits)")
    for i in (0, 1, attn.ATTN_ROW_TILE - 1, tiling.ROW_TILE - 1):
        if differing(op(pool[i : i + 1]), full[i : i + 1]):
            return Check(name, False, f"row {i} alone differs from the same row in a {len(pool)}-row batch")
    for m, offset in zip(BATCH_ROWS[1:-1], (1, 5, 11, 2), strict=True):
        bad = differing(op(pool[offset : offset + m]), full[offset : offset + m])
        if bad:
            return Check(name, False, f"rows {bad[:4]} of a {m}-row batch (offset {offset}) differ from the "
                                      f"{len(pool)}-row batch")
    return Check(name, True)


def _routed(model: Decoder, router: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Each row's experts and weights, as the decoder routes ``x`` (its router's logits on the pool's ladder), side
    by side in one ``[T, 2k]`` tensor."""
    logits = ops.linear(x, router, invariant=True, ladder=model.ladder)
    routing = moe.route(logits, model.cfg.experts_per_token, normalize=model.cfg.norm_topk_prob, dtype=x.dtype)
    return torch.cat([routing.weights.float(), routing.experts.float()], dim=1)


def lora_checks(model: Decoder, gen: torch.Generator, rank: int) -> list[Check]:
    """The LoRA shrink and expand products at ``rank`` for every width of the model's targets, in the dtype
    the LoRA path computes in (fp32 under a bf16 base): their shapes follow the adapter's rank, not the base."""
    cfg, dev = model.cfg, model.device
    wide = torch.promote_types(model.dtype, torch.float32)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=dev, dtype=wide)

    targets = [t for _, t in shape_keys(cfg)]
    checks = []
    ladder = model.lora_ladders.get(rank, tiling.REFERENCE)
    for width in sorted({module_shape(cfg, t)[0] for t in targets}):
        a = rand(rank, width)
        checks.append(rows_check(f"lora shrink {width}->{rank}",
                            lambda x, a=a: ops.linear(x, a, invariant=True, ladder=ladder),
                            rand(BATCH_ROWS[-1], width)))
    for width in sorted({module_shape(cfg, t)[1] for t in targets}):
        b = rand(width, rank)
        checks.append(rows_check(f"lora expand {rank}->{width}",
                            lambda x, b=b: ops.linear(x, b, invariant=True, ladder=ladder),
                            rand(BATCH_ROWS[-1], rank)))
    checks.append(_grouped_check(model, rank, rand))
    return checks


def _grouped_check(model: Decoder, rank: int, rand: Callable[..., torch.Tensor]) -> Check:
    """The grouped LoRA path (what both engines run) against the per-segment reference, for every target
    shape at ``rank``: segments of ``GROUPED_LENGTHS`` rows over three adapters, packed and each alone."""
    name = f"lora grouped vs per-segment rank {rank}"
    shapes = {key: module_shape(model.cfg, key[1]) for key in shape_keys(model.cfg)}
    adapters = [LoraWeights(LoraSpec(rank=rank), {k: rand(rank, i) for k, (i, _) in shapes.items()},
                            {k: rand(o, rank) * 0.02 for k, (_, o) in shapes.items()}) for _ in range(3)]
    seg = [0]
    for n in GROUPED_LENGTHS:
        seg.append(seg[-1] + n)
    ids = [s % len(adapters) for s in range(len(GROUPED_LENGTHS))]
    packed = LoraBatch(seg, ids, adapters)
    for key, (width, _) in shapes.items():
        x = rand(seg[-1], width)
        grouped = packed.delta(key, x)
        ways = {"per-segment one": REFERENCE_TILES, "per-segment one on the rank's ladder": model.lora_ladders}
        for which, ladders in ways.items():
            bad = differing(grouped, packed.delta_per_segment(key, x, ladders))
            if bad:
                return Check(name, False, f"{key[1]}: rows {bad[:4]} of the grouped product differ from the {which}")
        for s, adapter in enumerate(ids):
            alone = LoraBatch([0, seg[s + 1] - seg[s]], [0], [adapters[adapter]]).delta(key, x[seg[s] : seg[s + 1]],
                                                                                        model.lora_ladders)
            if differing(alone, grouped[seg[s] : seg[s + 1]]):
                return Check(name, False, f"{key[1]}: the {GROUPED_LENGTHS[s]}-row segment alone differs from the "
                                          f"same segment among {len(GROUPED_LENGTHS)}")
    return Check(name, True)


def op_checks(model: Decoder, gen: torch.Generator, lora_rank: int) -> list[Check]:
    cfg, w, dt, dev = model.cfg, model.w, model.dtype, model.device

    def pool(width: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(BATCH_ROWS[-1], width, generator=gen) * scale).to(device=dev, dtype=dt)

    checks: list[Check] = []
    seen: set[tuple[int, int]] = set()
    for name in shape_weight_names(cfg):
        weight, bias = w[name], w.get(name.removesuffix(".weight") + ".bias")
        if (weight.shape[0], weight.shape[1], bias is not None) in seen:
            continue
        seen.add((weight.shape[0], weight.shape[1], bias is not None))
        target = name.removesuffix(".weight").rpartition(".")[2]
        checks.append(rows_check(f"linear {target} {weight.shape[1]}->{weight.shape[0]}",
                            lambda x, weight=weight, bias=bias: ops.linear(x, weight, bias, invariant=True,
                                                                           ladder=model.ladder),
                            pool(weight.shape[1])))
    head = model.lm_head
    checks.append(rows_check(f"linear lm_head {head.shape[1]}->{head.shape[0]}",
                        lambda x: ops.linear(x, head, invariant=True, ladder=model.ladder), pool(head.shape[1])))
    lone = lone_row_failure(model, model.ladder, [torch.get_num_threads()], model.packed, seed=1)  # other rows
    checks.append(Check("linear lone rows", lone is None, lone or ""))
    sparse = [i for i in range(cfg.num_layers) if cfg.sparse(i)]
    if sparse:
        router = w[router_name(sparse[0])]
        checks.append(rows_check(f"moe routing {cfg.num_experts} experts top {cfg.experts_per_token}",
                            lambda x: _routed(model, router, x), pool(cfg.hidden_size)))
    checks += lora_checks(model, gen, lora_rank)
    norm = w["model.norm.weight"]
    checks.append(rows_check(f"rms_norm {cfg.hidden_size}",
                        lambda x: ops.rms_norm(x, norm, cfg.rms_norm_eps, invariant=True), pool(cfg.hidden_size)))
    checks.append(rows_check(f"log_softmax {cfg.vocab_size}", lambda x: ops.log_softmax(x, invariant=True),
                        pool(cfg.vocab_size, scale=4.0)))
    checks.append(_attention_check(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dt, dev, gen, model.attn_tiles,
                                   model.attn_chain))
    return checks


def _attention_check(hq: int, hkv: int, d: int, dt: torch.dtype, dev: torch.device, gen: torch.Generator,
                     tiles: tuple[int, ...], chain: int) -> Check:
    name = f"attention Hq={hq} Hkv={hkv} D={d} tiles {list(tiles)}{f', decode kernel block {chain}' if chain else ''}"
    n = ATTENTION_LENGTH
    q, k, v = (torch.randn(n, h, d, generator=gen).to(device=dev, dtype=dt) for h in (hq, hkv, hkv))
    scale = d**-0.5
    prefill = attn.attention(q, k, v, q_offset=0, scale=scale, invariant=True, tiles=tiles)
    for t in (0, 1, 2, 63, 64, 65, 127, 255, 256, n - 1):
        alone = attn.attention(q[t : t + 1], k[: t + 1], v[: t + 1], q_offset=t, scale=scale, invariant=True,
                              tiles=tiles)
        if differing(alone, prefill[t : t + 1]):
            return Check(name, False, f"token {t} decoded alone differs from the {n}-token prefill")
    for s0, s1 in zip(ATTENTION_SPLITS, ATTENTION_SPLITS[1:], strict=False):
        part = attn.attention(q[s0:s1], k[:s1], v[:s1], q_offset=s0, scale=scale, invariant=True, tiles=tiles)
        if differing(part, prefill[s0:s1]):
            return Check(name, False, f"chunked prefill of tokens {s0}:{s1} differs from the {n}-token prefill")
    for length, count in ((64, 2), (ATTENTION_SPLITS[3], 3)):  # several sequences of one length at once
        together = attn.attention_batch(*(x[: length * count].view(count, length, *x.shape[1:]) for x in (q, k, v)),
                                       scale=scale, invariant=True, tiles=tiles)
        for j in range(count):
            alone = attn.attention(*(x[j * length : (j + 1) * length] for x in (q, k, v)), q_offset=0, scale=scale,
                                  invariant=True, tiles=tiles)
            if differing(alone, together[j]):
                return Check(name, False, f"sequence {j} of {count} {length}-token sequences attended together "
                                          "differs from it alone")
    positions = [0, 2, 12, 16, 63, 64, 200, n - 1]
    slots = -(-n // attn.KEY_CHUNK) * attn.KEY_CHUNK
    ks = torch.zeros(len(positions), slots, hkv, d, dtype=dt, device=dev)
    vs = torch.zeros_like(ks)
    for s, p in enumerate(positions):
        ks[s, : p + 1], vs[s, : p + 1] = k[: p + 1], v[: p + 1]
    for count in (1, 3, len(positions)):
        batched = attn.decode_attention(q[positions[:count]], ks[:count], vs[:count], positions[:count], scale=scale,
                                       invariant=True, chain=chain)
        bad = differing(batched, prefill[positions[:count]])
        if bad:
            return Check(name, False, f"batched decode of {count} sequences: positions "
                                      f"{[positions[i] for i in bad]} differ from the prefill")
    return Check(name, True)


class _Cache:
    """A plain KV cache for the end-to-end check (what the decoder needs, as the sampler's does it).

    keys/values ``[layers, S, N, Hkv, D]`` with N whole key chunks and zeros past each sequence's end.
    """

    def __init__(self, model: Decoder, seqs: int, tokens: int) -> None:
        cfg = model.cfg
        slots = -(-tokens // attn.KEY_CHUNK) * attn.KEY_CHUNK
        shape = (cfg.num_layers, seqs, slots, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.v = torch.zeros_like(self.k)
        self.length = [[0] * seqs for _ in range(cfg.num_layers)]

    def extend(self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        start = self.length[layer][seq]
        end = start + k.shape[0]
        self.k[layer, seq, start:end], self.v[layer, seq, start:end] = k, v
        self.length[layer][seq] = end
        return self.k[layer, seq, :end], self.v[layer, seq, :end], start

    def decode(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, list[int], None]:
        positions = [self.extend(layer, s, k[s:s + 1], v[s:s + 1])[2] for s in range(k.shape[0])]
        return self.k[layer], self.v[layer], positions, None


def logprobs(model: Decoder, seqs: list[list[int]], positions: list[list[int]], lora: LoraBatch,
              kv: _Cache | None = None) -> torch.Tensor:
    """Target logprobs of a packed step whose targets are each token's successor (token id + 1 mod V)."""
    batch = Packed.from_sequences(seqs)
    batch.positions = torch.tensor([p for ps in positions for p in ps], dtype=torch.long)
    h = model.hidden(batch, lora, kv)
    targets = ((batch.tokens + 1) % model.cfg.vocab_size).to(h.device)
    return model.target_logprobs(h, targets, lora)


def random_adapters(model: Decoder, rank: int, gen: torch.Generator) -> list[LoraWeights]:
    out = []
    for seed in (1, 2):
        adapter = LoraWeights.init(model.cfg, LoraSpec(rank=rank, seed=seed), seed, device=model.device)
        with torch.no_grad():
            for b in adapter.b.values():  # a fresh B is zero; the check needs adapters that change the bits
                b.copy_(torch.randn(b.shape, generator=gen) * 0.02)
        out.append(adapter)
    return out


def layout(lengths: list[int], adapters: list[LoraWeights]) -> LoraBatch:
    """Sequence s gets adapter s % 2, one segment per sequence."""
    seg = [0]
    for n in lengths:
        seg.append(seg[-1] + n)
    return LoraBatch(seg, [s % len(adapters) for s in range(len(lengths))], adapters)


def packed_logprobs(model: Decoder, gen: torch.Generator, lora_rank: int
                    ) -> tuple[list[list[int]], list[LoraWeights], torch.Tensor]:
    """The self-check's batch: random sequences of ``SEQ_LENGTHS`` tokens and two random adapters of ``lora_rank``
    (drawn from ``gen``), and their logprobs in one packed pass: what the fingerprint hashes."""
    vocab = model.cfg.vocab_size
    seqs = [torch.randint(vocab, (n,), generator=gen).tolist() for n in SEQ_LENGTHS]
    adapters = random_adapters(model, lora_rank, gen)
    lengths = [len(s) for s in seqs]
    with torch.no_grad():
        return seqs, adapters, logprobs(model, seqs, [list(range(n)) for n in lengths], layout(lengths, adapters))


def model_checks(model: Decoder, gen: torch.Generator, lora_rank: int) -> tuple[list[Check], torch.Tensor]:
    """End-to-end checks; also returns the packed logprobs the fingerprint hashes."""
    seqs, adapters, packed = packed_logprobs(model, gen, lora_rank)
    lengths = [len(s) for s in seqs]
    with torch.no_grad():
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        for s, seq in enumerate(seqs):
            alone = logprobs(model, [seq], [list(range(len(seq)))], LoraBatch([0, len(seq)], [0],
                                                                                [adapters[s % 2]]))
            bad = differing(alone, packed[cu[s] : cu[s + 1]])
            if bad:
                detail = f"sequence of {len(seq)} tokens: tokens {bad[:4]} differ alone from the packed batch {lengths}"
                return [Check("decoder packed vs alone", False, detail)], packed
        checks = [Check("decoder packed vs alone", True)]
        live = [s for s, n in enumerate(lengths) if n > DECODED]
        cache = _Cache(model, len(live), max(lengths))
        prefill = [seqs[s][: lengths[s] - DECODED] for s in live]
        logprobs(model, prefill, [list(range(len(p))) for p in prefill], layout([len(p) for p in prefill],
                                                                                   [adapters[s % 2] for s in live]),
                  cache)
        for step in range(DECODED):
            pos = [lengths[s] - DECODED + step for s in live]
            out = logprobs(model, [[seqs[s][p]] for s, p in zip(live, pos, strict=True)], [[p] for p in pos],
                            layout([1] * len(live), [adapters[s % 2] for s in live]), cache)
            want = torch.stack([packed[cu[s] + p] for s, p in zip(live, pos, strict=True)])
            bad = differing(out, want)
            if bad:
                checks.append(Check("decoder prefill vs decode", False,
                                    f"decode step at positions {[pos[i] for i in bad]} differs from the packed "
                                    f"forward"))
                return checks, packed
        checks.append(Check("decoder prefill vs decode", True))
    return checks, packed
