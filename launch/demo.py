"""`make demo`: a local cluster (router + a prefill and a decode worker, separate
processes), a few prompts through the gRPC API (one with n=3, one with beam
search), each prefilled on the prefill worker, whose KV pages travel over ZeroMQ
into the decode worker's blocks; completions printed with their TTFT and TPOT; one
chat request through the router's OpenAI-compatible HTTP API with the `openai`
client (the bench extra, which `make` installs), its reply printed; the KV bytes
each worker moved, then a clean shutdown. Last, speculative decoding on the engine:
one input-grounded prompt (a standard-library function, to be written again with a
name changed) without speculation, with n-gram prompt lookup, the embedded draft
model and its EAGLE-3 head, the same tokens each time, with their TPOT and acceptance. And quantization
on the engine: each weight scheme and the FP8 KV cache, with the weight bytes, the KV
blocks the same memory holds, and how many greedy tokens agree with full precision."""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from pdserve.engine.config import DEFAULT_DRAFT_MODEL, DEFAULT_EAGLE3_HEAD
from pdserve.engine.llm import DEFAULT_MODEL, LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.launch.cluster import wait_http
from pdserve.launch.local import ClusterSpec, LaunchConfig, LocalCluster
from pdserve.services.router.client import Client, collect
from pdserve.services.router.config import RouterConfig
from pdserve.services.worker.config import WorkerConfig

REQUESTS = [
    ("import os\n\n\ndef ", {}),
    ("class Stack:\n    def __init__(self):\n        ", {}),
    ("    def __repr__(self):\n        return ", {}),
    ("    def __init__(self, ", {"n": 3, "temperature": 0.8, "top_p": 0.95, "seed": 1}),
    ("for i in range(", {"beam_width": 3, "n": 2}),
]
# The embedded model knows Python source, not dialogue: its chat template
# (models/pdserve-tiny-code/chat_template.jinja) writes the turns as docstrings, and
# the reply is the code that follows them.
CHAT = [{"role": "system", "content": "Python, standard library only."},
        {"role": "user", "content": "A stack of items."}]


def chat_over_http(base_url: str, max_tokens: int) -> None:
    """One chat completion through the OpenAI API, as any `openai` client sends it."""
    try:
        from openai import OpenAI
    except ImportError:
        raise SystemExit("the demo's chat request needs the openai package: pip install 'pdserve[bench]'") from None
    client = OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    started = time.perf_counter()
    reply = client.chat.completions.create(model=model, messages=CHAT, max_tokens=max_tokens, temperature=0.0)
    print("=" * 60)
    print(f"[chat over HTTP, {base_url}] {reply.usage.prompt_tokens} prompt tokens, "
          f"{reply.usage.completion_tokens} tokens in {time.perf_counter() - started:.2f}s, "
          f"{reply.choices[0].finish_reason}")
    for message in CHAT:
        print(f"{message['role']}: {message['content']}")
    print(f"assistant: {reply.choices[0].message.content}")


# A function from idlelib, which the embedded model's training left out (held out).
GROUNDED_SOURCE = '''def store(self, source):
    "Store Shell input statement into history list."
    source = source.strip()
    if len(source) > 2:
        # avoid duplicates
        try:
            self.history.remove(source)
        except ValueError:
            pass
        self.history.append(source)
    self.pointer = None
    self.prefix = None
'''


def speculation(model: str, draft: str) -> None:
    """The same greedy request without speculation, with ngram, the draft model and the
    EAGLE-3 head."""
    prompt = (f"{GROUNDED_SOURCE}\n\n# The same function, with source renamed to new_source:\n"
              "def store(self, new_source):\n")
    params = SamplingParams(max_tokens=96, temperature=0.0)
    methods = {
        "off": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
        "draft_model": {"method": "draft_model", "num_speculative_tokens": 4, "model": draft},
        "eagle3": {"method": "eagle3", "num_speculative_tokens": 4, "model": DEFAULT_EAGLE3_HEAD},
    }
    print("=" * 60)
    print("speculative decoding (engine, one request, greedy): the same function again, renamed")
    baseline = None
    for name, config in methods.items():
        llm = LLM(model=model, num_blocks=256, speculative_config=config)
        llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        out = llm.generate(prompt, params)[0]
        times = out.times
        tokens = out.outputs[0].token_ids
        tpot = (times.finished - times.first_token) / max(1, len(tokens) - 1) if times and times.first_token else 0.0
        spec = llm.stats().spec_decode
        rate = spec.num_accepted_tokens / spec.num_draft_tokens if spec.num_draft_tokens else 0.0
        same = "" if baseline is None else (", same tokens as off" if tokens == baseline else ", TOKENS DIFFER")
        baseline = baseline or tokens
        print(f"  {name:12s} tpot {tpot * 1e3:5.1f} ms, {len(tokens)} tokens, {out.num_draft_tokens} drafted, "
              f"{out.num_accepted_tokens} accepted ({rate:.0%}){same}")
    # The tiny model copies poorly and soon loops (which lookups predict well): its first lines.
    print(prompt.splitlines()[-1] + "\n" + "\n".join(out.outputs[0].text.splitlines()[:4]))


def quantization(model: str) -> None:
    """Each scheme's memory and its greedy tokens against full precision's."""
    prompt = "def read_config(path):\n"
    params = SamplingParams(max_tokens=32, temperature=0.0)
    print("=" * 60)
    print("quantization (engine, one greedy request; KV memory 64 MiB for each)")
    baseline: list[int] = []
    for quant, kv in ((None, "auto"), ("int8", "auto"), ("int4", "auto"), ("fp8", "auto"), ("fp4", "auto"),
                      (None, "fp8")):
        llm = LLM(model=model, kv_cache_memory=64 << 20, max_model_len=512, quantization=quant, kv_cache_dtype=kv)
        tokens = llm.generate(prompt, params)[0].outputs[0].token_ids
        baseline = baseline or tokens
        same = next((i for i, (a, b) in enumerate(zip(tokens, baseline)) if a != b), len(tokens))
        memory = llm.engine.memory
        print(f"  {quant or 'full':5s} kv {memory.kv_cache_dtype:14s} weights {memory.weight_bytes / 2**20:5.1f} MiB, "
              f"{memory.num_blocks:5d} KV blocks, first {same}/{len(tokens)} tokens as full precision's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL)
    args = parser.parse_args()
    spec = ClusterSpec(
        # Threshold 0: even these short prompts prefill remotely (the default, 64
        # tokens, would keep them on the decode worker).
        RouterConfig(model=args.model, port=0, http_port=0, local_prefill_threshold=0, log_level="ERROR"),
        WorkerConfig(model=args.model, num_blocks=1024, log_level="ERROR"),  # KV connector: launcher's default
        LaunchConfig(prefill=1, decode=1),
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pdserve-demo-") as logs, LocalCluster(spec, log_dir=logs) as cluster:
        print(f"cluster up at {cluster.address} in {time.perf_counter() - started:.1f}s: "
              f"{', '.join(w.worker_id for w in cluster.live_workers())}")
        with Client(cluster.address, timeout=120) as client, ThreadPoolExecutor(len(REQUESTS)) as pool:
            def run(item: tuple[str, dict]) -> dict:
                prompt, sampling = item
                return collect(client.generate(prompt, **{"max_tokens": args.max_tokens, "temperature": 0.0, **sampling}))

            results = list(pool.map(run, REQUESTS))
        for (prompt, sampling), sequences in zip(REQUESTS, results):
            label = ", ".join(f"{k}={v}" for k, v in sampling.items()) or "greedy"
            for index, seq in sorted(sequences.items()):
                print("=" * 60)
                print(f"[{label}] sequence {index}: ttft {seq.timing.ttft_seconds * 1e3:.0f} ms, "
                      f"tpot {seq.timing.tpot_seconds * 1e3:.1f} ms, {seq.usage.completion_tokens} tokens, "
                      f"{seq.finish_reason}")
                print(prompt + seq.text)
        wait_http(cluster.openai_url(), timeout=60)
        chat_over_http(cluster.openai_url(), args.max_tokens)
        print("=" * 60)
        for worker in cluster.live_workers():
            with cluster.channel(worker.address) as channel:  # internal: the launch's credentials
                stats = pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=10)
            kv = (f"{stats.kv_transfer_bytes / 1024:.0f} KiB of KV in {stats.kv_transfers} transfers "
                  f"({stats.kv_transfer_failures} failed)")
            if worker.role == pb.ROLE_PREFILL:
                print(f"{worker.worker_id}: prefilled {stats.prefix_cache_queries} prompt tokens, sent {kv}")
            else:
                print(f"{worker.worker_id}: received {kv}")
    print("cluster stopped")
    speculation(args.model, args.draft_model)
    quantization(args.model)


if __name__ == "__main__":
    main()
