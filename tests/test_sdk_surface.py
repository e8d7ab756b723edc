"""Lathe's SDK against the public surface of the installed official ``tinker`` SDK, derived by ``inspect``.

For each of the four clients, every public method of tinker's (and the constructor of ``ServiceClient`` and
``RestClient``, the two a user builds) must exist in Lathe's with every parameter tinker names (private ``_x``
parameters and ``*args``/``**kwargs`` aside), each with tinker's default where tinker has one; Lathe's own extra
parameters must have defaults, so tinker-style calls still work. What Lathe does not offer yet is listed, with
its reason, in ``KNOWN_GAPS`` and nowhere else: a gap that is not listed (a new tinker release) fails, and so
does a listed one that has been closed, so the list is always the exact diff.

Gap keys: ``"Client.method"`` for a missing method, ``"Client.method(param)"`` for a missing parameter or a
different default.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import tinker

import lathe

CLIENTS = ("ServiceClient", "TrainingClient", "SamplingClient", "RestClient")
CONSTRUCTED_BY_USERS = {"ServiceClient", "RestClient"}  # the others are made by a client, from internal state

_NO_TELEMETRY = "Lathe sends no client telemetry"
_NO_PROJECTS = "Lathe has tenants (API keys), not projects"
_NO_TRACES = "Lathe builds no Perfetto traces of a session's requests"
_NO_BILLING = "Lathe keeps no billing or audit records"

KNOWN_GAPS: dict[str, str] = {
    # ServiceClient
    "ServiceClient.__init__(default_headers_overrides)": "Lathe's SDK speaks gRPC; it sends no HTTP headers",
    "ServiceClient.get_telemetry": _NO_TELEMETRY,
    # TrainingClient
    "TrainingClient.get_telemetry": _NO_TELEMETRY,
    # SamplingClient
    "SamplingClient.create": "tinker's internal constructor (takes its client holder); use create_sampling_client",
    "SamplingClient.get_telemetry": _NO_TELEMETRY,
    # RestClient
    "RestClient.assign_session_project": _NO_PROJECTS,
    "RestClient.assign_session_project_async": _NO_PROJECTS,
    "RestClient.export_session_trace": _NO_TRACES,
    "RestClient.export_session_trace_async": _NO_TRACES,
    "RestClient.get_audit_log": _NO_BILLING,
    "RestClient.get_audit_log_async": _NO_BILLING,
    "RestClient.get_billing_usage": _NO_BILLING,
    "RestClient.get_billing_usage_async": _NO_BILLING,
    "RestClient.get_telemetry": _NO_TELEMETRY,
}


def public_methods(cls: type, client: str) -> dict[str, inspect.Signature]:
    names = [n for n, v in inspect.getmembers(cls) if callable(v) and not n.startswith("_")]
    if client in CONSTRUCTED_BY_USERS:
        names.append("__init__")
    return {n: inspect.signature(getattr(cls, n)) for n in names}


def public_params(sig: inspect.Signature) -> dict[str, inspect.Parameter]:
    return {n: p for n, p in sig.parameters.items()
            if n not in ("self", "cls") and not n.startswith("_")
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}


def surface_diff() -> Iterator[tuple[str, str]]:
    """(gap key, what differs) for every way Lathe's four clients fall short of tinker's."""
    for client in CLIENTS:
        theirs = public_methods(getattr(tinker, client), client)
        ours = public_methods(getattr(lathe, client), client)
        for method, their_sig in sorted(theirs.items()):
            where = f"{client}.{method}"
            if method not in ours:
                yield where, "missing"
                continue
            their_params, our_params = public_params(their_sig), public_params(ours[method])
            for name, p in their_params.items():
                q = our_params.get(name)
                if q is None:
                    yield f"{where}({name})", "parameter missing"
                elif p.default is not inspect.Parameter.empty and p.default != q.default:
                    yield f"{where}({name})", f"default {q.default!r}, tinker's {p.default!r}"
            for name, q in our_params.items():
                if name not in their_params and q.default is inspect.Parameter.empty:
                    yield f"{where}({name})", "Lathe's extra parameter has no default"


def test_lathe_clients_have_tinkers_surface_or_a_listed_reason() -> None:
    diff = dict(surface_diff())
    unlisted = {k: v for k, v in diff.items() if k not in KNOWN_GAPS}
    closed = sorted(set(KNOWN_GAPS) - set(diff))
    assert not unlisted, f"tinker {tinker.__version__} has surface Lathe lacks (implement, or list with a reason " \
                         f"in KNOWN_GAPS): {unlisted}"
    assert not closed, f"listed in KNOWN_GAPS but no longer a gap (remove them): {closed}"


def test_the_comparison_sees_the_surface() -> None:
    """Guard against a vacuous pass: tinker's clients are found, with methods and parameters to compare."""
    assert tinker.__version__ == "0.38.0"
    sampling = public_methods(tinker.SamplingClient, "SamplingClient")
    assert "sample" in sampling and "num_samples" in public_params(sampling["sample"])
    assert sum(len(public_methods(getattr(tinker, c), c)) for c in CLIENTS) > 90
    assert all(reason for reason in KNOWN_GAPS.values())
