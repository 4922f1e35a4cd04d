"""Prefill role: run a prompt, report its first token at once, ship its KV (P/D seam)."""
