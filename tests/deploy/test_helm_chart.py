"""The Helm chart (deploy/helm/pdserve): lint, render, validate, and read what it renders.

No cluster and no helm binary: the Helm SDK renders the chart in this process
(tests/chart_helpers.py), every rendered object is validated offline against the
Kubernetes schemas (and the prometheus-operator CRDs), and the arguments each pod
would run go through the real `pdserve` argument parsers.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import helm_python as helm
import jsonschema
import pytest
import yaml

from chart_helpers import (
    CHART,
    K8S_LATEST,
    K8S_OLDEST,
    NAMESPACE,
    REPO,
    load_values,
    matches,
    name,
    of_kind,
    one,
    pod_spec,
    render,
    validate,
)
from pdserve import cli
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.services.common.credentials import ClusterAuth
from pdserve.services.common.flags import ENV_PREFIX, _cli_fields, from_namespace
from pdserve.services.router.config import RouterConfig
from pdserve.kvtransfer import registry as kv_registry
from pdserve.services.worker.config import WorkerConfig

sys.path.insert(0, str(REPO / "scripts"))
import sync_chart_files  # noqa: E402

EXAMPLE = CHART / "examples" / "two-node-pools.yaml"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
POOLS = ("prefill", "decode")
COMPONENTS = ("router", *POOLS)
CONFIGS = {"router": RouterConfig, "prefill": WorkerConfig, "decode": WorkerConfig}
# What a pod's downward-API variables hold when the test expands $(VAR) in its args.
FIELD_REFS = {"metadata.name": "{pod}", "status.podIP": "10.1.2.3"}
# A speculative config for the decode pool (decode.config.speculativeConfig).
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
SPEC_JSON = json.dumps(SPEC)


@pytest.fixture(scope="module")
def default() -> list[dict]:
    return render()


@pytest.fixture(scope="module")
def example() -> list[dict]:
    return render(load_values(EXAMPLE), name="llm")


def workload(objects: list[dict], component: str, release: str = "demo") -> dict:
    kind = "Deployment" if component == "router" else "StatefulSet"
    return one(objects, kind, name(component, release))


def container(objects: list[dict], component: str, release: str = "demo") -> dict:
    (c,) = pod_spec(workload(objects, component, release))["containers"]
    return c


# -- lint and render ---------------------------------------------------------------------


@pytest.mark.parametrize("values", [None, EXAMPLE], ids=["default", "two-node-pools"])
def test_lint_strict_finds_nothing(values: Path | None) -> None:
    report = helm.lint(CHART, load_values(values) if values else None, strict=True, namespace=NAMESPACE,
                       kube_version=f"v{K8S_LATEST}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 1 is INFO ("icon is recommended")
    assert not problems and not report["errors"], report


def test_renders_every_component_with_defaults(default: list[dict]) -> None:
    kinds = sorted({(o["kind"], o["metadata"]["name"]) for o in default})
    assert ("Deployment", name("router")) in kinds
    for pool in POOLS:
        assert ("StatefulSet", name(pool)) in kinds and ("Service", name(pool)) in kinds
        assert one(default, "Service", name(pool))["spec"]["clusterIP"] == "None"  # headless
    for kind in ("PodDisruptionBudget", "NetworkPolicy", "Secret", "ServiceAccount"):
        assert of_kind(default, kind), kind
    # monitoring objects are behind their toggles
    for kind in ("ServiceMonitor", "PrometheusRule", "ConfigMap", "HorizontalPodAutoscaler"):
        assert not of_kind(default, kind), kind


@pytest.mark.parametrize("version", [K8S_LATEST, K8S_OLDEST])
@pytest.mark.parametrize("case", ["default", "two-node-pools", "every-option"])
def test_every_rendered_object_validates(case: str, version: str, default, example) -> None:
    objects = {"default": default, "two-node-pools": example}.get(case) or render(every_option_values())
    assert objects
    for obj in objects:
        try:
            validate(obj, version)
        except jsonschema.ValidationError as e:
            where = "/".join(map(str, e.absolute_path))
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} (Kubernetes {version}) at {where}: {e.message}", pytrace=False)


CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def every_option_values() -> dict:
    """Values that turn on every optional object and path of the chart at once."""
    values = load_values(EXAMPLE)
    values["credentials"] = {"cluster": {"mtls": True}, "kvCurve": {"existingSecret": "curve"},
                             "apiKeys": {"generate": True}, "tls": {"existingSecret": "public-tls"}}
    values["router"]["config"] = {"saltCacheByKey": True, "prefillPolicy": "round_robin", "httpMaxBodyBytes": 1 << 20}
    values["router"]["chatTemplate"] = CHAT_TEMPLATE
    values["prefill"]["config"] = {"cpuAffinity": "0-7"}
    values["decode"]["config"] = {"speculativeConfig": SPEC, "kvOffloadHostBytes": 1 << 30,
                                  "kvOffloadDiskBytes": 1 << 34, "kvOffloadPersist": True}
    values["decode"]["kvOffloadVolume"] = {"enabled": True, "type": "pvc", "size": "32Gi"}
    values["prefill"]["kvOffloadVolume"] = {"enabled": True, "type": "emptyDir"}
    values["prefill"]["config"]["kvOffloadDiskBytes"] = 1 << 33
    values["model"].update(quantization="int8", kvCacheDtype="fp8_e4m3")
    values["prefill"]["autoscaling"] = {"enabled": True, "minReplicas": 2, "maxReplicas": 6,
                                        "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}}}
    values["router"]["podDisruptionBudget"] = {"minAvailable": 1}
    values["networkPolicy"]["publicFrom"] = [{"ipBlock": {"cidr": "10.0.0.0/8"}}]
    values["imagePullSecrets"] = [{"name": "registry"}]
    return values


# -- values.schema.json: bad values fail at install time, naming the value ------------------

BAD_VALUES = {
    "negative replicas": ({"prefill": {"replicas": -1}}, "/prefill/replicas"),
    "no decode worker": ({"decode": {"replicas": 0}}, "/decode/replicas"),
    "no router": ({"router": {"replicas": 0}}, "/router/replicas"),
    "negative router min ready": ({"router": {"minReadySeconds": -1}}, "/router/minReadySeconds"),
    "GPU count not a number": ({"decode": {"resources": {"limits": {"nvidia.com/gpu": "two"}}}}, "/decode/resources/limits/nvidia.com~1gpu"),
    "fractional GPU": ({"prefill": {"resources": {"requests": {"nvidia.com/gpu": 0.5}}}}, "/prefill/resources/requests/nvidia.com~1gpu"),
    "bad memory quantity": ({"router": {"resources": {"limits": {"memory": "lots"}}}}, "/router/resources/limits/memory"),
    "unknown dtype": ({"engine": {"dtype": "float8"}}, "/engine/dtype"),
    "unknown attention backend": ({"decode": {"engine": {"attentionBackend": "flash"}}}, "/decode/engine/attentionBackend"),
    "missing model source": ({"model": {"source": None}}, "'source'"),
    "unknown model source": ({"model": {"source": "ftp"}}, "/model/source"),
    "pvc without a claim": ({"model": {"source": "pvc"}}, "/model/pvc/claimName"),
    "hostPath not absolute": ({"model": {"source": "hostPath", "hostPath": {"path": "data"}}}, "/model/hostPath/path"),
    "image without a tag": ({"model": {"source": "image", "image": {"repository": "models/llama"}}}, "/model/image/tag"),
    "url without a url": ({"model": {"source": "url"}}, "/model/url/url"),
    "model dir escapes": ({"model": {"source": "hostPath", "hostPath": {"path": "/data"}, "dir": "../etc"}}, "/model/dir"),
    "flag the CLI lacks": ({"engine": {"maxNumSeq": 8}}, "'maxNumSeq'"),
    "pool block size": ({"prefill": {"engine": {"blockSize": 32}}}, "'blockSize'"),
    "block size as text": ({"engine": {"blockSize": "16"}}, "/engine/blockSize"),
    "zero timeout": ({"router": {"config": {"workerTimeout": 0}}}, "/router/config/workerTimeout"),
    "unknown log level": ({"decode": {"config": {"logLevel": "LOUD"}}}, "/decode/config/logLevel"),
    "bad kv connector": ({"prefill": {"config": {"kvConnector": "no colon"}}}, "/prefill/config/kvConnector"),
    "port out of range": ({"router": {"ports": {"grpc": 70000}}}, "/router/ports/grpc"),
    "HTTP port out of range": ({"router": {"ports": {"http": 0}}}, "/router/ports/http"),
    "chat template not text": ({"router": {"chatTemplate": ["{{ messages }}"]}}, "/router/chatTemplate"),
    "tiny HTTP body cap": ({"router": {"config": {"httpMaxBodyBytes": 10}}}, "/router/config/httpMaxBodyBytes"),
    "unknown image variant": ({"image": {"variant": "rocm"}}, "/image/variant"),
    "misspelt top-level block": ({"prefil": {"replicas": 2}}, "'prefil'"),
    "probe period zero": ({"decode": {"probes": {"startup": {"periodSeconds": 0}}}}, "/decode/probes/startup/periodSeconds"),
    "bad scrape interval": ({"serviceMonitor": {"interval": "often"}}, "/serviceMonitor/interval"),
    "unknown prefill policy": ({"router": {"config": {"prefillPolicy": "random"}}}, "/router/config/prefillPolicy"),
    "bad CPU list": ({"decode": {"config": {"cpuAffinity": "0-3,x"}}}, "/decode/config/cpuAffinity"),
    "zero drain time": ({"decode": {"drainTimeoutSeconds": 0}}, "/decode/drainTimeoutSeconds"),
    "negative max logprobs": ({"engine": {"maxLogprobs": -1}}, "/engine/maxLogprobs"),
    "unknown speculative method": ({"decode": {"config": {"speculativeConfig": {"method": "medusa",
                                                                                "num_speculative_tokens": 3}}}},
                                   "/decode/config/speculativeConfig/method"),
    "speculative config without K": ({"decode": {"config": {"speculativeConfig": {"method": "ngram"}}}},
                                     "'num_speculative_tokens'"),
    "unknown speculative key": ({"decode": {"config": {"speculativeConfig": {"method": "ngram", "k": 3,
                                                                             "num_speculative_tokens": 3}}}}, "'k'"),
    "unknown quantization": ({"model": {"quantization": "int3"}}, "/model/quantization"),
    "unknown KV cache dtype": ({"model": {"kvCacheDtype": "fp16"}}, "/model/kvCacheDtype"),
    # the model's storage is the release's: no pool may differ (their KV pages must match)
    "pool quantization": ({"decode": {"engine": {"quantization": "int8"}}}, "'quantization'"),
    "pool KV cache dtype": ({"prefill": {"config": {"kvCacheDtype": "fp8"}}}, "'kvCacheDtype'"),
    "GPU memory utilization above 1": ({"engine": {"gpuMemoryUtilization": 1.5}}, "/engine/gpuMemoryUtilization"),
}


@pytest.mark.parametrize("values,names", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_bad_values_fail_through_the_schema_naming_the_value(values: dict, names: str) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        render(values)
    message = str(caught.value)
    assert "values don't meet the specifications of the schema" in message, message
    assert names in message, message


def test_autoscaling_bounds_are_checked_when_rendering() -> None:
    with pytest.raises(helm.HelmError, match=r"decode\.autoscaling: minReplicas \(5\) exceeds maxReplicas \(2\)"):
        render({"decode": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}})


def test_defaults_and_the_example_pass_the_schema() -> None:
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema({})
        chart.validate_schema(load_values(EXAMPLE))


# -- the flags each pod runs are the CLI's ---------------------------------------------------


def camel(field: str) -> str:
    head, *rest = field.split("_")
    return head + "".join(part.title() for part in rest)


def snake(key: str) -> str:
    return re.sub(r"([A-Z])", r"_\1", key).lower()


def schema_props(*path: str) -> dict[str, dict]:
    """The properties of the values block at `path` (following $refs)."""
    node = SCHEMA
    for key in path:
        node = node["properties"][key]
        if "$ref" in node:
            node = SCHEMA["definitions"][node["$ref"].split("/")[-1]]
    return node["properties"]


def schema_keys(*path: str) -> set[str]:
    return set(schema_props(*path))


# Flags the chart knowingly leaves out, and why.
NOT_RENDERED = {
    "address_file": "a launcher's handshake: no use in a pod",
    # Helm cannot compute a Curve25519 public key, so it cannot make per-role key pairs:
    # the chart gives every worker one cluster key (--kv-curve-cluster-key) instead.
    "kv_curve_cert": "the chart's workers use --kv-curve-cluster-key",
    "kv_curve_authorized": "the chart's workers use --kv-curve-cluster-key",
}
ROUTER_NOT_RENDERED = {"kv_curve_cluster_key": "the router has no KV channel"}


def cli_fields(cls: type) -> set[str]:
    """The flags of a config class: its fields, a block's fields (the credentials)
    in place of the block."""
    hints = typing.get_type_hints(cls)
    names = set()
    for f in _cli_fields(cls):
        names |= cli_fields(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else {f.name}
    return names


def values_fields(component: str) -> set[str]:
    """Config fields that values keys of `component` set (camelCase -> snake_case)."""
    if component == "router":
        return {"block_size", "max_model_len", "max_n"} | {snake(k) for k in schema_keys("router", "config")}
    return {snake(k) for k in schema_keys("engine") | schema_keys(component, "config")}


def rendered_fields(argv: list[str], env: dict[str, str]) -> set[str]:
    """Fields a pod sets: its flags, and the PDSERVE_* variables (flags.py reads one for
    every field; the chart sets --drain-timeout that way, so that a pdserve without the
    flag ignores it)."""
    flags = {re.sub(r"^no-", "", a[2:]).replace("-", "_") for a in argv if a.startswith("--")}
    return flags | {k[len(ENV_PREFIX):].lower() for k in env}


@pytest.mark.parametrize("component", COMPONENTS)
def test_chart_renders_every_cli_flag_and_no_other(component: str) -> None:
    """Every values key is a flag the CLI has, and every flag the CLI has is rendered
    by the chart (with every option on), set by a values key, or knowingly left out:
    a field added to a config dataclass fails here until the chart renders it."""
    fields = cli_fields(CONFIGS[component])
    keys = values_fields(component)
    assert keys <= fields, f"values keys that are no flag of `pdserve {component}`: {sorted(keys - fields)}"
    argv, env = pod_argv(render(every_option_values()), component)
    not_rendered = NOT_RENDERED | (ROUTER_NOT_RENDERED if component == "router" else {})
    missing = fields - rendered_fields(argv, env) - keys - set(not_rendered)
    assert not missing, f"flags of `pdserve {component}` the chart does not render yet: {sorted(missing)}"


# Flags whose value is a JSON object (a str field): values may give an object, which the
# chart's flags helper renders with toJson.
JSON_FLAGS = {"speculative_config"}


def test_schema_types_match_the_config_fields() -> None:
    """A values key's JSON type is its dataclass field's type (int -> integer, ...;
    a JSON flag's string may also be an object)."""
    kinds = {int: "integer", float: "number", str: "string", bool: "boolean"}
    blocks = [(("engine",), WorkerConfig), (("router", "config"), RouterConfig), (("prefill", "config"), WorkerConfig),
              (("decode", "config"), WorkerConfig)]
    for block, cls in blocks:
        hints = typing.get_type_hints(cls)
        for key, prop in schema_props(*block).items():
            hint = hints[snake(key)]
            args = typing.get_args(hint)
            want = {kinds[a] for a in args if a is not type(None)} if args else {kinds[hint]}
            if type(None) in args:
                want.add("null")
            if snake(key) in JSON_FLAGS:
                want.add("object")
            got = set(prop["type"]) if isinstance(prop["type"], list) else {prop["type"]}
            assert got == want, f"{'.'.join(block)}.{key}: schema says {sorted(got)}, {cls.__name__}.{snake(key)} is {hint}"


def pod_argv(objects: list[dict], component: str, release: str = "demo") -> tuple[list[str], dict[str, str]]:
    """The container's args with $(VAR) expanded as the kubelet would, and its literal
    PDSERVE_* environment."""
    c = container(objects, component, release)
    pod = f"{name(component, release)}-0"
    env: dict[str, str] = {}
    for var in c["env"]:
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), var["value"])
        elif "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = FIELD_REFS[var["valueFrom"]["fieldRef"]["fieldPath"]].format(pod=pod)

    def expand(arg: str) -> str:
        for ref in re.findall(r"\$\((\w+)\)", arg):
            assert ref in env, f"{component}: args use $({ref}), which the container's env does not define"
        return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)

    argv = [expand(a) for a in c["args"]]
    return argv, {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}


def parse(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys) -> object:
    """Parse `argv` with the real `pdserve` parser under the pod's PDSERVE_* env."""
    for key in list(os.environ):
        if key.startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        return cli.build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"`pdserve {' '.join(argv)}` does not parse: {capsys.readouterr().err}", pytrace=False)


# What an existing Secret named in values holds, for the test's stand-in files.
STAND_INS = {"token": "t" * 32, "cluster.key": base64.b64encode(bytes(range(32))).decode(), "api-keys": "k" * 32 + "\n"}


def mount_secrets(objects: list[dict], component: str, argv: list[str], root: Path, release: str = "demo") -> list[str]:
    """Write the files the pod's Secret volumes would hold under `root` (a Secret the
    chart generated: its data; an existing one: stand-ins), and its ConfigMap volumes'
    (the chart's own: their data), and point `argv` at them."""
    spec = pod_spec(workload(objects, component, release))
    volumes = {v["name"]: v["secret"] for v in spec["volumes"] if "secret" in v}
    secrets = {o["metadata"]["name"]: o for o in of_kind(objects, "Secret")}
    mounts = {}
    config_maps = {v["name"]: one(objects, "ConfigMap", v["configMap"]["name"]) for v in spec["volumes"] if "configMap" in v}
    for mount in container(objects, component, release)["volumeMounts"]:
        if mount["name"] in config_maps:
            assert mount["readOnly"] and mount["mountPath"].startswith("/etc/pdserve/"), mount
            folder = root / component / mount["name"]
            folder.mkdir(parents=True)
            for key, text in config_maps[mount["name"]]["data"].items():
                (folder / key).write_text(text)
            mounts[mount["mountPath"]] = folder
        if mount["name"] not in volumes:
            continue
        assert mount["readOnly"] and mount["mountPath"].startswith("/etc/pdserve/"), mount
        volume = volumes[mount["name"]]
        folder = root / component / mount["name"]
        folder.mkdir(parents=True)
        data = secrets.get(volume["secretName"], {}).get("data")
        for item in volume["items"]:
            text = base64.b64decode(data[item["key"]]).decode() if data else STAND_INS.get(item["key"], "stand-in")
            (folder / item["path"]).write_text(text)
            (folder / item["path"]).chmod(0o600)
        mounts[mount["mountPath"]] = folder
    out = []
    for arg in argv:
        for path, folder in mounts.items():
            if arg.startswith(path + "/"):
                arg = str(folder / arg[len(path) + 1:])
        out.append(arg)
    return out


@pytest.mark.parametrize("case", ["default", "two-node-pools", "every-option"])
@pytest.mark.parametrize("component", COMPONENTS)
def test_pod_args_parse_with_the_real_cli(component: str, case: str, default, example, monkeypatch, capsys,
                                          tmp_path) -> None:
    release = "llm" if case == "two-node-pools" else "demo"
    values = {"default": {}, "two-node-pools": load_values(EXAMPLE)}.get(case)
    if values is None:
        values = every_option_values()
        objects = render(values)
    else:
        objects = default if case == "default" else example
    argv, env = pod_argv(objects, component, release)
    assert argv[0] == component
    ns = parse(mount_secrets(objects, component, argv, tmp_path, release), env, monkeypatch, capsys)
    assert ns.command == component
    # The config the process would build: its own checks run (model dir swapped for
    # one that exists here; credential files where the Secrets would be).
    overrides = {"model": DEFAULT_MODEL} if component == "router" else {"model": DEFAULT_MODEL, "role": component}
    if getattr(ns, "kv_offload_dir", None):  # the disk KV tier's volume: a directory here
        assert ns.kv_offload_dir == "/var/lib/pdserve/kv-offload"
        overrides["kv_offload_dir"] = str(tmp_path / "kv-offload")
    config = from_namespace(CONFIGS[component], ns, **overrides)
    c = container(objects, component, release)
    grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
    assert (config.host, config.port) == ("0.0.0.0", grpc_port)
    if component == "router":  # the OpenAI API, on by default, on the container's http port
        http_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
        assert (config.http_host, config.http_port) == ("0.0.0.0", http_port)
    assert ns.model == model_path(values)
    engine = {**(values.get("engine") or {}), **((values.get(component) or {}).get("engine") or {})}
    for key, value in engine.items():
        if snake(key) in {f.name for f in _cli_fields(CONFIGS[component])}:
            assert getattr(config, snake(key)) == value, key
    if component != "router":
        assert config.worker_id == f"{name(component, release)}-0"
        assert config.advertise_host == FIELD_REFS["status.podIP"]
        assert env["PDSERVE_KV_HOST"] == FIELD_REFS["status.podIP"]
        host, port = config.router.rsplit(":", 1)  # one name: every router (headless)
        svc = one(objects, "Service", name("router-registry", release))
        assert host == f"{svc['metadata']['name']}.{NAMESPACE}.svc"
        assert int(port) in [p["port"] for p in svc["spec"]["ports"]]


def model_path(values: dict) -> str:
    model = values.get("model") or {}
    if model.get("source", "embedded") == "embedded":
        return "/opt/pdserve/models/pdserve-tiny-code"
    return "/models/" + model["dir"] if model.get("dir") else "/models"


def test_every_values_key_reaches_the_cli(monkeypatch, capsys) -> None:
    """Each key of the engine and config blocks, set away from its default, comes out
    of the parser as that value (camelCase -> --kebab-case, numbers intact)."""
    samples = {"integer": 8589934592, "number": 2.5, "boolean": False}
    strings = {"dtype": "bfloat16", "attentionBackend": "triton", "logLevel": "DEBUG", "device": "cuda:1",
               "kvConnector": "zmq_ipc", "cpuAffinity": "0,2-3", "decodeCaptureSizes": "1,4",
               "prefillPolicy": "round_robin", "speculativeConfig": SPEC_JSON,
               "kvOffloadPolicy": "arc", "kvOffloadDiskPolicy": "lru", "structuredOutputsBackend": "llguidance",
               "toolCallParser": "llama3_json",
               "gpuMemoryUtilization": 0.75}  # a number in (0, 1]
    blocks = {"engine": ("engine",), "router": ("router", "config"), "prefill": ("prefill", "config"),
              "decode": ("decode", "config")}
    settings: dict[str, dict] = {}
    for block, path in blocks.items():
        settings[block] = {}
        for key, prop in schema_props(*path).items():
            kind = prop["type"] if isinstance(prop["type"], str) else next(k for k in prop["type"] if k != "null")
            settings[block][key] = strings[key] if key in strings else samples[kind]
    settings["engine"].update(blockSize=32, maxModelLen=128, maxN=4, torchThreads=3,
                              structuredOutputsMaxBytes=4096, structuredOutputsMaxDepth=8)  # below their caps
    for pool in POOLS:
        settings[pool]["grpcThreads"] = 64
    values = {"engine": settings["engine"], **{c: {"config": settings[c]} for c in COMPONENTS}}
    for pool in POOLS:  # kvOffloadDiskBytes needs the disk tier's volume
        values[pool]["kvOffloadVolume"] = {"enabled": True}
    objects = render(values)
    for component in COMPONENTS:
        argv, env = pod_argv(objects, component)
        ns = parse(argv, env, monkeypatch, capsys)
        fields = {f.name for f in _cli_fields(CONFIGS[component])}
        for key, value in {**settings["engine"], **settings[component]}.items():
            if snake(key) in fields:
                assert getattr(ns, snake(key)) == value, f"{component}: {key}"


def test_pdserve_env_the_chart_sets_is_read_by_pdserve(example) -> None:
    """Every PDSERVE_* variable in a pod is a flag's or one kvtransfer reads: the chart
    sets nothing the code ignores, but --drain-timeout's, set ahead of the flag."""
    known = {kv_registry.HOST_ENV, kv_registry.IPC_DIR_ENV}
    # Read by `pdserve` once the services drain on SIGTERM (WorkerConfig/RouterConfig
    # .drain_timeout); until then the variable is ignored, and it is harmless.
    known.add(ENV_PREFIX + "DRAIN_TIMEOUT")
    objects = render(every_option_values())
    for component in COMPONENTS:
        fields = {ENV_PREFIX + name.upper() for name in cli_fields(CONFIGS[component])}
        for var in container(objects, component)["env"]:
            if var["name"].startswith(ENV_PREFIX):
                assert var["name"] in fields | known, f"{component}: {var['name']} is read by nothing"
            assert "secretKeyRef" not in var.get("valueFrom", {}), f"{component}: a secret in the environment"


def worker_configs(objects: list[dict], root: Path, monkeypatch, capsys, release: str = "demo") -> dict[str, WorkerConfig]:
    """The config each pool's pod would build, with its Secrets' files under `root`."""
    configs = {}
    for pool in POOLS:
        argv, env = pod_argv(objects, pool, release)
        ns = parse(mount_secrets(objects, pool, argv, root, release), env, monkeypatch, capsys)
        configs[pool] = from_namespace(WorkerConfig, ns, model=DEFAULT_MODEL, role=pool)
    return configs


@pytest.mark.parametrize("given", [SPEC, SPEC_JSON], ids=["object", "json-string"])
def test_decode_pods_speculate_with_the_speculative_config_value(given, tmp_path, monkeypatch, capsys) -> None:
    """decode.config.speculativeConfig, an object or a JSON string, reaches the decode
    pods as --speculative-config JSON, which their engine config parses; prefill pods,
    which never decode, get none."""
    objects = render({"decode": {"config": {"speculativeConfig": given}}})
    argv, _ = pod_argv(objects, "decode")
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == SPEC
    configs = worker_configs(objects, tmp_path, monkeypatch, capsys)
    assert configs["decode"].engine_config().speculative == SpeculativeConfig.parse(SPEC)
    assert configs["prefill"].speculative_config is None
    assert "--speculative-config" not in pod_argv(objects, "prefill")[0]


EAGLE = {"method": "eagle3", "num_speculative_tokens": 4, "model": "/models/head"}


@pytest.mark.parametrize("given", [EAGLE, json.dumps(EAGLE)], ids=["object", "json-string"])
def test_an_eagle_head_goes_to_the_prefill_pool_too(given) -> None:
    """An EAGLE head runs on prefill workers as well (they ship its state for the
    prompt, and workers pair only with the same head): both pools get the same
    --speculative-config."""
    objects = render({"decode": {"config": {"speculativeConfig": given}}})
    for pool in POOLS:
        argv, _ = pod_argv(objects, pool)
        assert json.loads(argv[argv.index("--speculative-config") + 1]) == EAGLE, pool


@pytest.mark.parametrize("model", [{}, {"quantization": "fp8", "kvCacheDtype": "fp8_e5m2"}], ids=["default", "fp8"])
def test_both_pools_store_the_model_alike(model, tmp_path, monkeypatch, capsys) -> None:
    """model.quantization and model.kvCacheDtype reach every pool as the same
    --quantization and --kv-cache-dtype (a prefill and a decode worker exchange KV pages
    as stored), and their engine configs take them; engine.gpuMemoryUtilization is a
    shared engine flag a pool may override."""
    objects = render({"model": model, "engine": {"gpuMemoryUtilization": 0.8},
                      "decode": {"engine": {"gpuMemoryUtilization": 0.7}}})
    configs = worker_configs(objects, tmp_path, monkeypatch, capsys)
    for pool, config in configs.items():
        engine = config.engine_config()
        assert (engine.quantization, engine.kv_cache_dtype) == (model.get("quantization"),
                                                                model.get("kvCacheDtype", "auto")), pool
    assert configs["prefill"].engine_config().gpu_memory_utilization == 0.8
    assert configs["decode"].engine_config().gpu_memory_utilization == 0.7
    assert "--quantization" not in pod_argv(render({}), "router")[0]


def test_curve_key_from_the_generated_secret_makes_one_cluster_key_pair(default, tmp_path, monkeypatch, capsys) -> None:
    """The chart's KV channel: one generated secret key (randBytes 32) that every worker
    derives the same CURVE key pair from, admitting only that key; a new install draws
    a new key; an existing Secret is used by name."""
    secret = one(default, "Secret", name("kv-curve"))
    assert len(base64.b64decode(base64.b64decode(secret["data"]["cluster.key"]), validate=True)) == 32
    configs = worker_configs(default, tmp_path, monkeypatch, capsys)
    prefill, decode = (ClusterAuth(configs[pool].credentials).kv_curve() for pool in POOLS)
    assert prefill is not None and prefill == decode
    assert decode.authorized_keys == {decode.public_key} and decode.server_key == decode.public_key
    assert one(render(), "Secret", name("kv-curve"))["data"] != secret["data"]
    router = {v["name"] for v in pod_spec(workload(default, "router"))["volumes"]}
    assert "kv-curve" not in router  # the router has no KV channel
    named = render({"credentials": {"kvCurve": {"existingSecret": "curve"}}})
    assert not [s for s in of_kind(named, "Secret") if s["metadata"]["name"] == name("kv-curve")]
    for pool in POOLS:
        volumes = {v["name"]: v["secret"] for v in pod_spec(workload(named, pool))["volumes"] if "secret" in v}
        assert volumes["kv-curve"]["secretName"] == "curve"
        assert volumes["kv-curve"]["items"] == [{"key": "cluster.key", "path": "cluster.key"}]
    off = render({"credentials": {"kvCurve": {"generate": False}}})
    assert "--kv-curve-cluster-key" not in container(off, "decode")["args"]


def test_generated_cluster_certificates_make_an_mtls_connection(tmp_path, monkeypatch, capsys) -> None:
    """With credentials.cluster.mtls the generated CA and certificate work as they are
    used: a worker's server and a peer dialling it by IP, names checked against
    --cluster-server-name, each showing the certificate the CA signed."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdserve.services.common.server import GrpcServer

    objects = render({"credentials": {"cluster": {"mtls": True}}})
    config = worker_configs(objects, tmp_path, monkeypatch, capsys)["decode"]
    creds = config.credentials
    assert creds.mtls and creds.cluster_token_file and creds.cluster_server_name == "pdserve-cluster"
    auth = ClusterAuth(creds)
    server = GrpcServer(threads=4, interceptors=auth.interceptors())
    port = server.start("127.0.0.1", 0, [], auth.server_credentials())
    try:
        server.set_serving()
        with auth.channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(f"127.0.0.1:{port}") as plain:  # no certificate: no connection
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=2)
    finally:
        server.stop(0)



def test_the_pods_make_a_working_cluster_with_the_generated_credentials(tmp_path, monkeypatch, capsys) -> None:
    """The router and both pools as the chart configures them (every credential on,
    generated: cluster token and mTLS, the CURVE cluster key, an API key), in this
    process on loopback: the workers register with the router's internal port, a
    prompt is prefilled on the prefill worker and its KV crosses to the decode worker
    over CURVE, and a call without the API key is refused."""
    import grpc

    from pdserve.services.router.client import Client, collect
    from pdserve.services.router.main import Router
    from pdserve.services.node import Worker

    values = {"credentials": {"cluster": {"mtls": True}, "apiKeys": {"generate": True}},
              "router": {"config": {"localPrefillThreshold": 0}}, "engine": {"numBlocks": 64}}
    objects = render(values)
    argv, env = pod_argv(objects, "router")
    ns = parse(mount_secrets(objects, "router", argv, tmp_path), env, monkeypatch, capsys)
    loopback = {"host": "127.0.0.1", "internal_host": "127.0.0.1", "metrics_host": "127.0.0.1", "port": 0,
                "internal_port": 0, "metrics_port": 0}
    router = Router(from_namespace(RouterConfig, ns, model=DEFAULT_MODEL, **loopback))
    api_key = (tmp_path / "router" / "api-keys" / "api-keys").read_text().split()[0]
    address = router.start()
    workers = {}
    try:
        configs = worker_configs(objects, tmp_path / "workers", monkeypatch, capsys)
        monkeypatch.setenv(kv_registry.HOST_ENV, "127.0.0.1")  # the pod IP's stand-in
        for pool in ("decode", "prefill"):
            workers[pool] = Worker(dataclasses.replace(
                configs[pool], router=router.internal_address, advertise_host="127.0.0.1",
                **{k: v for k, v in loopback.items() if not k.startswith("internal")}))
            workers[pool].start()
        prompt = "def fib(n):\n" + "".join(f"    x_{k} = step({k})\n" for k in range(8))
        with Client(address, timeout=60, api_key=api_key) as client:
            (seq,) = collect(client.generate(prompt, max_tokens=4, temperature=0.0)).values()
        assert len(seq.token_ids) == 4
        assert workers["decode"].connector.stats().kv_transfers == 1  # prefilled remotely, over CURVE
        with Client(address, timeout=10) as client, pytest.raises(grpc.RpcError) as refused:
            collect(client.generate(prompt, max_tokens=1))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        for worker in workers.values():
            worker.stop()
        router.stop()

# -- placement, probes, termination ---------------------------------------------------------


def test_pools_get_their_own_node_selectors_tolerations_and_gpus(example) -> None:
    values = load_values(EXAMPLE)
    for pool in POOLS:
        spec = pod_spec(workload(example, pool, "llm"))
        assert spec["nodeSelector"] == values[pool]["nodeSelector"]
        assert spec["tolerations"] == values[pool]["tolerations"]
        resources = container(example, pool, "llm")["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == values[pool]["resources"]["requests"]["nvidia.com/gpu"]
        assert resources["limits"]["nvidia.com/gpu"] == values[pool]["resources"]["limits"]["nvidia.com/gpu"]
    prefill, decode = (pod_spec(workload(example, p, "llm")) for p in POOLS)
    assert prefill["nodeSelector"] != decode["nodeSelector"]
    assert decode["affinity"] == values["decode"]["affinity"]
    router = pod_spec(workload(example, "router", "llm"))
    assert "nodeSelector" not in router and "tolerations" not in router  # no GPU, kept off the tainted pools
    assert "nvidia.com/gpu" not in json.dumps(container(example, "router", "llm")["resources"])


@pytest.mark.parametrize("component", COMPONENTS)
def test_probes_use_grpc_health_and_the_startup_probe_covers_model_loading(component: str, default) -> None:
    c = container(default, component)
    grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert set(c[probe]) & {"grpc", "exec", "httpGet", "tcpSocket"} == {"grpc"}, probe
        assert c[probe]["grpc"]["port"] == grpc_port
        assert c[probe]["grpc"].get("service", "") == ""  # the server's overall health
    startup = c["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= (600 if component != "router" else 60), f"{component}: {budget}s to load the model"


# Which plaintext port each probe can use (Kubernetes' gRPC probe speaks no TLS).
PROBES = {
    "mtls": ({"cluster": {"mtls": True}}, {"router": ("grpc", "grpc"), "prefill": ("tcpSocket", "grpc"),
                                           "decode": ("tcpSocket", "grpc")}),
    "public-tls": ({"tls": {"existingSecret": "t"}}, {"router": ("grpc", "internal"), "decode": ("grpc", "grpc")}),
    "both": ({"cluster": {"mtls": True}, "tls": {"existingSecret": "t"}}, {"router": ("tcpSocket", "grpc")}),
}


@pytest.mark.parametrize("case", PROBES)
def test_probes_avoid_tls_ports(case: str) -> None:
    credentials, expected = PROBES[case]
    objects = render({"credentials": credentials})
    for component, (kind, port_name) in expected.items():
        c = container(objects, component)
        port = next(p["containerPort"] for p in c["ports"] if p["name"] == port_name)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe][kind] == {"port": port}, (component, probe)


@pytest.mark.parametrize("component", COMPONENTS)
def test_graceful_termination(component: str, default, monkeypatch, capsys, tmp_path) -> None:
    """preStop sleeps while the pod leaves its endpoints, then SIGTERM starts the
    drain (--drain-timeout, given as PDSERVE_DRAIN_TIMEOUT), and the grace period
    covers both with room to exit."""
    spec = pod_spec(workload(default, component))
    c = container(default, component)
    values = load_values(CHART / "values.yaml")[component]
    sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    env = {v["name"]: v.get("value") for v in c["env"]}
    drain = float(env[ENV_PREFIX + "DRAIN_TIMEOUT"])
    assert drain == values["drainTimeoutSeconds"]
    assert 0 < sleep and sleep + drain + 10 <= spec["terminationGracePeriodSeconds"]
    if "drain_timeout" in cli_fields(CONFIGS[component]):  # once the services drain on SIGTERM
        argv, pod_env = pod_argv(default, component)
        assert parse(mount_secrets(default, component, argv, tmp_path), pod_env, monkeypatch, capsys).drain_timeout == drain
    with pytest.raises(helm.HelmError, match=rf"{component}\.terminationGracePeriodSeconds \(40\) must be at least"):
        render({component: {"terminationGracePeriodSeconds": 40, "drainTimeoutSeconds": 30}})


def test_pod_disruption_budgets_select_each_component(default) -> None:
    for component in COMPONENTS:
        pdb = one(default, "PodDisruptionBudget", name(component))
        labels = workload(default, component)["spec"]["template"]["metadata"]["labels"]
        assert matches(pdb["spec"]["selector"]["matchLabels"], labels)
        assert pdb["spec"]["maxUnavailable"] == 1
    pdb = one(render({"decode": {"podDisruptionBudget": {"minAvailable": "50%"}}}), "PodDisruptionBudget", name("decode"))
    assert pdb["spec"] == {"minAvailable": "50%", "selector": pdb["spec"]["selector"]}


def test_autoscaler_per_pool_on_a_custom_metric(example) -> None:
    hpa = one(example, "HorizontalPodAutoscaler", name("decode", "llm"))
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name("decode", "llm")}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "pdserve_kv_cache_usage_perc"
    assert "replicas" not in workload(example, "decode", "llm")["spec"]  # the autoscaler owns it
    assert workload(example, "prefill", "llm")["spec"]["replicas"] == 2
    assert not [h for h in of_kind(example, "HorizontalPodAutoscaler") if h["metadata"]["name"] == name("prefill", "llm")]


# -- model sources --------------------------------------------------------------------------

MODEL_SOURCES = {
    "pvc": {"source": "pvc", "pvc": {"claimName": "weights", "subPath": "hf"}, "dir": "llama"},
    "hostPath": {"source": "hostPath", "hostPath": {"path": "/mnt/models"}, "dir": "llama"},
    "image": {"source": "image", "image": {"repository": "models/llama", "tag": "3-8b"}},
    "url": {"source": "url", "url": {"url": "s3://bucket/models", "credentialsSecret": "s3"}, "dir": "llama"},
}


@pytest.mark.parametrize("source", MODEL_SOURCES)
def test_model_sources(source: str, monkeypatch, capsys) -> None:
    objects = render({"model": MODEL_SOURCES[source]})
    for obj in objects:
        validate(obj)
    for component in COMPONENTS:
        spec = pod_spec(workload(objects, component))
        (volume,) = [v for v in spec["volumes"] if v["name"] == "model"]
        (mount,) = [m for m in container(objects, component)["volumeMounts"] if m["name"] == "model"]
        assert mount["mountPath"] == "/models" and mount["readOnly"]
        argv, env = pod_argv(objects, component)
        assert parse(argv, env, monkeypatch, capsys).model == model_path({"model": MODEL_SOURCES[source]})
        init = spec.get("initContainers", [])
        if source == "pvc":
            assert volume["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
            assert mount["subPath"] == "hf" and not init
        elif source == "hostPath":
            assert volume["hostPath"]["path"] == "/mnt/models" and not init
        else:
            assert "emptyDir" in volume
            (copier,) = init
            assert {"name": "model", "mountPath": "/models"} in copier["volumeMounts"]
            if source == "image":
                assert copier["image"] == "models/llama:3-8b"
                assert copier["command"] == ["cp", "-R", "/model/.", "/models/"]
            else:
                env = {e["name"]: e.get("value") for e in copier["env"]}
                assert env["MODEL_URL"] == "s3://bucket/models" and env["MODEL_DIR"] == "/models"
                assert copier["envFrom"] == [{"secretRef": {"name": "s3"}}]


def test_embedded_model_needs_no_volume(default) -> None:
    for component in COMPONENTS:
        assert "model" not in {v["name"] for v in pod_spec(workload(default, component))["volumes"]}


# -- services, credentials, network policy ---------------------------------------------------


def test_public_service_exposes_only_the_public_ports(default) -> None:
    public = one(default, "Service", name("router"))
    assert [p["name"] for p in public["spec"]["ports"]] == ["grpc", "http"]
    internal = one(default, "Service", name("router-internal"))
    assert internal["spec"]["type"] == "ClusterIP"
    assert {p["name"] for p in internal["spec"]["ports"]} == {"internal", "metrics"}
    grpc_only = one(render({"router": {"ports": {"http": None}}}), "Service", name("router"))
    assert [p["name"] for p in grpc_only["spec"]["ports"]] == ["grpc"]


# -- router replicas ---------------------------------------------------------------------


def router_pod_labels(objects: list[dict], release: str = "demo") -> dict[str, str]:
    return workload(objects, "router", release)["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("case", ["default", "two-node-pools", "every-option"])
def test_workers_register_with_every_router_through_the_headless_service(case, default, example, monkeypatch,
                                                                       capsys, tmp_path) -> None:
    """Two routers by default; the headless registry Service selects them (ready ones
    only) on their internal port, and every pool's --router is its DNS name, which the
    worker's parser accepts; the public Service still spreads clients over every router."""
    release = "llm" if case != "default" else "demo"
    objects = {"default": default, "two-node-pools": example}.get(case) or render(every_option_values(), name="llm")
    assert workload(objects, "router", release)["spec"]["replicas"] == 2
    registry = one(objects, "Service", name("router-registry", release))
    assert registry["spec"]["clusterIP"] == "None" and registry["spec"]["publishNotReadyAddresses"] is False
    assert matches(registry["spec"]["selector"], router_pod_labels(objects, release))
    (port,) = registry["spec"]["ports"]
    internal = next(p["containerPort"] for p in container(objects, "router", release)["ports"] if p["name"] == "internal")
    assert port["targetPort"] == "internal" and port["port"] == internal
    assert "pdserve.io/metrics" not in registry["metadata"]["labels"]  # scraped once, through -internal
    address = f"{name('router-registry', release)}.{NAMESPACE}.svc:{internal}"
    for pool in POOLS:
        args = container(objects, pool, release)["args"]
        assert args.count("--router") == 1 and args[args.index("--router") + 1] == address, pool
        argv, env = pod_argv(objects, pool, release)
        ns = parse(mount_secrets(objects, pool, argv, tmp_path / pool, release), env, monkeypatch, capsys)
        config = from_namespace(WorkerConfig, ns, model=DEFAULT_MODEL, role=pool)
        assert config.router == address and config.router_resolve_interval == 2.0
    public = one(objects, "Service", name("router", release))
    assert public["spec"].get("clusterIP") != "None" and matches(public["spec"]["selector"], router_pod_labels(objects, release))
    for obj in objects:
        validate(obj)


def test_router_rollout_never_leaves_zero_routers_ready(default) -> None:
    """A new router starts first and must be ready (gRPC health) for minReadySeconds
    before an old one stops; the routers' budget lets a drain take one at a time."""
    deployment = workload(default, "router")
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert deployment["spec"]["minReadySeconds"] == 5
    probe = container(default, "router")["readinessProbe"]
    assert probe["grpc"] == {"port": 50051} and probe["periodSeconds"] == 5
    pdb = one(default, "PodDisruptionBudget", name("router"))
    assert pdb["spec"]["maxUnavailable"] == 1
    assert matches(pdb["spec"]["selector"]["matchLabels"], router_pod_labels(default))
    pdb = one(render({"router": {"replicas": 3, "podDisruptionBudget": {"minAvailable": 1}}}), "PodDisruptionBudget",
              name("router"))
    assert pdb["spec"] == {"minAvailable": 1, "selector": pdb["spec"]["selector"]}
    assert workload(render({"router": {"minReadySeconds": 0}}), "router")["spec"]["minReadySeconds"] == 0


def test_a_single_router_renders_without_a_budget() -> None:
    objects = render({"router": {"replicas": 1}})
    assert workload(objects, "router")["spec"]["replicas"] == 1
    budgets = {p["metadata"]["name"] for p in of_kind(objects, "PodDisruptionBudget")}
    assert budgets == {name("prefill"), name("decode")}
    one(objects, "Service", name("router-registry"))  # workers still find it by name
    for obj in objects:
        validate(obj)
        validate(obj, K8S_OLDEST)


def test_router_serves_the_openai_api_on_its_http_port(default, monkeypatch, capsys, tmp_path) -> None:
    """router.ports.http (8000, vLLM's port, by default): --http-port and --http-host,
    a container port and a port of the public Service; null turns all three off; it
    must differ from the router's other ports. router.chatTemplate: a ConfigMap the
    router reads as --chat-template (a new template rolls the pod)."""
    args = container(default, "router")["args"]
    assert args[args.index("--http-port") + 1] == "8000" and args[args.index("--http-host") + 1] == "0.0.0.0"
    declared = {p["name"]: p["containerPort"] for p in container(default, "router")["ports"]}
    assert declared["http"] == 8000
    (service,) = [p for p in one(default, "Service", name("router"))["spec"]["ports"] if p["name"] == "http"]
    assert service == {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"}
    assert "--chat-template" not in args and not of_kind(default, "ConfigMap")

    moved = render({"router": {"ports": {"http": 8080}}})
    args = container(moved, "router")["args"]
    assert args[args.index("--http-port") + 1] == "8080"
    assert {p["name"]: p["containerPort"] for p in container(moved, "router")["ports"]}["http"] == 8080
    assert [p["port"] for p in one(moved, "Service", name("router"))["spec"]["ports"]] == [50051, 8080]

    off = render({"router": {"ports": {"http": None}}})
    args = container(off, "router")["args"]
    assert "--http-port" not in args and "--http-host" not in args
    assert "http" not in {p["name"] for p in container(off, "router")["ports"]}
    argv, env = pod_argv(off, "router")
    ns = parse(mount_secrets(off, "router", argv, tmp_path / "off"), env, monkeypatch, capsys)
    assert from_namespace(RouterConfig, ns, model=DEFAULT_MODEL).http_port is None
    with pytest.raises(helm.HelmError, match=r"router\.ports: grpc \(50051\), internal \(50052\), metrics \(9090\) "
                                             r"and http \(50052\) must differ"):
        render({"router": {"ports": {"http": 50052}}})

    objects = render({"router": {"chatTemplate": CHAT_TEMPLATE}})
    (config_map,) = of_kind(objects, "ConfigMap")
    assert config_map["data"] == {"chat_template.jinja": CHAT_TEMPLATE}
    argv, env = pod_argv(objects, "router")
    config = from_namespace(RouterConfig, parse(mount_secrets(objects, "router", argv, tmp_path), env, monkeypatch,
                                                capsys), model=DEFAULT_MODEL)
    assert Path(config.chat_template).read_text() == CHAT_TEMPLATE
    annotations = workload(objects, "router")["spec"]["template"]["metadata"]["annotations"]
    other = render({"router": {"chatTemplate": CHAT_TEMPLATE + " "}})
    assert annotations != workload(other, "router")["spec"]["template"]["metadata"]["annotations"]
    for obj in objects:
        validate(obj, K8S_LATEST)


def test_credentials_generated_on_install(default) -> None:
    secret = one(default, "Secret", name("cluster"))
    import base64

    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert set(data) == {"token", "ca.crt", "tls.crt", "tls.key"}
    assert len(data["token"]) >= 32 and data["token"].isalnum()
    assert data["ca.crt"].startswith("-----BEGIN CERTIFICATE-----") and data["tls.key"].startswith("-----BEGIN RSA PRIVATE KEY-----")
    for component in COMPONENTS:
        volumes = {v["name"]: v for v in pod_spec(workload(default, component))["volumes"]}
        assert volumes["cluster-credentials"]["secret"]["secretName"] == name("cluster")
    # Rendered twice, they differ: nothing is baked into the chart.
    assert one(render(), "Secret", name("cluster"))["data"]["token"] != secret["data"]["token"]


def test_existing_secrets_by_name() -> None:
    objects = render({"credentials": {"cluster": {"existingSecret": "my-cluster"}, "apiKeys": {"existingSecret": "my-keys"},
                                      "tls": {"existingSecret": "my-tls"}, "kvCurve": {"existingSecret": "my-curve"}}})
    assert not of_kind(objects, "Secret")  # nothing generated
    router = {v["name"]: v["secret"]["secretName"] for v in pod_spec(workload(objects, "router"))["volumes"] if "secret" in v}
    assert router == {"cluster-credentials": "my-cluster", "api-keys": "my-keys", "tls": "my-tls"}
    decode = {v["name"]: v["secret"]["secretName"] for v in pod_spec(workload(objects, "decode"))["volumes"] if "secret" in v}
    assert decode == {"cluster-credentials": "my-cluster", "kv-curve": "my-curve"}  # not the public port's keys
    args = container(objects, "router")["args"]
    assert args[args.index("--api-keys-file") + 1] == "/etc/pdserve/api-keys/api-keys"
    assert args[args.index("--tls-cert") + 1] == "/etc/pdserve/tls/tls.crt"
    with pytest.raises(helm.HelmError, match=r"router\.config\.saltCacheByKey: needs API keys"):
        render({"router": {"config": {"saltCacheByKey": True}}})
    generated = render({"credentials": {"apiKeys": {"generate": True}}})
    keys = one(generated, "Secret", name("api-keys"))
    assert set(keys["data"]) == {"api-keys"}


def test_network_policy_on_by_default(default) -> None:
    workers = one(default, "NetworkPolicy", name("workers"))
    release = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": "demo"}
    for pool in POOLS:
        labels = workload(default, pool)["spec"]["template"]["metadata"]["labels"]
        assert matches(workers["spec"]["podSelector"]["matchLabels"], labels)
    assert not matches(workers["spec"]["podSelector"]["matchLabels"] | {"app.kubernetes.io/component": "router"},
                       {"app.kubernetes.io/component": "prefill"})
    assert workers["spec"]["podSelector"]["matchExpressions"] == [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["prefill", "decode"]}]
    (everything,) = workers["spec"]["ingress"]
    assert everything == {"from": [{"podSelector": {"matchLabels": release}}]}  # gRPC, KV and metrics ports
    router = one(default, "NetworkPolicy", name("router"))
    public, internal = router["spec"]["ingress"]
    # publicFrom empty: every source, on both public ports (gRPC, the OpenAI API)
    assert public == {"ports": [{"port": "grpc", "protocol": "TCP"}, {"port": "http", "protocol": "TCP"}]}
    grpc_only = one(render({"router": {"ports": {"http": None}}}), "NetworkPolicy", name("router"))
    assert grpc_only["spec"]["ingress"][0] == {"ports": [{"port": "grpc", "protocol": "TCP"}]}
    assert internal == {"ports": [{"port": "internal", "protocol": "TCP"}, {"port": "metrics", "protocol": "TCP"}],
                        "from": [{"podSelector": {"matchLabels": release}}]}
    for port in ("grpc", "http", "internal", "metrics"):  # the policy's named ports are the container's
        assert port in {p["name"] for p in container(default, "router")["ports"]}
    assert not of_kind(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy")


def test_metrics_from_admits_the_scrapers_to_metrics_ports_only(example) -> None:
    scrapers = load_values(EXAMPLE)["networkPolicy"]["metricsFrom"]
    for policy in ("workers", "router"):
        rules = one(example, "NetworkPolicy", name(policy, "llm"))["spec"]["ingress"]
        assert {"ports": [{"port": "metrics", "protocol": "TCP"}], "from": scrapers} in rules, policy
        assert [r for r in rules if r.get("from") == scrapers] == [rules[-1]], policy
    with pytest.raises(helm.HelmError, match=r"serviceMonitor\.enabled: .* set networkPolicy\.metricsFrom"):
        render({"serviceMonitor": {"enabled": True}})


# -- monitoring ------------------------------------------------------------------------------


def test_service_monitor_selects_every_metrics_port(example) -> None:
    (monitor,) = of_kind(example, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [s for s in of_kind(example, "Service") if any(p["name"] == endpoint["port"] for p in s["spec"]["ports"])]
    assert services and all(matches(selector, s["metadata"]["labels"]) for s in services)
    # every pod's metrics port is behind one of those Services
    for component in COMPONENTS:
        labels = workload(example, component, "llm")["spec"]["template"]["metadata"]["labels"]
        assert any(matches(s["spec"]["selector"], labels) for s in services), component
        assert "metrics" in {p["name"] for p in container(example, component, "llm")["ports"]}
    # and it selects nothing else of the release
    for service in of_kind(example, "Service"):
        if service not in services:
            assert not matches(selector, service["metadata"]["labels"]), service["metadata"]["name"]


@pytest.mark.parametrize(("field", "port_name"), [("metrics_port", "metrics"), ("internal_port", "internal")])
def test_ports_are_what_the_processes_serve(field: str, port_name: str, default, monkeypatch, capsys) -> None:
    """Once the CLI has the flag (issue 10's --metrics-port, issue 9's --internal-port),
    each pod passes it the port its container declares."""
    components = [c for c in COMPONENTS if field in {f.name for f in _cli_fields(CONFIGS[c])}]
    if not components:
        pytest.skip(f"--{field.replace('_', '-')} is not a flag of pdserve yet: the chart declares the port, "
                    "wiring it is left to the merge")
    for component in components:
        argv, env = pod_argv(default, component)
        declared = {p["name"]: p["containerPort"] for p in container(default, component)["ports"]}
        assert getattr(parse(argv, env, monkeypatch, capsys), field) == declared[port_name], component


def chart_copy(tmp_path: Path, files: dict[str, bytes]) -> Path:
    """The chart with `files` under files/ instead of what sync_chart_files copied."""
    chart = tmp_path / "pdserve"
    shutil.copytree(CHART, chart, ignore=shutil.ignore_patterns("files"))
    for relative, data in files.items():
        (chart / "files" / relative).parent.mkdir(parents=True, exist_ok=True)
        (chart / "files" / relative).write_bytes(data)
    return chart


DASHBOARD = REPO / "deploy" / "grafana" / "pdserve.json"
RULES = REPO / "deploy" / "prometheus" / "pdserve-rules.yaml"
# Stand-ins, to prove the templates before the real files exist: quoting, <>&,
# non-ASCII, {{ }} (Grafana and Prometheus templates that Helm must not touch).
SAMPLE_DASHBOARD = ('{\n  "title": "pdserve <TTFT & TPOT> \u2013 p99",\n  "panels": [{"targets": [{"expr": '
                    '"histogram_quantile(0.99, sum by (le) (rate(pdserve:time_to_first_token_seconds_bucket'
                    '{model_name=\\"$model_name\\"}[5m])))", "legendFormat": "{{role}}"}]}],\n  "tags": ["\\\\"]\n}\n').encode()
SAMPLE_RULES = b"""groups:
  - name: pdserve
    rules:
      - record: pdserve:ttft_seconds:p99
        expr: histogram_quantile(0.99, sum by (le, model_name) (rate(pdserve:time_to_first_token_seconds_bucket[5m])))
      - alert: PdserveTTFTHigh
        expr: pdserve:ttft_seconds:p99 > 2
        for: 5m
        labels: {severity: warning}
        annotations:
          summary: "TTFT p99 of {{ $labels.model_name }} is {{ $value }}s"
"""


def monitoring_object(real: bool, source: Path, sample: bytes, kind: str, values: dict, tmp_path: Path) -> tuple[dict, bytes]:
    """The one `kind` object rendered with `values`, from the chart's copy of `source`
    (real) or from a chart copy holding `sample` instead; and the bytes it came from."""
    if real and not source.is_file():
        pytest.skip(f"{source.relative_to(REPO)} does not exist yet (issue 10)")
    data = source.read_bytes() if real else sample
    relative = sync_chart_files.COPIES[source.relative_to(REPO)]
    chart = CHART if real else chart_copy(tmp_path, {str(relative): data})
    (obj,) = of_kind(render(values, chart=chart), kind)
    validate(obj)
    return obj, data


@pytest.mark.parametrize("real", [True, False], ids=["deploy-file", "stand-in"])
def test_dashboard_config_map_holds_the_dashboard_byte_for_byte(real: bool, tmp_path: Path) -> None:
    values = {"grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "LLM"}}}
    config_map, source = monitoring_object(real, DASHBOARD, SAMPLE_DASHBOARD, "ConfigMap", values, tmp_path)
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["data"]["pdserve.json"].encode() == source


@pytest.mark.parametrize("real", [True, False], ids=["deploy-file", "stand-in"])
def test_prometheus_rule_holds_the_rules(real: bool, tmp_path: Path) -> None:
    values = {"prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}}
    rule, source = monitoring_object(real, RULES, SAMPLE_RULES, "PrometheusRule", values, tmp_path)
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == yaml.safe_load(source)


def test_monitoring_toggles_fail_clearly_without_their_files(tmp_path: Path) -> None:
    chart = chart_copy(tmp_path, {})
    with pytest.raises(helm.HelmError, match=r"grafanaDashboard\.enabled: the chart has no files/grafana/pdserve\.json"):
        render({"grafanaDashboard": {"enabled": True}}, chart=chart)
    with pytest.raises(helm.HelmError, match=r"prometheusRule\.enabled: the chart has no files/prometheus/pdserve-rules\.yaml"):
        render({"prometheusRule": {"enabled": True}}, chart=chart)


def test_custom_resources_are_checked_against_the_crds() -> None:
    """The CRD validation is not a formality: a typo in the ServiceMonitor fails."""
    (monitor,) = of_kind(render({"serviceMonitor": {"enabled": True}, "networkPolicy": {"enabled": False}}),
                         "ServiceMonitor")
    validate(monitor)
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError, match="intervall"):
        validate(monitor)


# -- the chart's copies of deploy/ files ----------------------------------------------------


def test_chart_copies_of_monitoring_files_are_current() -> None:
    problems = sync_chart_files.stale()
    assert not problems, f"run `python scripts/sync_chart_files.py`: {problems}"


def test_sync_script_copies_updates_and_removes(tmp_path: Path) -> None:
    (tmp_path / "deploy" / "grafana").mkdir(parents=True)
    (tmp_path / "deploy" / "grafana" / "pdserve.json").write_bytes(SAMPLE_DASHBOARD)
    script = [sys.executable, str(REPO / "scripts" / "sync_chart_files.py"), "--repo", str(tmp_path)]
    check = subprocess.run([*script, "--check"], capture_output=True, text=True)
    assert check.returncode == 1 and "grafana/pdserve.json: differs" in check.stderr
    subprocess.run(script, check=True, capture_output=True)
    copy = tmp_path / "deploy" / "helm" / "pdserve" / "files" / "grafana" / "pdserve.json"
    assert copy.read_bytes() == SAMPLE_DASHBOARD
    assert subprocess.run([*script, "--check"]).returncode == 0
    (tmp_path / "deploy" / "grafana" / "pdserve.json").unlink()  # the source goes: so does the copy
    assert subprocess.run([*script, "--check"], capture_output=True).returncode == 1
    subprocess.run(script, check=True, capture_output=True)
    assert not copy.exists() and not (tmp_path / "deploy" / "helm" / "pdserve" / "files").exists()


# -- image and README ------------------------------------------------------------------------


def test_default_image_is_the_one_the_readme_builds(default) -> None:
    images = {container(default, c)["image"] for c in COMPONENTS}
    assert images == {"pdserve:0.1.0-cpu"}
    readme = (CHART / "README.md").read_text()
    assert "docker build --build-arg VARIANT=cpu -t pdserve:0.1.0-cpu ." in readme
    example_images = {container(render(load_values(EXAMPLE), name="llm"), c, "llm")["image"] for c in COMPONENTS}
    assert example_images == {"registry.example.com/pdserve:0.1.0-cuda"}


def test_chart_readme_documents_every_values_block() -> None:
    readme = (CHART / "README.md").read_text()
    for key in SCHEMA["properties"]:
        if key != "global":
            assert f"`{key}" in readme, key


# -- KV tiers (issue 36) ----------------------------------------------------------------------


def test_kv_tiers_a_host_budget_per_pool_and_a_disk_volume_per_pod() -> None:
    """config.kvOffloadHostBytes is each pool's own host-memory tier; kvOffloadVolume gives
    the disk tier a volume at --kv-offload-dir: an emptyDir, or (pvc) a claim per pod
    that a restarted pod finds again."""
    objects = render(every_option_values())
    mount = "/var/lib/pdserve/kv-offload"
    for pool, host_bytes, kind in (("prefill", 0, "emptyDir"), ("decode", 1 << 30, "pvc")):
        argv, _ = pod_argv(objects, pool)
        assert int(argv[argv.index("--kv-offload-host-bytes") + 1]) == host_bytes, pool
        assert argv[argv.index("--kv-offload-dir") + 1] == mount, pool
        assert {"name": "kv-offload", "mountPath": mount} in container(objects, pool)["volumeMounts"]
        sts = workload(objects, pool)
        volumes = {v["name"]: v for v in pod_spec(sts)["volumes"]}
        claims = [t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])]
        if kind == "pvc":
            assert "kv-offload" not in volumes and claims == ["kv-offload"]
            (claim,) = sts["spec"]["volumeClaimTemplates"]
            assert claim["spec"]["resources"]["requests"]["storage"] == "32Gi"
            assert "--kv-offload-persist" in argv
        else:
            assert volumes["kv-offload"]["emptyDir"] == {"sizeLimit": "64Gi"} and not claims
    default = render({})
    for pool in POOLS:
        argv, _ = pod_argv(default, pool)
        assert "--kv-offload-dir" not in argv and argv[argv.index("--kv-offload-host-bytes") + 1] == "0"
        assert all(m["name"] != "kv-offload" for m in container(default, pool)["volumeMounts"])


@pytest.mark.parametrize("values, message", [
    ({"decode": {"kvOffloadVolume": {"enabled": True}}}, r"decode\.kvOffloadVolume is enabled: set "
                                                         r"decode\.config\.kvOffloadDiskBytes"),
    ({"prefill": {"config": {"kvOffloadDiskBytes": 1 << 30}}}, r"prefill\.config\.kvOffloadDiskBytes needs a volume"),
])
def test_a_disk_tier_needs_its_bytes_and_its_volume(values: dict, message: str) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render(values)
