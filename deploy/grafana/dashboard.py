"""Build the Grafana dashboard deploy/grafana/pdserve.json from code (grafana-foundation-sdk).

    python deploy/grafana/dashboard.py            # rewrites deploy/grafana/pdserve.json
    python deploy/grafana/dashboard.py --check    # exit 1 when the committed JSON differs

Import pdserve.json in Grafana (Dashboards > New > Import) and pick a Prometheus data
source that scrapes the cluster (`pdserve up --prometheus` starts one). Every query
filters on the `model_name` variable; rates use Grafana's `$__rate_interval`. The
metrics are defined in services/common/metrics.py; tests/cluster/test_observability.py runs
every query here against a live Prometheus scraping a live cluster.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, QueryVariable, Row
from grafana_foundation_sdk.builders.common import VizLegendOptions, VizTooltipOptions
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, SortOrder, TooltipDisplayMode
from grafana_foundation_sdk.models.dashboard import DashboardCursorSync, DataSourceRef, VariableRefresh, VariableSort

OUT = Path(__file__).resolve().parent / "pdserve.json"
UID = "pdserve-overview"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'model_name=~"$model_name"'
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    has_data: bool = True  # a healthy cluster that served requests shows data here


def quantiles(metric: str, by: str = "") -> tuple[Query, ...]:
    """p50/p90/p99 of a histogram over rate, optionally per label `by`."""
    group = f"{by}, le" if by else "le"
    legend = f"{{{{{by}}}}} " if by else ""
    return tuple(
        Query(f"histogram_quantile({q}, sum by ({group}) (rate(pdserve:{metric}_bucket{{{SEL}}}[{RATE}])))",
              f"{legend}p{int(q * 100)}")
        for q in (0.5, 0.9, 0.99)
    )


def mean(metric: str, selector: str, legend: str) -> Query:
    """Mean of a histogram's observations over the rate window."""
    sel = f"{SEL},{selector}" if selector else SEL
    return Query(f"sum(rate(pdserve:{metric}_sum{{{sel}}}[{RATE}])) / sum(rate(pdserve:{metric}_count{{{sel}}}[{RATE}]))",
                 legend)


def ratio(numerator: str, denominator: str, plus_one: bool = False) -> Query:
    """rate(numerator) / rate(denominator) per role (1 + that with `plus_one`)."""
    expr = (f"sum by (role) (rate(pdserve:{numerator}{{{SEL}}}[{RATE}])) / "
            f"sum by (role) (rate(pdserve:{denominator}{{{SEL}}}[{RATE}]))")
    return Query(f"1 + {expr}" if plus_one else expr, "{{role}}")


def rate_by(metric: str, by: str, legend: str = "", selector: str = "") -> Query:
    sel = f"{SEL},{selector}" if selector else SEL
    return Query(f"sum by ({by}) (rate(pdserve:{metric}{{{sel}}}[{RATE}]))", legend or f"{{{{{by}}}}}")


ROWS: tuple[tuple[str, tuple[PanelSpec, ...]], ...] = (
    ("Latency (the user's view, at the router)", (
        PanelSpec("Time to first token", "Arrival at the router to the first token leaving it: p50/p90/p99.",
                  "s", quantiles("time_to_first_token_seconds")),
        PanelSpec("Time per output token", "Per sequence: (last token - first token) / (tokens - 1): p50/p90/p99.",
                  "s", quantiles("request_time_per_output_token_seconds")),
        PanelSpec("Inter-token latency", "Gap between consecutive streamed tokens: p50/p90/p99.",
                  "s", quantiles("inter_token_latency_seconds")),
        PanelSpec("End-to-end latency", "Arrival at the router to the request's last message: p50/p90/p99.",
                  "s", quantiles("e2e_request_latency_seconds")),
    )),
    ("Traffic", (
        PanelSpec("Requests", "Sequences returned per second by finish reason, and failed calls by gRPC status.",
                  "reqps", (rate_by("request_success_total", "finished_reason"),
                            rate_by("request_failure_total", "code", "failed {{code}}"))),
        PanelSpec("HTTP API requests", "OpenAI-compatible HTTP API requests answered per second, by route and HTTP "
                  "status (their TTFT, TPOT and tokens count in the panels above, with gRPC's).",
                  "reqps", (rate_by("http_requests_total", "route, status", "{{route}} {{status}}"),), has_data=False),
        PanelSpec("Token throughput", "Prompt tokens processed and tokens generated per second.",
                  "short", (Query(f"sum(rate(pdserve:prompt_tokens_total{{{SEL}}}[{RATE}]))", "prompt tokens/s"),
                            Query(f"sum(rate(pdserve:generation_tokens_total{{{SEL}}}[{RATE}]))", "generated tokens/s"))),
        PanelSpec("Requests in flight and workers", "Generate calls in flight at the router; live workers per pool.",
                  "short", (Query(f"sum(pdserve:num_requests_inflight{{{SEL}}})", "in flight"),
                            Query(f"sum by (pool) (pdserve:num_live_workers{{{SEL}}})", "live {{pool}} workers"))),
        PanelSpec("Routing", "Where prompts were prefilled (remote: a prefill worker; local: the decode worker; "
                  "fallback: no prefill worker could), retries on another worker, streams migrated to another "
                  "decode worker after theirs failed mid-stream, and streams resumed for clients whose router died.",
                  "reqps", (rate_by("router_prefill_path_total", "path"),
                            rate_by("router_retries_total", "kind", "retry {{kind}}"),
                            rate_by("request_migrations_total", "reason", "migrated {{reason}}"),
                            Query(f"sum(rate(pdserve:request_resumptions_total{{{SEL}}}[{RATE}]))",
                                  "resumed for a client")), has_data=True),
    )),
    ("Where the time goes", (
        PanelSpec("Queue time", "Arrival at a worker's engine to first scheduled, per role: p50/p90/p99.",
                  "s", quantiles("request_queue_time_seconds", "role")),
        PanelSpec("Prefill vs transfer vs decode", "Mean seconds per request in each phase: queue and prefill on "
                  "prefill workers, the KV transfer's tail after the prefill (final frame to ack), decode on decode "
                  "workers.",
                  "s", (mean("request_queue_time_seconds", 'role=~"prefill|mixed"', "queue"),
                        mean("request_prefill_time_seconds", 'role=~"prefill|mixed"', "prefill"),
                        mean("kv_transfer_seconds", 'role=~"prefill|mixed"', "KV transfer"),
                        mean("request_decode_time_seconds", 'role=~"decode|mixed"', "decode"))),
        PanelSpec("Engine step time", "Duration of one engine step per role (on decode workers: a decode step): p50/p99.",
                  "s", tuple(q for q in quantiles("engine_step_seconds", "role") if "p90" not in q.legend)),
        PanelSpec("Batch size", "Mean sequences and tokens per engine step, per role.",
                  "short", (Query(f"sum by (role) (rate(pdserve:batch_num_seqs_sum{{{SEL}}}[{RATE}])) / "
                                  f"sum by (role) (rate(pdserve:batch_num_seqs_count{{{SEL}}}[{RATE}]))", "{{role}} seqs"),
                            Query(f"sum by (role) (rate(pdserve:batch_num_tokens_sum{{{SEL}}}[{RATE}])) / "
                                  f"sum by (role) (rate(pdserve:batch_num_tokens_count{{{SEL}}}[{RATE}]))", "{{role}} tokens"))),
    )),
    ("KV cache and transfer", (
        PanelSpec("KV cache usage per pool", "Fraction of KV blocks in use, the fullest worker of each pool.",
                  "percentunit", (Query(f"max by (role) (pdserve:kv_cache_usage_perc{{{SEL}}})", "{{role}}"),)),
        PanelSpec("KV cache usage per worker", "Fraction of each worker's KV blocks in use.",
                  "percentunit", (Query(f"max by (worker) (pdserve:kv_cache_usage_perc{{{SEL}}})", "{{worker}}"),)),
        PanelSpec("KV cache fragmentation per worker",
                  "Allocated KV slots holding no token / allocated slots, per worker (0 with nothing allocated): "
                  "the partly filled last block of each sequence, and blocks reserved for KV still on its way.",
                  "percentunit", (Query(f"max by (worker) (pdserve:kv_cache_fragmentation{{{SEL}}})", "{{worker}}"),)),
        PanelSpec("Prefix cache hit rate", "Prompt tokens found in the prefix cache / tokens looked up, per role.",
                  "percentunit", (ratio("prefix_cache_hits_total", "prefix_cache_queries_total"),)),
        PanelSpec("KV transfer bandwidth", "KV page bytes per second: sent by prefill workers, received by decode workers.",
                  "Bps", (rate_by("kv_transfer_bytes_total", "role", "{{role}}"),)),
        PanelSpec("KV transfer failures", "Failed KV transfers per second per role, and reservations that expired.",
                  "short", (rate_by("kv_transfer_failures_total", "role", "failed ({{role}})"),
                            rate_by("reservations_expired_total", "role", "expired ({{role}})"))),
        PanelSpec("Held and reserved KV", "Prefill: blocks held until shipped; decode: reservations waiting for KV.",
                  "short", (Query(f"sum by (worker) (pdserve:num_held_blocks{{{SEL},role=~\"prefill|mixed\"}})",
                                  "held blocks {{worker}}"),
                            Query(f"sum by (worker) (pdserve:num_requests_reserved{{{SEL},role=~\"decode|mixed\"}})",
                                  "reservations {{worker}}"))),
    )),
    ("KV tiers below the device pool (workers with --kv-offload-host-bytes / --kv-offload-dir)", (
        PanelSpec("KV tier hit rate", "Blocks a prefix lookup missed in the device pool and found in the tier / "
                  "blocks looked up there, per tier.",
                  "percentunit", (Query(f"sum by (tier) (rate(pdserve:kv_offload_tiering_block_hits_total{{{SEL}}}[{RATE}])) / "
                                        f"(sum by (tier) (rate(pdserve:kv_offload_tiering_block_hits_total{{{SEL}}}[{RATE}])) + "
                                        f"sum by (tier) (rate(pdserve:kv_offload_tiering_block_misses_total{{{SEL}}}[{RATE}])))",
                                        "{{tier}}"),), has_data=False),
        PanelSpec("KV tier hits and misses", "Blocks per second found (copied up) and not found in each tier.",
                  "short", (rate_by("kv_offload_tiering_block_hits_total", "tier", "hits {{tier}}"),
                            rate_by("kv_offload_tiering_block_misses_total", "tier", "misses {{tier}}")), has_data=False),
        PanelSpec("KV tier bandwidth", "Bytes per second written into (offload) and read from (onload) each tier.",
                  "Bps", (rate_by("kv_offload_tiering_write_bytes_total", "tier", "write {{tier}}"),
                          rate_by("kv_offload_tiering_read_bytes_total", "tier", "read {{tier}}")), has_data=False),
        PanelSpec("KV tier usage per worker", "Fraction of each tier's blocks in use, per worker.",
                  "percentunit", (Query(f"max by (worker, tier) (pdserve:kv_offload_cache_usage_perc{{{SEL}}})",
                                        "{{worker}} {{tier}}"),), has_data=False),
        PanelSpec("KV offload and onload latency", "A block's copy down (queued to written) and a request's copy up "
                  "(before its first step): p50/p99.",
                  "s", tuple(Query(q.expr, f"{kind} {q.legend}") for kind, metric in
                             (("offload", "kv_offload_seconds"), ("onload", "kv_onload_seconds"))
                             for q in quantiles(metric) if "p90" not in q.legend), has_data=False),
        PanelSpec("KV offload queue", "Copies down waiting per worker, and blocks per second not copied down, by "
                  "reason (queue_full: dropped, never waited for).",
                  "short", (Query(f"max by (worker) (pdserve:kv_offload_queue_depth{{{SEL}}})", "queued {{worker}}"),
                            rate_by("kv_offload_stores_skipped_total", "reason", "skipped {{reason}}")), has_data=False),
        PanelSpec("KV tier faults", "Disk files found corrupt (deleted, recomputed), writes the disk refused, and "
                  "copies up that failed (recomputed), per second.",
                  "short", (rate_by("kv_offload_corrupt_files_total", "worker", "corrupt files {{worker}}"),
                            rate_by("kv_offload_disk_write_errors_total", "worker", "disk write errors {{worker}}"),
                            rate_by("kv_offload_onload_failures_total", "worker", "onload failures {{worker}}")),
                  has_data=False),
    )),
    ("Scheduler", (
        PanelSpec("Running and waiting per pool", "Sequences in the running batch and waiting to be scheduled.",
                  "short", (Query(f"sum by (role) (pdserve:num_requests_running{{{SEL}}})", "running {{role}}"),
                            Query(f"sum by (role) (pdserve:num_requests_waiting{{{SEL}}})", "waiting {{role}}"))),
        PanelSpec("Preemptions", "Sequences preempted per second (blocks freed, recomputed later), per role.",
                  "short", (rate_by("num_preemptions_total", "role"),)),
    )),
    ("Speculative decoding (decode workers with --speculative-config)", (
        PanelSpec("Draft acceptance rate", "Draft tokens accepted / draft tokens verified, per role.",
                  "percentunit", (ratio("spec_decode_num_accepted_tokens_total", "spec_decode_num_draft_tokens_total"),)),
        PanelSpec("Mean acceptance length", "Tokens one verification emits on average: 1 + accepted draft tokens / "
                  "verifications that scored a draft, per role (1: no draft accepted; at most "
                  "num_speculative_tokens + 1).",
                  "short", (ratio("spec_decode_num_accepted_tokens_total", "spec_decode_num_drafts_total", plus_one=True),)),
    )),
)


def panels() -> list[PanelSpec]:
    return [p for _, row in ROWS for p in row]


def build() -> Dashboard:
    dashboard = (
        Dashboard("pdserve")
        .uid(UID)
        .description("TTFT, TPOT and where a request's time goes in a pdserve prefill/decode cluster")
        .tags(["pdserve", "llm"])
        .refresh("10s")
        .time("now-30m", "now")
        .timezone("browser")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            QueryVariable("model_name").label("Model").datasource(DATASOURCE)
            .query("label_values(pdserve:time_to_first_token_seconds_count, model_name)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*")
        )
    )
    ids = iter(range(1, 1000))  # unique panel ids, stable from one build to the next
    for title, row in ROWS:
        dashboard = dashboard.with_row(Row(title).id(next(ids)))
        for spec in row:
            dashboard = dashboard.with_panel(_timeseries(spec, next(ids)))
    return dashboard


def _timeseries(spec: PanelSpec, panel_id: int) -> Timeseries:
    panel = (
        Timeseries().id(panel_id).title(spec.title).description(spec.description).unit(spec.unit)
        .datasource(DATASOURCE).height(8).span(12 if len(spec.queries) > 1 else 8)
        .legend(VizLegendOptions().display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM)
                .show_legend(True))
        .tooltip(VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING))
    )
    for i, query in enumerate(spec.queries):
        panel = panel.with_target(
            Dataquery().expr(query.expr).legend_format(query.legend).ref_id(chr(ord("A") + i)).datasource(DATASOURCE)
        )
    return panel


def render() -> str:
    return json.dumps(build().build(), cls=JSONEncoder, sort_keys=True, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the committed JSON instead of writing")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        same = OUT.is_file() and OUT.read_text() == text
        print(f"{OUT}: {'up to date' if same else 'differs: run python deploy/grafana/dashboard.py'}")
        return 0 if same else 1
    OUT.write_text(text)
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
