"""lathe.gateway: the only public endpoint. Two front doors over one core, no torch.

In: Lathe's SDK over gRPC (``server.py``, ``lathe.v1.Gateway``) and the official ``tinker`` SDK over HTTP
under ``/api/v1`` (``tinker_http.py`` and its route groups ``tinker_*.py``, served by uvicorn in the same event
loop: ``http_server.py``), both authenticated by ``auth.ApiKeys`` (API key -> tenant). Each door only translates:
its requests become calls on the parts ``core.GatewayCore`` builds, and core errors (``lathe.errors``) become its
status codes.

State, each with one owner (``ledger.py``: requests and results; ``sessions.py``: sessions and sampling
sessions; ``runs.py``: training runs), written through to the control-plane database of ``store.py`` (SQLite
or PostgreSQL); the waiters of futures live in memory (``futures.py``). Out: model operations to the
trainer, samples to the sampler, checkpoint queries to the checkpoints service, all over gRPC. It never touches
model weights or object storage; its only file is that database when it is SQLite. Internal calls carry
deadlines and are retried while a service restarts (``calls.py``); per-tenant quotas are ``quotas.py``.
Tinker's wire shapes live in ``tinker_proto.py`` (protobuf), ``tinker_json.py`` and ``json_fields.py`` (JSON).
"""
