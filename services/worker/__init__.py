"""The worker core shared by every role: the engine thread, the gRPC servicer, the
process main. Role-specific RPCs live in services/prefill/ and services/decode/."""
