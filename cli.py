"""The `pdserve` command line.

    pdserve offline PROMPT...            generate in this process with the engine alone
    pdserve up [--decode M] [--prefill N] [--mixed K] [--port P] [--prometheus] [router/worker flags]
                                         a local cluster; prints `ready <address> internal <registry>`
                                         (and `prometheus <url>` with --prometheus)
    pdserve up --launcher ray [--address auto|HOST:PORT] [--ray-* flags] [...]
                                         the same on a Ray cluster (workers as actors)
    pdserve router|prefill|decode|mixed [flags]   one service
    pdserve generate [--addr A] [--api-key K] [--tls-ca CA] [--json-schema FILE | --json-object |
                     --regex R | --choice A --choice B | --grammar FILE] [--logit-bias ID=BIAS] PROMPT
                                         stream a completion from a running router
    pdserve scale --address ROUTER [--prefill N] [--decode M] [--mixed K]
                                         resize the pools of a cluster `pdserve up` runs
    pdserve bench [--addr A] [flags]     load generator + latency report (pdserve bench --help)
    pdserve plan --model DIR --gpu-memory GiB --max-model-len N --concurrency C [--quantization Q]
                 [--kv-cache-dtype D] [--prompt-len P --output-len O] [--kv-cache-memory B] [...]
                                         memory per worker and workers needed, for the given and the
                                         alternative weight and KV dtypes side by side (no weights read)

Every flag also reads PDSERVE_<NAME> from the environment (e.g. PDSERVE_NUM_BLOCKS).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.launch.cluster import ClusterSpec

API_KEY_ENV = "PDSERVE_API_KEY"  # `generate`: the key, kept off the command line


def _offline(args: argparse.Namespace) -> int:
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    for out in llm.generate(args.prompts, params):
        print(out.prompt + out.outputs[0].text)
        print("-" * 40)
    return 0


def _router(args: argparse.Namespace) -> int:
    from pdserve.services.common.flags import from_namespace
    from pdserve.services.router.config import RouterConfig
    from pdserve.services.router.main import run

    return run(from_namespace(RouterConfig, args))


def _worker(args: argparse.Namespace) -> int:
    from pdserve.services.common.flags import from_namespace
    from pdserve.services.worker.config import WorkerConfig
    from pdserve.services.node import run

    return run(from_namespace(WorkerConfig, args, role=args.command))


def _plan(args: argparse.Namespace) -> int:
    from pdserve.engine.config import DEFAULT_MODEL
    from pdserve.services.common.flags import from_namespace

    if args.profile is not None:  # by SLO, in the simulator
        from pdserve.planner.plan import SloPlanConfig
        from pdserve.planner.plan import run as plan_by_slo

        return plan_by_slo(from_namespace(SloPlanConfig, args), args.output_len,
                           None if args.model == DEFAULT_MODEL else args.model, args.max_num_batched_tokens,
                           args.max_num_seqs, args.block_size, args.json)
    from pdserve.launch.plan import PlanConfig, run

    return run(from_namespace(PlanConfig, args))


def _profile(args: argparse.Namespace) -> int:
    from pdserve.planner.profile import ProfileConfig, run
    from pdserve.services.common.flags import from_namespace

    return run(from_namespace(ProfileConfig, args))


def cluster_spec(args: argparse.Namespace) -> ClusterSpec:
    """What `pdserve up ARGS` launches: the router, the worker template (every worker's
    settings but those decided per worker, launch/cluster.py render_worker) and the
    launch's own. Raises ValueError naming a bad field."""
    from pdserve.launch.cluster import ClusterSpec, LaunchConfig
    from pdserve.services.common.flags import from_namespace
    from pdserve.services.router.config import RouterConfig
    from pdserve.services.worker.config import WorkerConfig

    return ClusterSpec(
        router=from_namespace(RouterConfig, args),
        worker=from_namespace(WorkerConfig, args, role="decode"),
        launch=from_namespace(LaunchConfig, args),
    )


def _up(args: argparse.Namespace) -> int:
    from pdserve.launch.cluster import up
    from pdserve.launch.ray_config import RayConfig
    from pdserve.services.common.flags import from_namespace

    spec = cluster_spec(args)
    ray_config = from_namespace(RayConfig, args)
    if spec.launch.launcher == "ray":
        from pdserve.launch.ray import RayCluster

        return up(RayCluster(spec, ray_config))
    from pdserve.launch.local import LocalCluster

    return up(LocalCluster(spec))


def _scale(args: argparse.Namespace) -> int:
    import time

    import grpc

    from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
    from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
    from pdserve.services.common.credentials import ClusterAuth, ClusterCredentials
    from pdserve.services.common.flags import from_namespace
    from pdserve.services.router.pools import POOLS

    target = {pool: getattr(args, pool) for pool in POOLS if getattr(args, pool) is not None}
    for pool, size in target.items():
        if size < 0:
            raise ValueError(f"{pool}: must be >= 0, got {size}")
    give_up = time.monotonic() + (args.wait or 0.0)
    try:
        auth = ClusterAuth(from_namespace(ClusterCredentials, args))
        with auth.channel(args.address) as channel:
            stub = pb_grpc.RegistryStub(channel)
            reply = stub.Scale(pb.ScaleRequest(target=pb.PoolSizes(**target)), timeout=args.timeout)
            while args.wait and not _pools_match(reply) and time.monotonic() < give_up:
                time.sleep(0.2)
                reply = stub.Scale(pb.ScaleRequest(), timeout=args.timeout)
    except grpc.RpcError as e:
        print(f"pdserve: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    for pool in POOLS:
        want = str(getattr(reply.target, pool)) if reply.target.HasField(pool) else "-"
        print(f"{pool}: target {want} live {getattr(reply.live, pool)} draining {getattr(reply.draining, pool)}")
    return 0 if not args.wait or _pools_match(reply) else 1


def _pools_match(reply) -> bool:
    from pdserve.services.router.pools import POOLS

    return all(getattr(reply.live, p) == getattr(reply.target, p) and getattr(reply.draining, p) == 0
               for p in POOLS if reply.target.HasField(p))


def _constraint(args: argparse.Namespace) -> dict | None:
    """`generate`'s structured-outputs flag (at most one: argparse refuses two), in
    vLLM's form (services/router/client.py options_from_kwargs)."""
    if args.json_schema is not None:
        return {"json": Path(args.json_schema).read_text()}
    if args.grammar is not None:
        return {"grammar": Path(args.grammar).read_text()}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice:
        return {"choice": args.choice}
    return {"json_object": True} if args.json_object else None


def _logit_bias(pairs: list[str] | None) -> dict[int, float] | None:
    """`--logit-bias ID=BIAS` flags as a map (argparse's error on a malformed one)."""
    if not pairs:
        return None
    out = {}
    for pair in pairs:
        token, sep, bias = pair.partition("=")
        try:
            out[int(token)] = float(bias)
        except ValueError:
            raise SystemExit(f"pdserve generate: --logit-bias: want TOKEN_ID=BIAS, got {pair!r}") from None
        if not sep:
            raise SystemExit(f"pdserve generate: --logit-bias: want TOKEN_ID=BIAS, got {pair!r}")
    return out


def _generate(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf import json_format

    from pdserve.services.router.client import Client

    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "n": args.n,
                "beam_width": args.beam_width, "seed": args.seed, "structured_outputs": _constraint(args),
                "logit_bias": _logit_bias(args.logit_bias)}
    texts: dict[int, str] = {}
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    try:
        with Client(args.addr, timeout=args.timeout, api_key=api_key, tls_ca=args.tls_ca,
                    tls_server_name=args.tls_server_name) as client:
            for message in client.generate(args.prompt, cache_salt=args.cache_salt, **sampling):
                if args.json:
                    record = json_format.MessageToDict(
                        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True,
                    )
                    print(json.dumps(record), flush=True)
                elif args.n == 1 and args.beam_width == 1:
                    print(message.text, end="", flush=True)
                else:
                    texts[message.index] = texts.get(message.index, "") + message.text
    except grpc.RpcError as e:
        print(f"\npdserve: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if not args.json and (args.n > 1 or args.beam_width > 1):
        for index in sorted(texts):
            print(f"--- [{index}]\n{texts[index]}")
    elif not args.json:
        print()
    return 0


def build_parser() -> argparse.ArgumentParser:
    from pdserve.engine.config import DEFAULT_MODEL
    from pdserve.engine.quant.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS
    from pdserve.launch.cluster import PER_WORKER, LaunchConfig
    from pdserve.launch.credentials import LAUNCH_MADE
    from pdserve.launch.plan import PlanConfig
    from pdserve.launch.ray_config import RayConfig
    from pdserve.services.common.flags import add_flags
    from pdserve.services.common.credentials import KV_CURVE_FIELDS, ClusterCredentials
    from pdserve.services.router.config import RouterConfig
    from pdserve.services.router.pools import POOLS
    from pdserve.services.worker.config import ROLES, WorkerConfig

    parser = argparse.ArgumentParser(
        prog="pdserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    off = sub.add_parser("offline", help="generate in this process with the engine alone")
    off.add_argument("prompts", nargs="+")
    off.add_argument("--model", default=DEFAULT_MODEL)
    off.add_argument("--max-tokens", type=int, default=64)
    off.add_argument("--temperature", type=float, default=0.0)
    off.add_argument("--seed", type=int, default=None)
    off.add_argument("--dtype", default="float32")
    off.add_argument("--device", default="cpu")
    off.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS, help="quantize while loading")
    off.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    off.add_argument("--enforce-eager", action="store_true",
                     help="run every step on the eager path (vLLM's flag): no oneDNN-prepacked weights")
    off.set_defaults(func=_offline)

    up = sub.add_parser("up", help="start router + workers (local processes or Ray actors); "
                                   "prints `ready <address> internal <registry>`")
    add_flags(up, LaunchConfig)
    add_flags(up, RayConfig)
    made = set(LAUNCH_MADE)  # fresh for every launch: no flags for them
    taken = add_flags(up, RouterConfig, skip={"address_file"} | made)  # shared names (model, block_size, ...) go to both
    add_flags(up, WorkerConfig, skip=taken | set(PER_WORKER) | made)
    up.set_defaults(func=_up)

    router = sub.add_parser("router", help="the router: public Generation API + worker registry")
    add_flags(router, RouterConfig)
    router.set_defaults(func=_router)
    for role in ROLES:
        worker = sub.add_parser(role, help=f"a {role} worker")
        add_flags(worker, WorkerConfig)
        worker.set_defaults(func=_worker)

    gen = sub.add_parser("generate", help="stream a completion from a running router")
    gen.add_argument("prompt")
    gen.add_argument("--addr", default="127.0.0.1:50051",
                     help="router host:port; several, comma-separated, or a DNS name whose every address is a "
                          "router: a refused call is retried on another (README: Retrying clients)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--beam-width", type=int, default=1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    gen.add_argument("--json", action="store_true", help="one JSON object per response message")
    gen.add_argument("--api-key", default=None, help=f"API key of the router (or ${API_KEY_ENV}, which keeps it out "
                                                     "of the process list)")
    gen.add_argument("--tls-ca", default=None, help="CA certificate (PEM) of the router's TLS certificate: use TLS")
    gen.add_argument("--tls-server-name", default=None, help="name the router's certificate carries (default: the host)")
    gen.add_argument("--cache-salt", default="", help="prefix-cache salt: requests with another salt share no "
                                                      "cached blocks with this one")
    constraint = gen.add_mutually_exclusive_group()  # structured outputs: one constraint at most
    constraint.add_argument("--json-schema", metavar="FILE", default=None, help="the output is JSON valid "
                                                                                "against this JSON schema file")
    constraint.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    constraint.add_argument("--regex", default=None, help="the whole output matches this regular expression")
    constraint.add_argument("--choice", action="append", default=None, metavar="TEXT",
                            help="the output is one of these strings (repeat the flag for each)")
    constraint.add_argument("--grammar", metavar="FILE", default=None, help="the output follows this grammar "
                                                                            "(the workers' backend's syntax)")
    gen.add_argument("--logit-bias", action="append", default=None, metavar="TOKEN_ID=BIAS",
                     help="add BIAS (-100..100) to a token's logit (repeat the flag for each token)")
    gen.set_defaults(func=_generate)

    scale = sub.add_parser("scale", help="resize the worker pools of a cluster `pdserve up` runs")
    scale.add_argument("--address", default="127.0.0.1:50052",
                       help="the router's internal (Registry) address: `ready`'s second one")
    # The Registry is internal: the cluster's credentials (`pdserve up --secrets-dir DIR`
    # keeps them: --cluster-token-file DIR/cluster-token).
    add_flags(scale, ClusterCredentials, skip=set(KV_CURVE_FIELDS))
    for pool in POOLS:
        scale.add_argument(f"--{pool}", type=int, default=None, help=f"target number of {pool} workers")
    scale.add_argument("--wait", type=float, default=0.0,
                       help="seconds to wait for the live pools to match (exit 1 if they do not)")
    scale.add_argument("--timeout", type=float, default=10.0, help="deadline of each call in seconds")
    scale.set_defaults(func=_scale)
    plan = sub.add_parser("plan", help="weights, KV blocks and workers needed for a load, for the given and the "
                                       "alternative weight and KV dtypes side by side (reads no weights)")
    add_flags(plan, PlanConfig)
    from pdserve.planner.plan import SloPlanConfig  # flags only

    add_flags(plan, SloPlanConfig)
    plan.set_defaults(func=_plan)
    profile = sub.add_parser("profile", help="measure one worker's prefill and decode steps and KV transfer on "
                                             "this machine: a profile (JSON) for the planner")
    from pdserve.planner.profile import ProfileConfig  # flags only: torch loads when it runs

    add_flags(profile, ProfileConfig)
    profile.set_defaults(func=_profile)
    # Listed here for --help; main() hands everything after `bench` to bench.serving.command's own parser.
    sub.add_parser("bench", add_help=False,
                   help="open-loop load generator against a router: TTFT/TPOT/ITL, goodput (pdserve bench --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # `pdserve bench` is `python -m pdserve.bench.serving.command`
        from pdserve.bench.serving.command import main as bench

        return bench(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except ValueError as e:  # bad flags or input: the message names the field
        print(f"pdserve: {e}", file=sys.stderr)
        code = 2
    except (TimeoutError, OSError) as e:  # router unreachable, port taken, ...
        print(f"pdserve: {e}", file=sys.stderr)
        code = 1
    if args.command in SERVICES:
        _exit_now(code)
    return code


# Long-running services: each tears its own state down in order (server, engine
# thread, connector) before returning, so the interpreter's slow generic teardown of
# torch and gRPC (seconds) is skipped; a launcher's stop then takes well under its
# grace period.
SERVICES = ("router", "prefill", "decode", "mixed")


def _exit_now(code: int) -> None:
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
