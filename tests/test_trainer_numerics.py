"""Trainer numerics against an independent float64 plain-PyTorch Llama written in this file.

Protects: forward logprobs, LoRA gradients after forward_backward (every target incl. the
unembedding, several adapters packed in one pass), the loss value, and AdamW against torch.optim.AdamW.
"""

from __future__ import annotations

import math

import pytest
import torch

from lathe.models.config import ModelConfig
from lathe.models.decoder import Decoder, Packed
from lathe.models.lora import LoraSpec, LoraWeights
from lathe.models.lora_batch import LoraBatch
from lathe.models.tiny import ensure_tiny_model
from lathe.trainer.ops import Example
from lathe.trainer.optimizer import AdamParams, AdamState, adamw_step
from lathe.trainer.step import Job, run_jobs
from tests.helpers import CrossDtype

torch.set_num_threads(1)


def _ref_logprobs(cfg: ModelConfig, w: dict[str, torch.Tensor], lora: LoraWeights | None,
                  tokens: list[int], targets: list[int]) -> torch.Tensor:
    """Textbook Llama in float64: no packing, no chunking, explicit causal softmax."""
    d = {k: v.double() for k, v in w.items()}
    L = len(tokens)

    def lin(x: torch.Tensor, name: str, key: tuple[int, str]) -> torch.Tensor:
        y = x @ d[name + ".weight"].T
        if name + ".bias" in d:
            y = y + d[name + ".bias"]
        if lora is not None and key in lora.a:
            y = y + (x @ lora.a[key].double().T) @ lora.b[key].double().T * lora.spec.scale
        return y

    def norm(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps) * wt

    hd = cfg.head_dim
    pos = torch.arange(L, dtype=torch.float64)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]

    def rope(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    x = d["model.embed_tokens.weight"][torch.tensor(tokens)]
    g = cfg.num_heads // cfg.num_kv_heads
    mask = torch.full((L, L), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        h = norm(x, d[p + "input_layernorm.weight"])
        q = lin(h, p + "self_attn.q_proj", (i, "q_proj")).view(L, cfg.num_heads, hd)
        k = lin(h, p + "self_attn.k_proj", (i, "k_proj")).view(L, cfg.num_kv_heads, hd)
        v = lin(h, p + "self_attn.v_proj", (i, "v_proj")).view(L, cfg.num_kv_heads, hd)
        if cfg.qk_norm:
            q, k = norm(q, d[p + "self_attn.q_norm.weight"]), norm(k, d[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        att = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd) + mask
        o = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(L, -1)
        x = x + lin(o, p + "self_attn.o_proj", (i, "o_proj"))
        h = norm(x, d[p + "post_attention_layernorm.weight"])
        x = x + (_ref_experts(cfg, d, lin, i, h) if cfg.sparse(i) else _ref_mlp(lin, i, h, ""))
    h = norm(x, d["model.norm.weight"])
    head = d.get("lm_head.weight", d["model.embed_tokens.weight"])
    logits = h @ head.T
    if lora is not None and (-1, "lm_head") in lora.a:
        logits = logits + (h @ lora.a[(-1, "lm_head")].double().T) @ lora.b[(-1, "lm_head")].double().T * \
            lora.spec.scale
    return logits.log_softmax(-1)[torch.arange(L), torch.tensor(targets)]


def _ref_mlp(lin, i: int, h: torch.Tensor, expert: str) -> torch.Tensor:  # noqa: ANN001
    p = f"model.layers.{i}.mlp.{expert}"
    up = lin(h, p + "up_proj", (i, expert + "up_proj"))
    gate = lin(h, p + "gate_proj", (i, expert + "gate_proj"))
    return lin(torch.nn.functional.silu(gate) * up, p + "down_proj", (i, expert + "down_proj"))


def _ref_experts(cfg: ModelConfig, d: dict[str, torch.Tensor], lin, i: int, h: torch.Tensor  # noqa: ANN001
                 ) -> torch.Tensor:
    """A Qwen3-MoE layer as its paper reads: every expert on every token, weighted by the renormalized top-k of the
    router's softmax (zero for the others)."""
    probs = (h @ d[f"model.layers.{i}.mlp.gate.weight"].T).softmax(-1)
    top, idx = probs.topk(cfg.experts_per_token, dim=-1)
    if cfg.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    gates = torch.zeros_like(probs).scatter(1, idx, top)
    return sum(gates[:, e:e + 1] * _ref_mlp(lin, i, h, f"experts.{e}.") for e in range(cfg.num_experts))


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error of a whole tensor: ||got - ref|| / ||ref|| (elementwise ratios of tiny entries are noise)."""
    return float((got.double() - ref).norm() / ref.norm())


def _adapter(model: Decoder, rank: int, seed: int, **flags: bool) -> LoraWeights:
    """An adapter with non-zero B (a fresh one has B = 0, which would hide errors in A's gradient)."""
    w = LoraWeights.init(model.cfg, LoraSpec(rank=rank, alpha=16.0, **flags), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for b in w.b.values():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    return w


def _example(vocab: int, n: int, seed: int) -> Example:
    gen = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, vocab, (n + 1,), generator=gen)
    weights = torch.rand(n, generator=gen)
    return Example(toks[:-1].tolist(), toks[1:].clone(), {"weights": weights})


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def model(request: pytest.FixtureRequest, tiny_dir, model_cache) -> Decoder:  # noqa: ANN001
    """The tiny Llama, and the tiny Qwen3-MoE (its LoRA on every expert of its sparse layers)."""
    return Decoder.from_dir(tiny_dir if request.param == "llama" else ensure_tiny_model(model_cache, "qwen3_moe"))


@pytest.mark.parametrize("invariant", [True, False])
def test_forward_logprobs_match_reference(model: Decoder, invariant: bool) -> None:
    model.invariant = invariant
    lora = _adapter(model, 4, 0)
    exs = [_example(model.cfg.vocab_size, n, s) for s, n in enumerate([7, 33, 70])]
    (res,) = run_jobs(model, [Job(lora, exs, "cross_entropy", {}, backward=False)])
    for ex, lp in zip(exs, res.logprobs, strict=True):
        ref = _ref_logprobs(model.cfg, model.w, lora, ex.tokens, ex.targets.tolist())
        torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=1e-5)
    model.invariant = True


def test_packed_gradients_match_reference_per_adapter(model: Decoder) -> None:
    """Three adapters (different ranks and target sets) in one packed pass: each gets its own gradient."""
    adapters = [_adapter(model, 4, 10), _adapter(model, 8, 20, train_attn=False),
                _adapter(model, 2, 30, train_mlp=False, train_unembed=False)]
    batches = [[_example(model.cfg.vocab_size, n, 100 * k + n) for n in sizes]
               for k, sizes in enumerate([[9, 40], [25], [3, 17, 12]])]
    jobs = [Job(a, b, "cross_entropy", {}, backward=True) for a, b in zip(adapters, batches, strict=True)]
    results = run_jobs(model, jobs)
    for a, exs, res in zip(adapters, batches, results, strict=True):
        ref_w = LoraWeights(a.spec, {k: t.detach().double().requires_grad_() for k, t in a.a.items()},
                            {k: t.detach().double().requires_grad_() for k, t in a.b.items()})
        loss = sum(-(ex.inputs["weights"].double() *
                     _ref_logprobs(model.cfg, model.w, ref_w, ex.tokens, ex.targets.tolist())).sum() for ex in exs)
        loss.backward()
        assert res.loss == pytest.approx(float(loss.detach()), rel=1e-5)
        for key in a.a:  # an expert no token of the pass reached has no gradient: zero, as AdamW reads it
            for got, ref in ((a.a[key], ref_w.a[key]), (a.b[key], ref_w.b[key])):
                if got.grad is None:
                    assert not ref.grad.any(), key
                else:
                    assert rel_err(got.grad, ref.grad) <= 1e-5, key

def test_cross_entropy_one_pass_head_has_the_bits_of_the_recomputed_head(model: Decoder) -> None:
    """A cross-entropy pass runs the LM head forward and backward in one pass per chunk (its gradient, -weights,
    is known in advance); its gradients equal, bit for bit, those of the loss backpropagated through
    ``target_logprobs``' recomputed chunks. 473 rows: two logit chunks, the second adapter's rows in both."""
    adapters = [_adapter(model, 4, 10), _adapter(model, 8, 20, train_attn=False)]
    batches = [[_example(model.cfg.vocab_size, n, 7 * n) for n in sizes] for sizes in ([150, 120], [200, 3])]
    twins = [LoraWeights(a.spec, {k: t.detach().clone().requires_grad_() for k, t in a.a.items()},
                         {k: t.detach().clone().requires_grad_() for k, t in a.b.items()}) for a in adapters]
    run_jobs(model, [Job(a, b, "cross_entropy", {}, backward=True) for a, b in zip(adapters, batches, strict=True)])
    examples = [ex for b in batches for ex in b]
    seg = [0, sum(len(ex) for ex in batches[0]), sum(len(ex) for ex in examples)]
    lora = LoraBatch(seg, [0, 1], twins)
    h = model.hidden(Packed.from_sequences([ex.tokens for ex in examples]), lora)
    lp = model.target_logprobs(h, torch.cat([ex.targets for ex in examples]), lora)
    (-(torch.cat([ex.inputs["weights"] for ex in examples]) * lp).sum()).backward()
    for a, t in zip(adapters, twins, strict=True):
        for name, p in a.named_parameters().items():
            assert torch.equal(p.grad, t.named_parameters()[name].grad), name


def test_fresh_adapter_equals_base_model(model: Decoder) -> None:
    lora = LoraWeights.init(model.cfg, LoraSpec(rank=8), seed=3)
    ex = _example(model.cfg.vocab_size, 20, 5)
    (with_lora,) = run_jobs(model, [Job(lora, [ex], "cross_entropy", {}, backward=False)])
    ref = _ref_logprobs(model.cfg, model.w, None, ex.tokens, ex.targets.tolist())
    torch.testing.assert_close(with_lora.logprobs[0].double(), ref, rtol=1e-5, atol=1e-5)


def test_adamw_matches_torch_over_five_steps() -> None:
    gen = torch.Generator().manual_seed(0)
    ours = {"a": torch.randn(5, 7, generator=gen), "b": torch.randn(3, generator=gen)}
    theirs = {k: v.clone().requires_grad_() for k, v in ours.items()}
    state = AdamState.zeros(ours)
    hp = AdamParams(learning_rate=3e-3, beta1=0.85, beta2=0.97, eps=1e-8, weight_decay=0.1)
    opt = torch.optim.AdamW(theirs.values(), lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                            weight_decay=hp.weight_decay)
    for _ in range(5):
        grads = {k: torch.randn(v.shape, generator=gen) for k, v in ours.items()}
        for k in ours:
            ours[k].grad = grads[k].clone()
            theirs[k].grad = grads[k].clone()
        adamw_step(ours, state, hp)
        opt.step()
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k].detach(), rtol=1e-6, atol=1e-7)
    assert state.step == 5


def test_adamw_grad_clip_matches_torch_clip() -> None:
    gen = torch.Generator().manual_seed(1)
    ours = {"a": torch.randn(50, generator=gen)}
    theirs = ours["a"].clone().requires_grad_()
    g = torch.randn(50, generator=gen) * 10
    ours["a"].grad, theirs.grad = g.clone(), g.clone()
    metrics = adamw_step(ours, AdamState.zeros(ours), AdamParams(learning_rate=0.01, grad_clip_norm=1.0))
    torch.nn.utils.clip_grad_norm_([theirs], 1.0)
    torch.optim.AdamW([theirs], lr=0.01, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0).step()
    torch.testing.assert_close(ours["a"], theirs.detach(), rtol=1e-6, atol=1e-7)
    assert metrics["grad_norm:mean"] == pytest.approx(float(g.norm()), rel=1e-6)


def test_activation_checkpointing_gives_the_same_gradients(model: Decoder) -> None:
    exs = [_example(model.cfg.vocab_size, n, 40 + n) for n in (11, 30)]
    grads = []
    for recompute in (False, True):
        model.checkpoint_layers = recompute
        lora = _adapter(model, 4, 77)
        (res,) = run_jobs(model, [Job(lora, exs, "cross_entropy", {}, backward=True)])
        grads.append((res.loss, [p.grad for p in lora.parameters()]))
    model.checkpoint_layers = False
    assert grads[0][0] == grads[1][0]
    assert sum(g is not None for g in grads[0][1]) > len(grads[0][1]) // 2
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(grads[0][1], grads[1][1], strict=True))


def test_a_bf16_packed_pass_adds_nothing_across_dtypes(tiny_dir) -> None:  # noqa: ANN001
    """bf16 base and fp32 LoRA meet only through casts: an op across dtypes (a bf16 + fp32 add of the logits ran
    6x slower than an upcast and an fp32 add, with the same bits) would cost the whole head's time again."""
    bf16 = Decoder.from_dir(tiny_dir, dtype=torch.bfloat16)
    jobs = [Job(_adapter(bf16, 4, 5 + k), [_example(bf16.cfg.vocab_size, 19, 60 + k)], "cross_entropy", {},
                backward=True) for k in range(2)]
    with CrossDtype() as mode:
        results = run_jobs(bf16, jobs)
    assert all(r.error is None for r in results)
    assert all(p.grad is not None for p in jobs[0].weights.parameters())
    assert mode.seen == []
