"""Metrics end to end: `pdserve up --prometheus` (router + 1 prefill + 1 decode worker,
the decode worker speculating (ngram), and a real Prometheus scraping them every
second), a known set of requests, then Prometheus' HTTP API must show exactly what the
clients saw; every PromQL expression of the Grafana dashboard and of the rules must
evaluate on that live server (the speculative decoding panels too).

Needs Debian's `prometheus` (the Makefile installs it for `make test`).
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import shutil
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import yaml

from pdserve.engine.config import ModelConfig, parse_dtype
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.engine.model_runner import kv_bytes_per_block
from pdserve.engine.tokenizer import Tokenizer
from pdserve.services.common.metrics import LATENCY_BUCKETS
from pdserve.services.router.client import Client
from cluster_helpers import REPO, UpProcess, wait_for

pytestmark = [pytest.mark.cluster(seconds=30), pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="needs `prometheus` on PATH (make test installs Debian's package)")]

BLOCK = 16
LONG = (70, 150)  # prompt lengths over --local-prefill-threshold (64): prefilled on the prefill worker
SHORT = (8, 40)  # under it: prefilled on the decode worker
SLACK = 0.5  # seconds a client may see its first token after the router sent it (loaded CI machine)
WINDOW = "10m"  # stands in for Grafana's $__rate_interval: covers the whole test
# Lossless: the counts below are the same with it; the dashboard's speculation panels need it.
# measure_payoff off: which requests draft must not depend on the worker's timing
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "measure_payoff": False})


@dataclass
class Sent:
    prompt: list[int]
    sampling: dict
    remote: bool
    ttft: float | None = None  # client-measured
    sequences: dict[int, int] = field(default_factory=dict)  # index -> tokens received
    reasons: dict[int, str] = field(default_factory=dict)
    error: grpc.StatusCode | None = None
    drafted: int = 0  # the request's draft tokens and accepted ones (usage, on its last messages)
    accepted: int = 0


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def dashboard_module():
    return _load(REPO / "deploy" / "grafana" / "dashboard.py", "pdserve_dashboard")


class PromAPI:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> dict:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        try:
            return self.get("/api/v1/query", query=expr)["result"]
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{expr}: {e.read().decode()}") from None

    def value(self, expr: str) -> float | None:
        """The one sample of `expr` (summed over series), None when there is none."""
        result = self.query(f"sum({expr})")
        return float(result[0]["value"][1]) if result else None


def _prompts(rng: random.Random, vocab: int, lengths: tuple[int, int], count: int) -> list[list[int]]:
    # Random ids: no two prompts share a block, so no prefix cache skips a page.
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def _code_prompt() -> list[int]:
    """Code, whose tokens recur: the decode worker's n-gram proposer drafts on it (on
    random ids it hardly ever does), so the speculation panels have data."""
    text = "".join(f"    total_{k} = compute(data[{k}], 'step {k}')\n" for k in range(8))
    prompt = Tokenizer(DEFAULT_MODEL).encode(f"def run(data):\n{text}")
    assert len(prompt) > LONG[0], len(prompt)  # crosses from the prefill worker
    return prompt


def _workload(vocab: int) -> list[Sent]:
    rng = random.Random(10)
    long, short = _prompts(rng, vocab, LONG, 6), _prompts(rng, vocab, SHORT, 4)
    sent = [Sent(p, {"max_tokens": 6 + i, "ignore_eos": True}, True) for i, p in enumerate(long[:3])]
    sent += [Sent(long[3], {"max_tokens": 8}, True)]  # may stop early ("stop")
    sent += [Sent(p, {"max_tokens": 5, "n": 3, "temperature": 0.8, "seed": 7 + i}, True) for i, p in enumerate(long[4:])]
    sent += [Sent(p, {"max_tokens": 4 + i, "ignore_eos": True}, False) for i, p in enumerate(short[:2])]
    sent += [Sent(short[2], {"max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 3}, False)]
    sent += [Sent(short[3], {"max_tokens": 4, "beam_width": 2, "ignore_eos": True}, False)]
    sent += [Sent(_code_prompt(), {"max_tokens": 16, "ignore_eos": True}, True)]
    sent += [Sent([vocab + 5] * 10, {"max_tokens": 4}, False)]  # fails validation: INVALID_ARGUMENT
    return sent


def _run(client: Client, sent: Sent) -> None:
    start = time.monotonic()
    try:
        for message in client.generate(sent.prompt, **sent.sampling):
            if message.token_ids and sent.ttft is None:
                sent.ttft = time.monotonic() - start
            sent.sequences[message.index] = sent.sequences.get(message.index, 0) + len(message.token_ids)
            if message.finish_reason:
                sent.reasons[message.index] = message.finish_reason
                sent.drafted, sent.accepted = message.usage.num_draft_tokens, message.usage.num_accepted_tokens
    except grpc.RpcError as e:
        sent.error = e.code()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log = tmp_path_factory.mktemp("observability") / "up.log"
    up = UpProcess(["--prometheus", "--num-blocks", "256", "--max-n", "4", "--speculative-config", NGRAM], log)
    try:
        line = up.lines.get(timeout=60)
        assert line.startswith("prometheus http://127.0.0.1:"), f"pdserve up printed {line!r}; see {log}"
        url = line.split()[1]
        yield up, PromAPI(url)
    finally:
        up.stop()
    with pytest.raises(OSError):  # Prometheus stopped with the cluster
        urllib.request.urlopen(url + "/-/ready", timeout=2)


@pytest.fixture(scope="module")
def served(cluster):
    """The workload, sent one request at a time; Prometheus has scraped its end."""
    up, prom = cluster
    model = ModelConfig.from_dir(DEFAULT_MODEL)
    sent = _workload(model.vocab_size)
    with Client(up.address, timeout=120) as client:
        for s in sent:
            _run(client, s)
    expected = _expected(sent, model)
    wait_for(lambda: all(prom.value(q) == v for q, v in expected.items()), 60, "Prometheus to scrape the final counts",
             step=0.5)
    # a rate needs two samples: one more scrape of every target after the last request
    scraped = prom.value("count_over_time(up[1h])")
    wait_for(lambda: prom.value("count_over_time(up[1h])") >= scraped + 3, 30, "one more scrape", step=0.5)
    return sent, expected


def _expected(sent: list[Sent], model: ModelConfig) -> dict[str, float]:
    """Exact values, from what the clients received and the prompts' KV pages."""
    ok = [s for s in sent if s.error is None]
    produced = [s for s in sent if s.ttft is not None]
    remote = [s for s in ok if s.remote]
    page_bytes = kv_bytes_per_block(model, BLOCK, parse_dtype("float32"))
    kv_bytes = sum(-(-len(s.prompt) // BLOCK) * page_bytes for s in remote)
    expected = {
        "pdserve:time_to_first_token_seconds_count": len(produced),
        "pdserve:prompt_tokens_total": sum(len(s.prompt) for s in produced),
        "pdserve:generation_tokens_total": sum(sum(s.sequences.values()) for s in sent),
        "pdserve:e2e_request_latency_seconds_count": len(ok),
        'pdserve:request_failure_total{code="INVALID_ARGUMENT"}': 1,
        'pdserve:router_prefill_path_total{path="remote"}': len(remote),
        'pdserve:router_prefill_path_total{path="local"}': len(ok) - len(remote),
        'pdserve:kv_transfer_bytes_total{role="prefill"}': kv_bytes,
        'pdserve:kv_transfer_bytes_total{role="decode"}': kv_bytes,
        'pdserve:kv_transfers_total{role="prefill"}': len(remote),
        'pdserve:kv_transfers_total{role="decode"}': len(remote),
        'pdserve:kv_transfer_seconds_count{role="prefill"}': len(remote),
        'pdserve:request_prefill_time_seconds_count{role="prefill"}': len(remote),
        'pdserve:request_prefill_time_seconds_count{role="decode"}': len(ok) - len(remote),
        'pdserve:request_decode_time_seconds_count{role="decode"}': len(ok),
        'pdserve:spec_decode_num_draft_tokens_total{role="decode"}': sum(s.drafted for s in ok),
        'pdserve:spec_decode_num_accepted_tokens_total{role="decode"}': sum(s.accepted for s in ok),
        'pdserve:spec_decode_num_unspeculated_requests_total{role="decode"}': sum("beam_width" in s.sampling for s in ok),
        'pdserve:spec_decode_num_draft_tokens_total{role="prefill"}': 0,
    }
    reasons: dict[str, int] = {}
    for s in ok:
        for reason in s.reasons.values():
            reasons[reason] = reasons.get(reason, 0) + 1
    for reason, count in reasons.items():
        expected[f'pdserve:request_success_total{{finished_reason="{reason}"}}'] = count
    # streamed sequences: one ITL observation per token after the first
    streamed = [n for s in ok if "beam_width" not in s.sampling for n in s.sequences.values()]
    expected["pdserve:inter_token_latency_seconds_count"] = sum(n - 1 for n in streamed if n > 0)
    expected["pdserve:request_time_per_output_token_seconds_count"] = sum(1 for n in streamed if n > 1)
    return expected


def test_counters_are_exact(cluster, served):
    _, prom = cluster
    sent, expected = served
    assert sum(s.error is not None for s in sent) == 1 and sent[-1].error == grpc.StatusCode.INVALID_ARGUMENT
    assert all(s.reasons for s in sent[:-1]), "every valid request finished"
    got = {q: prom.value(q) for q in expected}
    assert got == {q: float(v) for q, v in expected.items()}
    # nothing counted twice under another label
    assert prom.value("pdserve:request_failure_total") == 1
    assert prom.value("pdserve:request_success_total") == sum(len(s.reasons) for s in sent)
    assert prom.value("pdserve:kv_transfer_failures_total") == 0
    assert prom.value("pdserve:num_requests_inflight") == 0
    # speculation: drafts happened (which requests drafted depends on the engine's own
    # timing of whether drafting pays, so only the total is pinned), and the counters'
    # invariants hold
    accepted = prom.value("pdserve:spec_decode_num_accepted_tokens_total")
    drafted = prom.value("pdserve:spec_decode_num_draft_tokens_total")
    assert 0 <= accepted <= drafted and drafted == sum(s.drafted for s in sent) > 0
    per_pos = {int(r["metric"]["position"]): float(r["value"][1])
               for r in prom.query("sum by (position) (pdserve:spec_decode_num_accepted_tokens_per_pos_total)")}
    counts = [per_pos[i] for i in sorted(per_pos)]
    assert len(counts) == 3 and counts == sorted(counts, reverse=True) and sum(counts) == accepted


def test_ttft_matches_the_clients(cluster, served):
    """Each router TTFT is at most the client's (the router sees the request later and
    the token earlier), by at most SLACK: so, bucket by bucket, the router's cumulative
    count lies between the clients' at `le` and at `le + SLACK`."""
    _, prom = cluster
    sent, _ = served
    client = sorted(s.ttft for s in sent if s.ttft is not None)
    router_sum = prom.value("pdserve:time_to_first_token_seconds_sum")
    assert sum(client) - SLACK * len(client) <= router_sum <= sum(client)
    buckets = {float(r["metric"]["le"]): float(r["value"][1])
               for r in prom.query("sum by (le) (pdserve:time_to_first_token_seconds_bucket)")}
    assert sorted(buckets) == sorted([*LATENCY_BUCKETS, math.inf])
    for le, count in buckets.items():
        at_le = sum(t <= le for t in client)
        within_slack = sum(t <= le + SLACK for t in client)
        assert at_le <= count <= within_slack, (le, at_le, count, within_slack)


def test_kv_fragmentation_gauge_per_worker(cluster, served):
    """pdserve:kv_cache_fragmentation: one series per worker, in [0, 1] throughout the
    run, and 0 once the workers are idle (no slot allocated)."""
    _, prom = cluster
    roles = {r["metric"]["worker"]: r["metric"]["role"] for r in prom.query("pdserve:kv_cache_fragmentation")}
    assert sorted(roles.values()) == ["decode", "prefill"]
    peaks = [float(r["value"][1]) for r in prom.query(f"max_over_time(pdserve:kv_cache_fragmentation[{WINDOW}])")]
    assert len(peaks) == 2 and all(0.0 <= v <= 1.0 for v in peaks), peaks
    wait_for(lambda: prom.value("pdserve:kv_cache_fragmentation") == 0.0, 30, "idle workers to report 0")


def _substitute(expr: str, model_name: str) -> str:
    return expr.replace("$model_name", model_name).replace("$__rate_interval", WINDOW)


def _has_data(result: list[dict]) -> bool:
    return any(not math.isnan(float(r["value"][1])) for r in result)


def test_every_dashboard_query_runs_and_shows_data(cluster, served):
    _, prom = cluster
    dashboard = dashboard_module()
    committed = json.loads((REPO / "deploy" / "grafana" / "pdserve.json").read_text())
    exprs = [t["expr"] for p in committed["panels"] for t in p.get("targets", [])]
    assert exprs == [q.expr for p in dashboard.panels() for q in p.queries]
    names = prom.get("/api/v1/label/model_name/values", **{"match[]": "pdserve:time_to_first_token_seconds_count"})
    assert names == ["pdserve-tiny-code"]  # the model_name variable's query
    empty = []
    for panel in dashboard.panels():
        results = [prom.query(_substitute(q.expr, "pdserve-tiny-code")) for q in panel.queries]
        if panel.has_data and not any(_has_data(r) for r in results):
            empty.append(panel.title)
    assert not empty, f"panels without data: {empty}"


def test_every_rule_expression_evaluates(cluster, served):
    _, prom = cluster
    rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "pdserve-rules.yaml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            prom.query(rule["expr"])  # raises on a PromQL error
    # `pdserve up --prometheus` loads the same file: every rule evaluates healthily
    loaded = wait_for(lambda: _evaluated_rules(prom), 30, "every rule to be evaluated")
    assert len(loaded) == sum(len(g["rules"]) for g in rules["groups"])
    assert all(health == "ok" for health in loaded.values()), loaded
    assert _has_data(prom.query("pdserve:time_to_first_token_seconds:p99"))
    assert _has_data(prom.query('pdserve:request_prefill_time_seconds:p50{role="prefill"}'))
    assert not prom.query('ALERTS{alertname=~"PdservePoolEmpty|PdserveNoDecodeWorker|PdserveRequestErrors"}')


def _evaluated_rules(prom: PromAPI) -> dict[str, str] | None:
    rules = {r["name"]: r["health"] for g in prom.get("/api/v1/rules")["groups"] for r in g["rules"]}
    return rules if rules and "unknown" not in rules.values() else None


def test_up_without_prometheus_says_so_and_goes_on(tmp_path):
    """No `prometheus` on PATH: the cluster serves anyway and the launcher says why."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(shutil.which("python3"))
    log = tmp_path / "up.log"
    up = UpProcess(["--prometheus", "--prefill", "0", "--decode", "0", "--mixed", "1", "--num-blocks", "64"], log,
                   env={"PATH": str(bin_dir)})
    try:
        with Client(up.address, timeout=60) as client:
            assert sum(len(m.token_ids) for m in client.generate([5, 6, 7], max_tokens=3, ignore_eos=True)) == 3
    finally:
        assert up.stop() == 0
    assert up.stdout_lines == [f"ready {up.address} internal {up.internal}"]
    assert "no `prometheus` binary on PATH" in log.read_text()
