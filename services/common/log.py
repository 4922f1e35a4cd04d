"""Process-wide logging set-up for services: one line per record, on stderr."""

from __future__ import annotations

import logging
import sys

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def configure(level: str, tag: str) -> None:
    """Log to stderr as `time LEVEL [tag] logger: message` (stdout stays for results)."""
    if level.upper() not in LEVELS:
        raise ValueError(f"log_level: must be one of {LEVELS}, got {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [{tag}] %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
