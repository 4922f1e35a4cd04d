"""What the serving benchmark sends, and when: seeded workloads and arrival processes.

Workloads (`WorkloadConfig.kind`), every one seeded (same seed, same requests):

  random    random token ids, prompt and output lengths uniform in their ranges
  prefix    K shared prefixes of L random tokens, each request one of them (chosen
            uniformly) followed by a unique random suffix
  text      slices of the Python standard library's source (the embedded model's
            domain), sent as text: the router tokenizes them
  sharegpt  (input, output) lengths sampled from a JSONL file: one record a line,
            either {"input_length": N, "output_length": M} or a ShareGPT conversation
            {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}
            whose first turn and reply are measured with --tokenizer; the prompt sent
            is that many random token ids
  trace     replay of a Mooncake-format trace, JSONL records {"timestamp" (ms),
            "input_length", "output_length", "hash_ids"}: equal hash ids are equal
            blocks of `trace_block_tokens` (512 in the public traces) token ids, so
            prefix sharing is replayed as recorded; the request is sent at its
            timestamp (divided by `trace_speedup`)
  multiturn conversations of `turns` turns, each resending the whole history (the
            earlier user messages and the server's own answers) after a think time;
            `num_requests` counts conversations, `prompt_tokens` is each user
            message's length (bench/serving/multiturn.py: its prompts depend on the
            answers, so it is run by run_conversations, not drawn here)

Every request is greedy with `ignore_eos` and `max_tokens` = its output length, so
it produces exactly that many tokens. Token-id prompts know their exact length.

Arrivals (`ArrivalConfig`): gaps drawn from a gamma distribution of mean
1/request_rate and shape `burstiness` (1: Poisson; < 1 burstier; > 1 more regular),
or all at time 0 for an infinite rate; `concurrency` caps the requests in flight
(an infinite rate with a cap is a fixed-concurrency closed loop). A trace brings
its own times.
"""

from __future__ import annotations

import json
import math
import random
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

FIRST_REGULAR_TOKEN = 3  # random prompts avoid the low ids, where small vocabularies keep bos/eos/pad
KINDS = ("random", "prefix", "text", "sharegpt", "trace", "multiturn")
MOONCAKE_BLOCK = 512


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_range(name: str, value: tuple[int, int], low: int = 1) -> None:
    lo, hi = value
    _require(low <= lo <= hi, f"--{name.replace('_', '-')}: needs {low} <= MIN <= MAX, got {lo} {hi}")


@dataclass(frozen=True)
class WorkloadConfig:
    kind: str = "random"
    num_requests: int = 64
    output_tokens: tuple[int, int] = (128, 128)  # inclusive, uniform (random, prefix, text)
    prompt_tokens: tuple[int, int] = (16, 512)  # random: prompt length; prefix: suffix length
    prompt_chars: tuple[int, int] = (64, 1536)  # text: characters per prompt
    prefix_count: int = 4
    prefix_tokens: int = 256
    path: str | None = None  # sharegpt, trace
    tokenizer: str | None = None  # sharegpt conversations: a directory with tokenizer.json
    trace_block_tokens: int = MOONCAKE_BLOCK
    trace_speedup: float = 1.0
    turns: tuple[int, int] = (5, 10)  # multiturn: turns per conversation, uniform
    think_time: float = 1.0  # multiturn: mean seconds between an answer and the next turn (exponential)
    seed: int = 0

    def __post_init__(self) -> None:
        _require(self.kind in KINDS, f"--workload: one of {KINDS}, got {self.kind!r}")
        _require(self.num_requests >= 1, f"--num-requests: must be >= 1, got {self.num_requests}")
        _check_range("output_tokens", self.output_tokens)
        _check_range("prompt_tokens", self.prompt_tokens, low=0 if self.kind == "prefix" else 1)
        _check_range("prompt_chars", self.prompt_chars)
        _require(self.prefix_count >= 1, f"--prefix-count: must be >= 1, got {self.prefix_count}")
        _require(self.prefix_tokens >= 1, f"--prefix-tokens: must be >= 1, got {self.prefix_tokens}")
        _require(self.trace_block_tokens >= 1, f"--trace-block-tokens: must be >= 1, got {self.trace_block_tokens}")
        _require(self.trace_speedup > 0, f"--trace-speedup: must be > 0, got {self.trace_speedup}")
        _check_range("turns", self.turns)
        _require(self.think_time >= 0, f"--think-time: must be >= 0, got {self.think_time}")
        _require(self.kind not in ("sharegpt", "trace") or bool(self.path), f"--dataset: a JSONL file for {self.kind}")


@dataclass(frozen=True)
class ArrivalConfig:
    request_rate: float = math.inf  # requests per second; inf: all at time 0
    burstiness: float = 1.0  # gamma shape of the gaps: 1 is Poisson
    concurrency: int = 0  # most requests in flight; 0: no limit

    def __post_init__(self) -> None:
        _require(self.request_rate > 0, f"--request-rate: must be > 0, got {self.request_rate}")
        _require(self.burstiness > 0, f"--burstiness: must be > 0, got {self.burstiness}")
        _require(self.concurrency >= 0, f"--concurrency: must be >= 0, got {self.concurrency}")


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt: str | tuple[int, ...]
    max_tokens: int
    send_at: float  # seconds after the benchmark's start
    # multiturn: the prompt's segments, user and assistant messages alternating (a
    # user message last), for chat APIs; () for a single message
    turns: tuple[tuple[int, ...], ...] = ()

    @property
    def prompt_len(self) -> int | None:
        """Exact prompt tokens for a token-id prompt; None for text (the router tokenizes)."""
        return None if isinstance(self.prompt, str) else len(self.prompt)


# -- arrivals -------------------------------------------------------------------------


def send_times(num: int, arrivals: ArrivalConfig, rng: random.Random) -> list[float]:
    """Gamma-distributed gaps of mean 1/rate (exponential, i.e. Poisson, for shape 1)."""
    if math.isinf(arrivals.request_rate):
        return [0.0] * num
    shape = arrivals.burstiness
    scale = 1.0 / (arrivals.request_rate * shape)
    times, now = [], 0.0
    for _ in range(num):
        times.append(now)
        now += rng.gammavariate(shape, scale)
    return times


# -- prompts --------------------------------------------------------------------------


def random_ids(n: int, vocab_size: int, rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_REGULAR_TOKEN, vocab_size) for _ in range(n))


def stdlib_corpus(min_chars: int, rng: random.Random) -> str:
    """At least `min_chars` characters of standard-library source, from files in a
    seeded order (the same text for the same seed and Python version)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rng.shuffle(files)
    parts: list[str] = []
    size = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= min_chars:
            break
    corpus = "\n".join(parts)
    _require(len(corpus) >= min_chars, f"standard library source: only {len(corpus)} characters")
    return corpus


@dataclass(frozen=True)
class Shape:
    """A request before its arrival time is known."""

    prompt: str | tuple[int, ...]
    max_tokens: int
    send_at: float | None = None  # a trace's own time


def _random_shapes(cfg: WorkloadConfig, vocab: int, rng: random.Random) -> Iterator[Shape]:
    for _ in range(cfg.num_requests):
        prompt = random_ids(rng.randint(*cfg.prompt_tokens), vocab, rng)
        yield Shape(prompt, rng.randint(*cfg.output_tokens))


def _prefix_shapes(cfg: WorkloadConfig, vocab: int, rng: random.Random) -> Iterator[Shape]:
    prefixes = [random_ids(cfg.prefix_tokens, vocab, rng) for _ in range(cfg.prefix_count)]
    for _ in range(cfg.num_requests):
        prefix = prefixes[rng.randrange(cfg.prefix_count)]
        yield Shape(prefix + random_ids(rng.randint(*cfg.prompt_tokens), vocab, rng), rng.randint(*cfg.output_tokens))


def _text_shapes(cfg: WorkloadConfig, rng: random.Random) -> Iterator[Shape]:
    corpus = stdlib_corpus(max(1 << 20, 4 * cfg.prompt_chars[1]), rng)
    for _ in range(cfg.num_requests):
        length = rng.randint(*cfg.prompt_chars)
        start = rng.randrange(len(corpus) - length + 1)
        yield Shape(corpus[start : start + length], rng.randint(*cfg.output_tokens))


def read_jsonl(path: str) -> list[dict]:
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not JSON ({e.msg})") from None
            _require(isinstance(record, dict), f"{path}:{number}: expected a JSON object")
            records.append(record)
    _require(bool(records), f"{path}: no records")
    return records


def _length(record: dict, key: str, where: str, low: int = 1) -> int:
    value = record.get(key)
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= low,
             f"{where}: {key} must be an integer >= {low}, got {value!r}")
    return value


def sharegpt_lengths(record: dict, where: str, count_tokens) -> tuple[int, int] | None:
    """(input, output) tokens of a record; None for a conversation without a reply."""
    if "input_length" in record:
        return _length(record, "input_length", where), _length(record, "output_length", where)
    turns = record.get("conversations")
    _require(isinstance(turns, list), f"{where}: needs input_length/output_length or conversations")
    if len(turns) < 2 or not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2]):
        return None
    prompt, reply = count_tokens(turns[0]["value"]), count_tokens(turns[1]["value"])
    return (prompt, reply) if prompt >= 1 and reply >= 1 else None


def load_tokenizer(tokenizer_dir: str | None):
    """The `tokenizers` Tokenizer of a model directory (default: the embedded model);
    no torch, no transformers: the benchmark client stays light."""
    from tokenizers import Tokenizer

    directory = Path(tokenizer_dir) if tokenizer_dir else Path(__file__).resolve().parents[2] / "models" / "pdserve-tiny-code"
    file = directory / "tokenizer.json"
    _require(file.is_file(), f"--tokenizer: no tokenizer.json in {directory}")
    return Tokenizer.from_file(str(file))


def _token_counter(tokenizer_dir: str | None):
    tokenizer = load_tokenizer(tokenizer_dir)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def _sharegpt_shapes(cfg: WorkloadConfig, vocab: int, max_len: int, rng: random.Random) -> Iterator[Shape]:
    """Lengths sampled from the file in a seeded order (cycling if it is short);
    records longer than the served model's max_model_len are skipped, as vLLM's
    benchmark does."""
    records = read_jsonl(cfg.path or "")
    counter = None
    lengths: list[tuple[int, int]] = []
    for number, record in enumerate(records, 1):
        if "input_length" not in record and counter is None:
            counter = _token_counter(cfg.tokenizer)
        pair = sharegpt_lengths(record, f"{cfg.path}:{number}", counter)
        if pair is not None and sum(pair) <= max_len:
            lengths.append(pair)
    _require(bool(lengths), f"{cfg.path}: no record fits max_model_len={max_len}")
    rng.shuffle(lengths)
    for i in range(cfg.num_requests):
        prompt_len, output_len = lengths[i % len(lengths)]
        yield Shape(random_ids(prompt_len, vocab, rng), output_len)


def trace_prompt(hash_ids: Sequence[int], length: int, block: int, vocab: int, seed: int, unique: random.Random) -> tuple[int, ...]:
    """`length` token ids: block i is a function of (seed, hash_ids[i]) only, so equal
    hash ids give equal blocks in every request; tokens past the hashed blocks are
    the request's own."""
    tokens: list[int] = []
    for h in hash_ids:
        if len(tokens) >= length:
            break
        tokens += random_ids(block, vocab, random.Random(f"trace-block-{seed}-{h}"))
    tokens = tokens[:length]
    return tuple(tokens) + random_ids(length - len(tokens), vocab, unique)


def _trace_shapes(cfg: WorkloadConfig, vocab: int, max_len: int, rng: random.Random) -> Iterator[Shape]:
    """The first num_requests records; input lengths scaled by trace_block_tokens / 512
    (a hash id always stands for one block), output lengths as recorded."""
    records = read_jsonl(cfg.path or "")[: cfg.num_requests]
    t0 = None
    for number, record in enumerate(records, 1):
        where = f"{cfg.path}:{number}"
        stamp = record.get("timestamp")
        _require(isinstance(stamp, (int, float)) and stamp >= 0, f"{where}: timestamp must be a number >= 0 (ms)")
        hash_ids = record.get("hash_ids")
        _require(isinstance(hash_ids, list) and all(isinstance(h, int) for h in hash_ids),
                 f"{where}: hash_ids must be a list of integers")
        length = math.ceil(_length(record, "input_length", where) * cfg.trace_block_tokens / MOONCAKE_BLOCK)
        output = _length(record, "output_length", where)
        _require(length + output <= max_len,
                 f"{where}: {length} prompt + {output} output tokens exceed max_model_len={max_len} "
                 "(a smaller --trace-block-tokens scales the prompts down)")
        t0 = stamp if t0 is None else t0
        prompt = trace_prompt(hash_ids, length, cfg.trace_block_tokens, vocab, cfg.seed, rng)
        yield Shape(prompt, output, (stamp - t0) / 1000.0 / cfg.trace_speedup)


def make_workload(cfg: WorkloadConfig, arrivals: ArrivalConfig, vocab_size: int, max_model_len: int) -> list[BenchRequest]:
    """Prompts and arrival times from separate seeded streams: changing the rate keeps the prompts."""
    _require(vocab_size > FIRST_REGULAR_TOKEN, f"served vocabulary too small: {vocab_size}")
    _require(cfg.kind != "multiturn", "multiturn: its prompts depend on the answers (multiturn.make_conversations)")
    rng = random.Random(f"prompts-{cfg.kind}-{cfg.seed}")
    shapes = {
        "random": lambda: _random_shapes(cfg, vocab_size, rng),
        "prefix": lambda: _prefix_shapes(cfg, vocab_size, rng),
        "text": lambda: _text_shapes(cfg, rng),
        "sharegpt": lambda: _sharegpt_shapes(cfg, vocab_size, max_model_len, rng),
        "trace": lambda: _trace_shapes(cfg, vocab_size, max_model_len, rng),
    }[cfg.kind]()
    shapes = list(shapes)
    times = send_times(len(shapes), arrivals, random.Random(f"arrivals-{cfg.seed}"))
    requests = [BenchRequest(i, s.prompt, s.max_tokens, t if s.send_at is None else s.send_at)
                for i, (s, t) in enumerate(zip(shapes, times))]
    _check_fits(requests, max_model_len)
    return requests


def _check_fits(requests: Sequence[BenchRequest], max_model_len: int) -> None:
    for r in requests:
        if r.prompt_len is not None:
            _require(r.prompt_len + r.max_tokens <= max_model_len,
                     f"request {r.index}: {r.prompt_len} prompt + {r.max_tokens} output tokens exceed the served "
                     f"max_model_len={max_model_len}")
