"""pagedserve control plane: validation, tokenization, admission, prefix-hash lookup, routing.

Stateless by design (see DESIGN.md); it imports no torch. The gRPC servicers and the
OpenAI-compatible HTTP front end land here with the two-planes work.
"""
