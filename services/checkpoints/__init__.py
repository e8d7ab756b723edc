"""lathe.checkpoints: the only room that touches checkpoint storage.

In: ``lathe.v1.Checkpoints`` calls (``server.py``) from the trainer (Put a training state or sampler
weights, Get one to load), the sampler (Get adapters) and the gateway (Stat, List, Delete); every
call names the calling tenant. A checkpoint is a set of named files plus metadata, addressed by
``tinker://<run_id>/<kind>/<name>`` (``paths.py``).

Out: checkpoint files, each verified against the sha256 its manifest recorded, and
``CheckpointInfo`` (path, owner, size, created / expires times, metadata), through
``CheckpointsClient`` (``client.py``, sync, torch-free) or the stub.

Owns: the object store (``store.py``: the ``ObjectStore`` Protocol, ``LocalDirStore``, backends by
URL scheme) and everything in it: manifests (the commit point of each save; owner tenant, files
with sizes and sha256, TTL), the immutable file generations they name (their keys and format: ``layout.py``),
TTL expiry and the sweep of expired and orphaned files (``sweep.py``), all through ``CheckpointService``
(``service.py``, the plain-Python core).

Never touches: torch or tensors (files are opaque bytes; the trainer and the sampler encode and
decode them), sessions, runs, API keys or quotas (the gateway's), nor any other room's state. It
trusts the tenant its callers name; authenticating users is the gateway's job.
"""
