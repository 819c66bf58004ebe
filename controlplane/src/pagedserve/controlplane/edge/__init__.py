"""The public servers' edges: the gRPC servicer, the HTTP server and what guards their
connections (head timeout, per-client connection cap, TLS mismatch log)."""
