"""Structured outputs: constraints on a request's output (params.py, torch-free) and,
on workers, their compilation and per-step token masks (the rest of this package)."""
