#!/usr/bin/env bash
# The GPU mode of every benchmark, one after the other, each under 5 minutes on one
# GPU (an H200 takes about 1-3 minutes each). Usage, from the repository root:
#
#     bash bench/gpu_benchmarks.sh [OUT_DIR]        # logs, JSON reports and plots
#     PY=.venv/bin/python bash bench/gpu_benchmarks.sh
#     ONLY="disagg prefix" bash bench/gpu_benchmarks.sh
#
# Needs a CUDA build of torch in $PY's environment. What each mode runs, and why
# its figures differ from the CPU ones, is in bench/gpu_benchmarks.md.
set -u
PY=${PY:-python}
OUT=${1:-gpu-bench}
ONLY=${ONLY:-"offline kvtransfer serving disagg prefix spec quant"}
LIMIT=${LIMIT:-300}
mkdir -p "$OUT/pkg"
OUT=$(cd "$OUT" && pwd)
# `import pdserve` without an install: the repository root is the package (pyproject maps it)
ln -sfn "$(cd "$(dirname "$0")/.." && pwd)" "$OUT/pkg/pdserve"
export PYTHONPATH="$OUT/pkg${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

run() {
    local name=$1
    shift
    echo "== $name: $PY $*"
    local start=$SECONDS
    timeout "$LIMIT" "$PY" "$@" >"$OUT/$name.log" 2>&1
    echo "   rc=$? in $((SECONDS - start)) s: $(tail -n 1 "$OUT/$name.log")"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || exit 2
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'), load: $(cut -d' ' -f1-3 /proc/loadavg)"
for name in $ONLY; do
    case $name in
    offline) run offline -m pdserve.bench.engine.offline --gpu ;;
    kvtransfer) run kvtransfer -m pdserve.bench.transfer.kvtransfer --gpu ;;
    serving)
        # ~1B-parameter random Llama (the disagg preset's shape), bf16, 1 prefill + 1 decode worker on the GPU
        "$PY" -c "from pathlib import Path; from pdserve.bench.cluster.clusters import GPU_MODEL, save_model; save_model(GPU_MODEL, Path('$OUT/model'), 0)"
        run serving -m pdserve.bench.serving.command --model "$OUT/model" --device cuda --dtype bfloat16 --num-blocks 8192 \
            --workload random --num-requests 400 --prompt-tokens 256 2048 --output-tokens 64 256 \
            --request-rate 16 --slo ttft:1000,tpot:50 --json "$OUT/serving.json" --plot "$OUT/serving.png"
        ;;
    disagg) run disagg -m pdserve.bench.cluster.disagg --gpu --json "$OUT/disagg.json" --plot "$OUT/disagg.png" ;;
    prefix) run prefix -m pdserve.bench.cluster.prefix --gpu --json "$OUT/prefix.json" --plot "$OUT/prefix.png" ;;
    spec) run spec -m pdserve.bench.spec.gpu --json "$OUT/spec.json" --plot "$OUT/spec.png" ;;
    quant) run quant -m pdserve.bench.quant.schemes --device cuda ;;
    *) echo "unknown benchmark $name" ;;
    esac
done
