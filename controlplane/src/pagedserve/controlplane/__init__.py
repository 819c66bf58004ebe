"""pagedserve control plane: validation, tokenization, admission, prefix-hash lookup, routing.

Stateless by design: everything it knows of the data planes comes from their snapshots and
KV events, so a restarted control plane rebuilds its view and serves at once
(docs/planes.md, "Failure semantics"). It imports no torch. The gRPC servicer and the
OpenAI-compatible HTTP front end live here.
"""
