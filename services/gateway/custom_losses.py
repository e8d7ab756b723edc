"""Custom losses created over the Tinker HTTP door (``/create_custom_loss``), kept per tenant in the database.

Tinker's SDK uploads a traced loss once and then names it by ``loss_id`` in ``forward_backward`` requests
(``loss_fn="custom"``, ``loss_fn_config={"loss_id": ...}``). This registry checks the graph when it is created
(``lathe.loss_graph.check_graph``: a bad node fails here, named) and keeps it as a ``pb.CustomLoss`` in the
control plane's database (``ControlStore.put_loss``); ``resolve`` puts the whole loss into the forward_backward
request, so the trainer, the ledger and a replay after a trainer restart see the graph itself, never an id.
Lathe's own SDK sends the graph inline and never uses this.

State: none of its own. The database holds each tenant's newest ``TenantQuotas.max_custom_losses`` losses (older
ones of the same tenant go first, never another tenant's), so they survive a gateway restart and every replica
over the same database resolves them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from lathe.errors import NotFound
from lathe.loss_graph import check_graph
from lathe.v1 import lathe_pb2 as pb

from .store import ControlStore


class CustomLosses:
    """loss_id -> (tenant, loss); ids are ``<session_id>:loss:<custom_loss_seq_id>``, as the SDK counts them."""

    def __init__(self, store: ControlStore, keep: Callable[[str], int]) -> None:
        """``keep(tenant)``: how many of its newest losses a tenant keeps."""
        self.store = store
        self.keep = keep

    def create(self, tenant: str, session_id: str, seq_id: int, loss: pb.CustomLoss) -> str:
        """Check ``loss`` and keep it for ``tenant``; a repeated ``(session_id, seq_id)`` keeps the first."""
        check_graph(loss.name, [(x.name, x.rank) for x in loss.inputs], loss.graph_json)
        loss_id = f"{session_id}:loss:{seq_id}"
        kept = pb.CustomLoss(loss_id=loss_id, name=loss.name, inputs=loss.inputs, graph_json=loss.graph_json)
        self.store.put_loss(tenant, kept, time.time(), self.keep(tenant))
        return loss_id

    def resolve(self, tenant: str, req: pb.ForwardBackwardRequest) -> None:
        """Fill in the loss a ``custom`` request names by ``custom_loss.loss_id``."""
        found = self.store.get_loss(req.custom_loss.loss_id)
        if found is None or found[0] != tenant:
            raise NotFound(f"loss_fn_config['loss_id'] = {req.custom_loss.loss_id!r} names no custom loss of this "
                           "account (create it with create_custom_loss in this session; an account keeps its "
                           "newest losses up to its max_custom_losses quota)")
        req.custom_loss.CopyFrom(found[1])
