"""lathe.gateway: the only public endpoint. Two front doors over one core, no torch.

In: Lathe's SDK over gRPC (``server.py``, ``lathe.v1.Gateway``) and the official ``tinker`` SDK over HTTP
under ``/api/v1`` (``tinker_http.py``, served by uvicorn in the same event loop: ``http_server.py``), both
authenticated by ``auth.ApiKeys`` (API key -> tenant). Each door only translates: its requests become calls
on ``core.GatewayCore`` and core errors (``lathe.errors``) become its status codes.

State (``core.py``, in memory): sessions, training runs, sampling sessions, futures (``futures.py``) and the
idempotency map ``(model_id, seq_id) -> request id``. Out: model operations to the trainer, samples to the
sampler, checkpoint queries to the checkpoints service, all over gRPC. It never touches model weights,
object storage or the filesystem. Tinker's wire shapes live in ``tinker_proto.py`` (protobuf), ``tinker_json.py``
and ``json_fields.py`` (JSON).
"""
