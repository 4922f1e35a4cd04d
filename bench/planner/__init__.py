"""The planner's evidence: its simulator against the real cluster (`python -m pdserve.bench.planner`)."""
