"""Benchmarks that compare clusters they start themselves: disaggregation against
colocation (`disagg`) and the prefix cache and prefix-aware routing (`prefix`)."""
