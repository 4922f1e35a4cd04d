"""Structured outputs benchmark (issue 37): `python -m pdserve.bench.structured`."""
