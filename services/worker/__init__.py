"""What every worker role shares: the request table and the engine thread that runs
it, the gRPC servicer, registration. Role-specific RPCs live in services/prefill/
and services/decode/ (above this package); services/node.py puts them together."""
