"""Custom losses created over the Tinker HTTP door (``/create_custom_loss``), kept for their session.

Tinker's SDK uploads a traced loss once and then names it by ``loss_id`` in ``forward_backward`` requests
(``loss_fn="custom"``, ``loss_fn_config={"loss_id": ...}``). This registry checks the graph when it is created
(``lathe.loss_graph.check_graph``: a bad node fails here, named) and keeps it as a ``pb.CustomLoss``; ``resolve``
puts the whole loss into the forward_backward request, so the trainer, the ledger and a replay after a trainer
restart see the graph itself, never an id. Lathe's own SDK sends the graph inline and never uses this.

State: the latest ``MAX_LOSSES`` losses, in memory: a gateway restart forgets them (the SDK then gets NotFound
naming the loss id, and a new session creates them again).
"""

from __future__ import annotations

from collections import OrderedDict

from lathe.errors import NotFound
from lathe.loss_graph import check_graph
from lathe.v1 import lathe_pb2 as pb

MAX_LOSSES = 4096


class CustomLosses:
    """loss_id -> (tenant, loss); ids are ``<session_id>:loss:<custom_loss_seq_id>``, as the SDK counts them."""

    def __init__(self, max_losses: int = MAX_LOSSES) -> None:
        self._losses: OrderedDict[str, tuple[str, pb.CustomLoss]] = OrderedDict()
        self.max_losses = max_losses

    def create(self, tenant: str, session_id: str, seq_id: int, loss: pb.CustomLoss) -> str:
        """Check ``loss`` and keep it for ``tenant``; a repeated ``(session_id, seq_id)`` keeps the first."""
        check_graph(loss.name, [(x.name, x.rank) for x in loss.inputs], loss.graph_json)
        loss_id = f"{session_id}:loss:{seq_id}"
        if loss_id not in self._losses:
            self._losses[loss_id] = (tenant, pb.CustomLoss(loss_id=loss_id, name=loss.name, inputs=loss.inputs,
                                                          graph_json=loss.graph_json))
            while len(self._losses) > self.max_losses:
                self._losses.popitem(last=False)
        return loss_id

    def resolve(self, tenant: str, req: pb.ForwardBackwardRequest) -> None:
        """Fill in the loss a ``custom`` request names by ``custom_loss.loss_id``."""
        found = self._losses.get(req.custom_loss.loss_id)
        if found is None or found[0] != tenant:
            raise NotFound(f"loss_fn_config['loss_id'] = {req.custom_loss.loss_id!r} names no custom loss of this "
                           "account (create it with create_custom_loss in this session)")
        req.custom_loss.CopyFrom(found[1])
