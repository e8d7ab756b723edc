"""lathe.sampler: a pool's sampling service (many LoRA adapters on one frozen base model), on one of two engines
behind ``engines.Engine`` (``--engine``): native, Lathe's own (all below but the sglang lines), or sglang, an SGLang
server driven over HTTP.

In:  ``lathe.v1.Sampler.Sample(SampleRequest)`` from the gateway: prompt tokens, Tinker's sampling
     params (temperature, top_k, top_p, seed, max_tokens, stop strings / token ids / EOS),
     num_samples, the logprob options (prompt_logprobs / topk_prompt_logprobs, prompt_logprobs_last_n,
     topk_sample_logprobs, target_prompt_logprobs, prompt_alt_tokens_k), and the policy: base model,
     tenant, sampler-weights path and the version (creation time) the sampling client was bound to.
Out: ``SampleResult``: per sequence the tokens, the logprob of each (temperature 1, bitwise equal to
     the trainer's forward logprob for the same tokens when both run the batch-invariant ops), its top-k
     logprobs if asked, the stop reason ("stop" | "length") and the policy version; the prompt options'
     results (every logprob from the same rows, so with the same bits); a receipt; or an ``Error``.

Where a request's data lives, and who owns it:
  server.SamplerServicer   gRPC only: request in, awaited future out
  engines.Engine           what the door calls on an engine; ``make_engine`` builds the configured one
  sglang.SGLangEngine      sglang: the event loop and HTTP client to the pool's SGLang server, requests in flight;
                           ``sglang_wire`` maps a Plan onto /generate and back, ``sglang_adapters.ServerAdapters``
                           the adapters published (PEFT directories) and loaded in the server, LRU
  sglang_api               the native engine behind SGLang's HTTP API (its own process; tests and local runs)
  engine.SamplerEngine     native: admission queue, waiting line (``fair.FairQueue``: one FIFO per tenant, served
                           in turn), running sequences and their token reservations, the scheduler thread;
                           base models (one ``lathe.models.decoder.Decoder`` each, CPU, pool dtype);
                           ``config.SamplerConfig`` its options
  requests.Request / Seq   one request from ``sample`` to its answer (base model, plan, adapter, reservation,
                           samples), and each sample's RNG, KV cache and tokens while it decodes
  intake                   the only place protobuf is read or built: SampleRequest -> ``Ask`` (who, which
                           policy) at ``sample``; results -> SampleResult (``answer``, ``failure``)
  validate.check_sample    SampleRequest -> Plan (checked prompt, params, stop rule, seed), on the loader
                           thread once the base model's limits are known
  adapters.AdapterCache    (tenant, path, version) -> LoraWeights, LRU; bytes from an AdapterSource
  kv.KVPool / SeqCache     per base model, K/V blocks of 64 tokens per layer (model dtype) handed out by
  blocks.BlockManager      reference counts, LRU-cached full blocks reused by prompt prefix (chain digest);
                           per sequence, a block table; kv.StepKV: the decoder's KVCache view of one step
  slots.SlotPool           adapters in stacked rank-padded slots, read by BGMV (throughput mode's decode steps)
  graphs.DecodeRunner      pure decode steps padded to bucket sizes, replayed from CUDA graphs on CUDA
  step.run_step            one packed forward (prefills + decode tokens, adapter segments) -> rows
  sampling.choose          one logits row -> next token (greedy / temperature / top-k / top-p, per-
                           sequence seeded generator);  stops.StopRule: when a sequence ends

Never touches: the trainer or its adapter bank, object storage (checkpoint bytes come through the
checkpoints service), sessions, auth or futures (the gateway's).
"""
