"""Benchmarks: code, seeded and warmed up, each reporting ratios to a baseline run in the
same process (interleaved repetitions, a median with its range) and, where it has one,
the distance to the hardware's limit.

    bench/<subject>/<name>.py   one entry point per benchmark, `python -m pdserve.bench.<subject>.<name>`;
                                entry points import library modules, never each other
    engine/    the engine alone: offline (+ decode, parallel, sampled workloads), gemm
    transfer/  moving KV: kvtransfer, draft_kv, eagle_kv
    serving/   `pdserve bench` (command), http, metrics_cost; backends, workloads, metrics
    cluster/   clusters compared: disagg, prefix
    spec/      speculative decoding: methods, gpu
    quant/     quantization: schemes
    offload/   KV tiers below the device pool: `python -m pdserve.bench.offload` (__main__), tiers, engine_backend
    common/    entry (flags -> config -> exit status), stats, repeat, machine, plot, random_model

Every entry point's flags are a frozen dataclass read through services/common/flags.py;
docs/benchmarks.md has the figures and the commands that produced them.
"""
