"""The KV offload benchmark: `python -m pdserve.bench.offload` (__main__.py)."""
