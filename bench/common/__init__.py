"""What every benchmark shares: its entry (flags -> run -> exit status), statistics
(percentiles, a median with its range), interleaved repeats, plots and seeded random models."""
