"""Benchmarks of moving KV: our transports against raw ZeroMQ (`kvtransfer`), and where a
draft model's or an EAGLE head's prompt state should come from (`draft_kv`, `eagle_kv`)."""
