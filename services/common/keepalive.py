"""gRPC keepalive settings every pdserve server and channel uses (grpcio only, no
other import: the public client takes them too).

A channel pings its server every KEEPALIVE_TIME_MS when idle or not, and a server
its clients; a peer that does not answer within KEEPALIVE_TIMEOUT_MS is gone: the
calls on that connection fail (UNAVAILABLE) and a server's handlers see their
context go inactive. So a dead peer or a partition is noticed within about 8 s even
when no RST ever arrives (a killed process's sockets are closed by its kernel at
once, which is noticed sooner). A connection that failed is tried again within
2 s at most, so a restarted peer is reached as soon as it listens."""

from __future__ import annotations

KEEPALIVE_TIME_MS = 5000
KEEPALIVE_TIMEOUT_MS = 3000

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # grpc-core (1.85) waits this long for a keepalive ping's ack (default 60 s), not
    # keepalive_timeout_ms: without it a frozen peer is noticed after ~65 s
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # a peer that restarts (the router on its old ports) is dialled again within 2 s
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
# Let peers ping every few seconds even with no call in flight, and ping them too.
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),
]


def with_keepalive(options: list[tuple[str, object]] | None) -> list[tuple[str, object]]:
    """`options` with the keepalive ones added where not already set."""
    given = list(options or [])
    names = {name for name, _ in given}
    return given + [(name, value) for name, value in CHANNEL_OPTIONS if name not in names]
