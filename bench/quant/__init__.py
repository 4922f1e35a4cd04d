"""Quantization: what each weight scheme and KV dtype buys in memory, speed and KV
bytes shipped (`schemes`), with its settings and its two KV transfer parts."""
