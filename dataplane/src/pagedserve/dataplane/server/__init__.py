"""The data plane's gRPC server: the engine's step loop in its own thread, and the internal
`DataPlaneService` (one bidi stream per control-plane replica, GetState, Drain)."""
