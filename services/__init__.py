"""gRPC services wiring the engine (and kvtransfer) into a cluster: router, workers."""
