"""Benchmarks of the engine alone, in one process: offline throughput against transformers
(`offline`, with its decode, parallel and sampled workloads) and decode GEMMs (`gemm`)."""
