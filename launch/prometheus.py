"""A Prometheus server of our own that scrapes a cluster (`pdserve up --prometheus`).

    prometheus = Prometheus.start_if_installed(targets)   # None without a `prometheus` binary
    prometheus.url                                         # http://127.0.0.1:PORT
    prometheus.set_targets(targets)                        # workers joined or moved
    prometheus.stop()

It runs the real `prometheus` binary (Debian's package in our Makefile) with its own
temporary data directory, on a free loopback port, scraping every target's /metrics
each second. Targets live in a file_sd file, so a change is picked up without a
restart. The repository's recording and alerting rules are loaded when present.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)
RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "pdserve-rules.yaml"
JOB = "pdserve"
START_TIMEOUT = 30.0
PORT_TRIES = 3


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _config(targets_file: Path, interval: float, rule_files: Sequence[Path]) -> str:
    """prometheus.yml (JSON is YAML): one job over the file_sd targets."""
    seconds = f"{interval:g}s"
    return json.dumps({
        "global": {"scrape_interval": seconds, "scrape_timeout": seconds, "evaluation_interval": seconds},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [{"job_name": JOB, "file_sd_configs": [{"files": [str(targets_file)]}]}],
    }, indent=2)


class Prometheus:
    def __init__(self, binary: str, *, interval: float = 1.0, rule_files: Sequence[Path] = ()) -> None:
        self.binary = binary
        self.interval = interval
        self.rule_files = list(rule_files)
        self._dir = tempfile.TemporaryDirectory(prefix="pdserve-prometheus-")
        self.dir = Path(self._dir.name)
        self.targets_file = self.dir / "targets.json"
        self.proc: subprocess.Popen | None = None
        self.url = ""

    @classmethod
    def start_if_installed(cls, targets: Sequence[str], **kwargs: object) -> "Prometheus | None":
        """Started and ready, scraping `targets` (host:port); None without the binary."""
        binary = shutil.which("prometheus")
        if binary is None:
            return None
        rules = [RULES] if RULES.is_file() else []
        prometheus = cls(binary, rule_files=rules, **kwargs)  # type: ignore[arg-type]
        prometheus.start(targets)
        return prometheus

    def start(self, targets: Sequence[str], timeout: float = START_TIMEOUT) -> str:
        """Start on a free port (retried if another process takes it first); the URL once
        Prometheus is ready and has scraped every target once (it applies new targets
        a few seconds after starting). Raises RuntimeError if it cannot start."""
        self.set_targets(targets)
        config = self.dir / "prometheus.yml"
        config.write_text(_config(self.targets_file, self.interval, self.rule_files))
        why = ""
        for _ in range(PORT_TRIES):
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            log_file = open(self.dir / "prometheus.log", "ab")
            self.proc = subprocess.Popen(
                [self.binary, f"--config.file={config}", f"--storage.tsdb.path={self.dir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}"],
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
            )
            log_file.close()
            why = self._wait_ready(timeout)
            if not why:
                self._wait_scraped(len(set(targets)), timeout)
                log.info("prometheus %s scraping %d targets", self.url, len(targets))
                return self.url
            self.stop(cleanup=False)
        self._dir.cleanup()
        raise RuntimeError(f"prometheus: did not start ({why}); log: {self.log_tail()}")

    def set_targets(self, targets: Sequence[str]) -> None:
        """Scrape exactly `targets` from now on (written atomically: file_sd rereads it)."""
        body = json.dumps([{"targets": sorted(set(targets)), "labels": {"job": JOB}}])
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(body)
        os.replace(tmp, self.targets_file)

    def stop(self, cleanup: bool = True) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5.0)
        if cleanup:
            self._dir.cleanup()

    def log_tail(self, lines: int = 5) -> str:
        path = self.dir / "prometheus.log"
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""

    def _wait_scraped(self, count: int, timeout: float) -> None:
        """Until `count` targets have been scraped once (up or down), at most `timeout` s."""
        give_up = time.monotonic() + timeout
        while time.monotonic() < give_up:
            try:
                with urllib.request.urlopen(self.url + "/api/v1/targets?state=active", timeout=1.0) as reply:
                    active = json.load(reply)["data"]["activeTargets"]
                if sum(t["health"] != "unknown" for t in active) >= count:
                    return
            except (urllib.error.URLError, OSError, KeyError, ValueError):
                pass
            time.sleep(0.2)
        log.warning("prometheus: not every target scraped within %.0fs", timeout)

    def _wait_ready(self, timeout: float) -> str:
        """'' once ready; else why not (it exited, or the timeout passed)."""
        give_up = time.monotonic() + timeout
        while time.monotonic() < give_up:
            if self.proc.poll() is not None:
                return f"exited with {self.proc.returncode}"
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1.0) as reply:
                    if reply.status == 200:
                        return ""
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        return f"not ready within {timeout:.0f}s"
