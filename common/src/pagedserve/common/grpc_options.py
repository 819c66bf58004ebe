"""gRPC channel and server options of the link between the planes, set once for both ends."""

from __future__ import annotations

# Keepalive pings let both sides notice a dead peer within seconds, not minutes.
_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
# A submit carries a whole prompt's token ids; a state snapshot carries every cached block hash.
_MESSAGE_LIMITS = [
    ("grpc.max_receive_message_length", 64 * 2**20),
    ("grpc.max_send_message_length", 64 * 2**20),
]

# The control plane's channel to a data plane: reconnects fast after a data-plane restart.
LINK_CHANNEL_OPTIONS = [
    *_KEEPALIVE,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    *_MESSAGE_LIMITS,
]
# The data plane's server: accepts the control plane's keepalive pings at that rate.
LINK_SERVER_OPTIONS = [
    *_KEEPALIVE,
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    *_MESSAGE_LIMITS,
]
