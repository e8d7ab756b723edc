"""The Llama-family decoder shared by the trainer and the native sampler.

Owns the frozen base weights (``dtype`` of the pool: fp32 or bf16, on the pool's ``device``) and the
forward math: RMSNorm, RoPE from one precomputed table, grouped-query attention, SwiGLU, tied or untied
embeddings, Qwen2's q/k/v bias, Qwen3's per-head q/k RMSNorm, and Qwen3-MoE's routed experts
(``lathe.models.moe``). It never owns adapters or optimizer state: a batch's adapters (``LoraDeltas``: a
``LoraBatch``, an ``SgmvBatch``, or the sampler's BGMV slots) are passed in per call, and so is the sampler's KV
cache; both live on ``device``. Callers build a batch's index tensors on the CPU; ``hidden`` and
``target_logprobs`` move them.

A batch is *packed*: the tokens of all sequences are one flat ``[T]`` row, sequence ``s`` owns rows
``cu_seqlens[s]:cu_seqlens[s+1]``, and every matmul runs once over all ``T`` rows. With
``invariant=True`` every op is batch-invariant (``lathe.kernels.ops``), so a token's hidden state and
logprob have the same bits whatever else is in the batch and whether it was prefilled or decoded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file
from torch.utils.checkpoint import checkpoint

from lathe.kernels import activations, chain, ops, rotary, tiling
from lathe.kernels import attention as attn
from lathe.models import moe
from lathe.models.config import ModelConfig
from lathe.models.lora import (
    UNEMBED,
    LoraDeltas,
    TrainableDeltas,
    expert_target,
    layer_targets,
    mlp_targets,
    shape_keys,
    weight_name,
)

LOGIT_CHUNK = 256  # rows of full-vocabulary logits alive at once in target_logprobs
ExpertLoad = list[tuple[int, list[int]]]  # (sparse layer, tokens routed to each of its experts), per pass


class KVCache(Protocol):
    """What the decoder needs from a KV cache (the sampler owns the storage). A cache that also has
    ``decode(layer, k, v [S, Hkv, D]) -> (k, v, positions [S], table)`` (append one row per sequence, return every
    sequence's keys and values: [S, N, Hkv, D] with ``table`` None, or a paged cache's blocks [B, 64, Hkv, D] with
    ``table [S, C]`` naming each sequence's blocks) gets pure decode steps as one batched attention."""

    def extend(self, layer: int, seq: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Append ``k, v [L, Hkv, D]`` of sequence ``seq``; return all its keys, values and the
        absolute position of the first new token."""
        ...


@dataclass(slots=True)
class Packed:
    """A packed batch: ``tokens [T]``, ``positions [T]`` and sequence boundaries ``cu_seqlens [S+1]``."""

    tokens: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: list[int]

    @classmethod
    def from_sequences(cls, seqs: list[list[int]]) -> Packed:
        cu = [0]
        for s in seqs:
            cu.append(cu[-1] + len(s))
        tokens = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
        positions = torch.cat([torch.arange(len(s)) for s in seqs]) if seqs else torch.zeros(0, dtype=torch.long)
        return cls(tokens, positions, cu)

    def to(self, device: torch.device) -> Packed:
        """The same batch with its tensors on ``device`` (itself when they are there already)."""
        if self.tokens.device == device:
            return self
        return Packed(self.tokens.to(device), self.positions.to(device), self.cu_seqlens)


def router_name(layer: int) -> str:
    """The Hugging Face name of a sparse layer's router weight ``[num_experts, hidden]``."""
    return f"model.layers.{layer}.mlp.gate.weight"


def layer_weight_names(cfg: ModelConfig) -> list[str]:
    """Every layer linear's weight, by name, in the decoder's order (each sparse layer's router before its
    experts): what decode streams, and what the pool may prepack."""
    names = []
    for i in range(cfg.num_layers):
        names += [weight_name((i, t)) + ".weight" for t in layer_targets(cfg, i, mlp=False)]
        names += [router_name(i)] if cfg.sparse(i) else []
        names += [weight_name((i, t)) + ".weight" for t in mlp_targets(cfg, i)]
    return names


def shape_weight_names(cfg: ModelConfig) -> list[str]:
    """One layer linear weight of each kind (``lora.shape_keys``; a sparse layer's router too): the shapes a pool's
    tiles are chosen and checked on."""
    names = [weight_name(k) + ".weight" for k in shape_keys(cfg) if k[0] >= 0]
    return names + [router_name(i) for i in range(cfg.num_layers) if cfg.sparse(i)][:1]


def _column_major(w: torch.Tensor) -> torch.Tensor:
    """The same ``[out, in]`` matrix stored column-major, so ``x @ w.T`` reads a contiguous ``[in, out]``: against a
    row-major weight a decode step's few-row matmul takes MKL's slow transposed path (1.2 vs 0.2 ms, 4 x 576 x 1536)."""
    return w.t().contiguous().t()


class Decoder(torch.nn.Module):
    """Frozen base model. ``weights`` holds HF-named tensors; nothing here requires grad."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], *, invariant: bool = True,
                 checkpoint_layers: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.invariant = invariant
        self.checkpoint_layers = checkpoint_layers  # recompute each layer in backward: memory for time
        self.sgmv = False  # LoRA through the Triton SGMV kernels (GPU pools) instead of the per-segment path
        self.ladder = tiling.REFERENCE  # how invariant linears cut rows; the pool's self-check may widen it
        self.grad_ladder = tiling.REFERENCE  # the same for their backward, in a trainer pool
        self.lora_ladders: dict[int, tiling.Ladder] = {}  # by adapter rank: its LoRA products' ladder, once admitted
        self.attn_tiles = (attn.ATTN_ROW_TILE,)  # invariant prefill attention's ladder; likewise
        self.attn_chain = 0  # decode attention's products through Lathe's own kernel (its k-block), once admitted
        self.packed: dict[str, torch.Tensor] = {}  # layer weights prepacked for lone decode rows, once admitted
        self.panels: dict[str, torch.Tensor] = {}  # linears' weights as the kernel's panels, by module, once chosen
        self.w = weights
        embed = weights["model.embed_tokens.weight"]
        self.dtype, self.device = embed.dtype, embed.device
        # computed on the CPU in fp32 on every device, so the table has the same bits everywhere
        self.cos, self.sin = (t.to(self.device) for t in rotary.table(cfg.head_dim, cfg.rope_theta,
                                                                     cfg.max_position_embeddings))
        self.lm_head = _column_major(weights.get("lm_head.weight", weights["model.embed_tokens.weight"]))

    @classmethod
    def from_dir(cls, model_dir: Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 invariant: bool = True, checkpoint_layers: bool = False) -> Decoder:
        """Load a Hugging Face directory (config.json + *.safetensors)."""
        model_dir = Path(model_dir)
        weights: dict[str, torch.Tensor] = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            weights.update(load_file(f))
        if not weights:
            raise FileNotFoundError(f"no *.safetensors in {model_dir}")
        return cls.from_weights(ModelConfig.from_dir(model_dir), weights, dtype=dtype, device=device,
                                invariant=invariant, checkpoint_layers=checkpoint_layers)

    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", invariant: bool = True,
                     checkpoint_layers: bool = False) -> Decoder:
        """A decoder over HF-named tensors (any dtype, any device): each is cast to ``dtype`` on ``device`` and
        every matrix but the embedding is stored column-major, in memory of its own (a view of the file safetensors
        maps would keep all of it resident beside these copies: 525 MB in a SmolLM2 pool); ``weights`` is unchanged."""
        def place(name: str, t: torch.Tensor) -> torch.Tensor:
            out = t.to(device=device, dtype=dtype)
            out = _column_major(out) if out.dim() == 2 and "embed_tokens" not in name else out
            return out.clone() if out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() else out

        placed = {k: place(k, v) for k, v in weights.items()
                  if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
        return cls(cfg, placed, invariant=invariant, checkpoint_layers=checkpoint_layers)

    # ---- building blocks ----

    def _chain_job(self, x: torch.Tensor, name: str, weight: torch.Tensor, key: tuple[int, str],
                   lora: LoraDeltas | None) -> chain.Job | None:
        """x @ weight.T plus ``lora``'s correction of ``key`` as one job of Lathe's kernel (``chain.chain_linears``,
        over the weight's panels where the pool keeps them: ``panels[name]``) where both would run there anyway (a
        decode step's rows: ``ops.chained_block``, ``LoraDeltas.chained``): the bits of the product and the add
        below, without their separate calls. None elsewhere."""
        block = ops.chained_block(x, weight, invariant=self.invariant, ladder=self.ladder)
        segments = lora.chained(key, x, self.lora_ladders) if block and lora is not None else []
        if not block or segments is None:
            return None
        return weight, block, segments, self.panels.get(name)

    def _linears(self, x: torch.Tensor, prefix: str, i: int, targets: tuple[str, ...], lora: LoraDeltas | None
                 ) -> list[torch.Tensor]:
        """``_linear`` of each of layer ``i``'s ``targets`` (under ``prefix``) on the same rows: where every one runs
        through Lathe's kernel (``_chain_job``), all in one call (a decode layer's q, k and v), else one by one."""
        jobs = []
        for t in targets:
            name = prefix + t
            job = None if name + ".bias" in self.w else self._chain_job(x, name, self.w[name + ".weight"], (i, t), lora)
            if job is None:
                return [self._linear(x, prefix + t, (i, t), lora) for t in targets]
            jobs.append(job)
        return chain.chain_linears(x, jobs)

    def _linear(self, x: torch.Tensor, name: str, key: tuple[int, str], lora: LoraDeltas | None) -> torch.Tensor:
        weight, bias = self.w[name + ".weight"], self.w.get(name + ".bias")
        job = self._chain_job(x, name, weight, key, lora) if bias is None else None
        if job is not None:
            return chain.chain_linears(x, [job])[0]
        y = ops.linear(x, weight, bias, invariant=self.invariant, ladder=self.ladder, grad_ladder=self.grad_ladder,
                       packed=self.packed.get(name + ".weight"))
        if lora is not None:
            d = lora.delta(key, x, self.lora_ladders)
            if d is not None:
                y = (y.to(d.dtype) + d).to(y.dtype)  # one rounding of base + fp32 LoRA
        return y

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return ops.rms_norm(x, self.w[name], self.cfg.rms_norm_eps, invariant=self.invariant)

    def _rope(self, batch: Packed, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, D]`` at the batch's positions (``dtype``), gathered once for every layer of a pass."""
        return self.cos[batch.positions].to(dtype), self.sin[batch.positions].to(dtype)

    def _attention(self, i: int, x: torch.Tensor, batch: Packed, rope: tuple[torch.Tensor, torch.Tensor],
                   lora: LoraDeltas | None, kv: KVCache | None) -> torch.Tensor:
        cfg, p = self.cfg, f"model.layers.{i}.self_attn."
        t = x.shape[0]
        q, k, v = self._linears(x, p, i, ("q_proj", "k_proj", "v_proj"), lora)
        q = q.view(t, cfg.num_heads, cfg.head_dim)
        k, v = k.view(t, cfg.num_kv_heads, cfg.head_dim), v.view(t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = self._norm(q, p + "q_norm.weight")
            k = self._norm(k, p + "k_norm.weight")
        q, k = rotary.rotate(q, *rope), rotary.rotate(k, *rope)
        cu = batch.cu_seqlens
        decode = getattr(kv, "decode", None)
        if decode is not None and t == len(cu) - 1:  # a pure decode step: one token per sequence
            ks, vs, positions, table = decode(i, k, v)
            o = attn.decode_attention(q, ks, vs, positions, scale=cfg.head_dim**-0.5, invariant=self.invariant,
                                      chain=self.attn_chain if q.device.type == "cpu" else 0, table=table)
            return self._linear(o.reshape(t, cfg.num_heads * cfg.head_dim), p + "o_proj", (i, "o_proj"), lora)
        if kv is None:
            o = self._attention_by_length(q, k, v, cu, list(range(len(cu) - 1)))
        else:  # each sequence's keys into its cache; those it held none of before, at once by length
            outs, fresh = [q.new_empty(0)] * (len(cu) - 1), []
            for s in range(len(cu) - 1):
                ks, vs, offset = kv.extend(i, s, k[cu[s]:cu[s + 1]], v[cu[s]:cu[s + 1]])
                if offset == 0:
                    fresh.append(s)
                    continue
                outs[s] = attn.attention(q[cu[s]:cu[s + 1]], ks, vs, q_offset=offset, scale=cfg.head_dim**-0.5,
                                         invariant=self.invariant, tiles=self.attn_tiles)
            o = self._attention_by_length(q, k, v, cu, fresh, outs) if fresh else torch.cat(outs, dim=0)
        return self._linear(o.reshape(t, cfg.num_heads * cfg.head_dim), p + "o_proj", (i, "o_proj"), lora)

    def _attention_by_length(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int],
                             seqs: list[int], outs: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Attention of a packed batch's sequences ``seqs`` from their first token, the sequences of each length
        at once (``attn.attention_batch``, the bits of each alone: those of ``attn.attention`` over a cache that
        held none of them before); q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D], the other sequences' rows from
        ``outs`` (by sequence)."""
        by_length: dict[int, list[int]] = {}
        for s in seqs:
            by_length.setdefault(cu[s + 1] - cu[s], []).append(s)
        outs = outs or [q.new_empty(0)] * (len(cu) - 1)
        for length, group in by_length.items():
            if len(group) == len(cu) - 1:  # every sequence has this length: the batch itself, viewed
                qs, ks, vs = (x.view(len(group), length, *x.shape[1:]) for x in (q, k, v))
            else:
                qs, ks, vs = (torch.stack([x[cu[s]:cu[s + 1]] for s in group]) for x in (q, k, v))
            o = attn.attention_batch(qs, ks, vs, scale=self.cfg.head_dim**-0.5, invariant=self.invariant,
                                    tiles=self.attn_tiles)
            if len(group) == len(cu) - 1:
                return o.reshape(q.shape)
            for j, s in enumerate(group):
                outs[s] = o[j]
        return torch.cat(outs, dim=0)

    def _mlp(self, i: int, x: torch.Tensor, lora: LoraDeltas | None, expert: str = "") -> torch.Tensor:
        """Layer ``i``'s SwiGLU MLP, or its expert ``expert``'s over its rows; backward rebuilds h from gate and up."""
        gate, up = self._linears(x, f"model.layers.{i}.mlp.", i, (expert + "gate_proj", expert + "up_proj"), lora)
        p = f"model.layers.{i}.mlp.{expert}"
        h = activations.swiglu(gate, up)
        with activations.recomputed(h, lambda: activations.swiglu(gate, up), enabled=not self.checkpoint_layers):
            return self._linear(h, p + "down_proj", (i, expert + "down_proj"), lora)

    def _moe(self, i: int, x: torch.Tensor, lora: LoraDeltas | None, load: ExpertLoad | None) -> torch.Tensor:
        """A sparse layer's mixture of experts (``lathe.models.moe``): the router's logits on the pool's tiles, each
        expert's MLP over the rows routed to it (its LoRA over the same rows), the outputs summed per token."""
        cfg = self.cfg
        name = router_name(i)
        logits = ops.linear(x, self.w[name], invariant=self.invariant, ladder=self.ladder,
                            grad_ladder=self.grad_ladder, packed=self.packed.get(name))
        routing = moe.route(logits, cfg.experts_per_token, normalize=cfg.norm_topk_prob, dtype=x.dtype)
        if load is not None:
            load.append((i, routing.load(cfg.num_experts)))
        index = torch.tensor([r for _, rows in routing.groups for r in rows], dtype=torch.long, device=x.device)
        outputs, start = [], 0
        for e, rows in routing.groups:
            xs = x[index[start:start + len(rows)]]
            outputs.append(self._mlp(i, xs, lora.take(rows) if lora is not None else None, expert_target(e, "")))
            start += len(rows)
        return moe.combine(outputs, routing)

    # ---- public ----

    def hidden(self, batch: Packed, lora: LoraDeltas | None = None, kv: KVCache | None = None,
               load: ExpertLoad | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of a packed batch. ``load``, where given, receives
        ``(layer, tokens per expert)`` of each sparse layer as the pass routes it (and again should activation
        checkpointing recompute a layer in backward: read it before backward)."""
        batch = batch.to(self.device)
        x = self.w["model.embed_tokens.weight"][batch.tokens]
        recompute = self.checkpoint_layers and kv is None and torch.is_grad_enabled()
        rope = self._rope(batch, x.dtype)
        for i in range(self.cfg.num_layers):
            if recompute:
                x = checkpoint(self._layer, i, x, batch, rope, lora, kv, load, use_reentrant=False)
            else:
                x = self._layer(i, x, batch, rope, lora, kv, load)
        return self._norm(x, "model.norm.weight")

    def _layer(self, i: int, x: torch.Tensor, batch: Packed, rope: tuple[torch.Tensor, torch.Tensor],
               lora: LoraDeltas | None, kv: KVCache | None, load: ExpertLoad | None) -> torch.Tensor:
        """One layer; backward rebuilds each RMSNorm's output, which the linears after it keep, from the norm's input
        (``activations.recomputed``: 288 MB of a SmolLM2 pass of 8 x 256 tokens) unless it is checkpointed."""
        norm = functools.partial(self._norm, x, f"model.layers.{i}.input_layernorm.weight")
        with activations.recomputed(h := norm(), norm, enabled=not self.checkpoint_layers):
            x = x + self._attention(i, h, batch, rope, lora, kv)
        norm = functools.partial(self._norm, x, f"model.layers.{i}.post_attention_layernorm.weight")
        with activations.recomputed(h := norm(), norm, enabled=not self.checkpoint_layers):
            return x + (self._moe(i, h, lora, load) if self.cfg.sparse(i) and h.shape[0] else self._mlp(i, h, lora))

    def logits(self, h: torch.Tensor, lora: LoraDeltas | None = None) -> torch.Tensor:
        """Full-vocabulary logits ``[T, V]`` (fp32) for hidden rows ``h [T, hidden]``."""
        job = self._chain_job(h, UNEMBED, self.lm_head, (-1, UNEMBED), lora)
        if job is not None:
            return chain.chain_linears(h, [job])[0]
        y = ops.linear(h, self.lm_head, invariant=self.invariant, ladder=self.ladder, grad_ladder=self.grad_ladder)
        if lora is not None:
            d = lora.delta((-1, UNEMBED), h, self.lora_ladders)
            if d is not None:
                return y.float() + d  # the bits of y + d; a mixed-dtype add is several times slower
        return y.float()

    def target_logprobs(
        self, h: torch.Tensor, targets: torch.Tensor, lora: LoraDeltas | None = None, *, chunk: int = LOGIT_CHUNK
    ) -> torch.Tensor:
        """``log_softmax(logits(h))[t, targets[t]]`` -> ``[T]`` fp32, computed ``chunk`` rows at a time.

        Under autograd each chunk is recomputed in backward (activation checkpointing), so at most one
        chunk of full-vocabulary logits is alive at once instead of the whole batch's.
        """
        targets = targets.to(h.device)
        out = []
        for r0 in range(0, h.shape[0], chunk):
            r1 = min(r0 + chunk, h.shape[0])
            sub = lora.rows(r0, r1) if lora is not None else None
            fn = _ChunkLogprobs(self, sub)
            if torch.is_grad_enabled():
                out.append(checkpoint(fn, h[r0:r1], targets[r0:r1], use_reentrant=False))
            else:
                out.append(fn(h[r0:r1], targets[r0:r1]))
        return torch.cat(out) if out else h.new_zeros(0, dtype=torch.float32)


    def target_logprobs_backward(
        self, h: torch.Tensor, targets: torch.Tensor, lora: TrainableDeltas | None, grad: torch.Tensor, *,
        chunk: int = LOGIT_CHUNK,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[torch.Tensor, torch.Tensor]]:
        """``target_logprobs`` and its backward in one pass, for a loss whose gradient with respect to the
        logprobs, ``grad [T]``, is known before they are (cross-entropy: ``-weights``).

        Each chunk's logits are computed once and backpropagated at once, instead of being kept for, or
        recomputed in, the backward pass. Returns the logprobs ``[T]`` (no graph), the gradient with respect
        to ``h`` (``[T, hidden]``; the caller backpropagates it through the layers) and the gradients of the
        LoRA head parameters that saw a row, by parameter (not yet accumulated into ``.grad``). The same
        operations as ``target_logprobs`` under autograd, so the same bits.
        """
        targets, grad = targets.to(h.device), grad.to(h.device)
        h = h.detach()
        lps, dhs = [], []
        grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for r0 in range(0, h.shape[0], chunk):
            r1 = min(r0 + chunk, h.shape[0])
            sub = lora.rows(r0, r1) if lora is not None else None
            params = sub.parameters_of((-1, UNEMBED)) if sub is not None else []
            rows = h[r0:r1].requires_grad_()
            with torch.enable_grad():
                lp = _ChunkLogprobs(self, sub)(rows, targets[r0:r1])
            got = torch.autograd.grad(lp, [rows, *params], grad[r0:r1], allow_unused=True)
            lps.append(lp.detach())
            dhs.append(got[0])
            for p, g in zip(params, got[1:], strict=True):
                if g is not None:
                    prev = grads.get(id(p))
                    grads[id(p)] = (p, g if prev is None else prev[1] + g)
        empty = h.new_zeros(0, dtype=torch.float32)
        return (torch.cat(lps) if lps else empty, torch.cat(dhs) if dhs else torch.zeros_like(h),
                dict(grads.values()))


class _ChunkLogprobs:
    """One chunk of ``target_logprobs`` as a plain callable (what activation checkpointing replays)."""

    def __init__(self, model: Decoder, lora: LoraDeltas | None) -> None:
        self.model, self.lora = model, lora

    def __call__(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        lp = ops.log_softmax(self.model.logits(h, self.lora), dim=-1, invariant=self.model.invariant)
        return lp.gather(1, targets[:, None]).squeeze(1)
