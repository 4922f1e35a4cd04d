"""The Helm chart, rendered offline and validated (for tests/deploy/test_helm_chart.py).

Rendering goes through the Helm SDK itself (PyPI's helm-python-sdk bundles it as a
shared library: no helm binary, no cluster). Built-in kinds are validated with
kubernetes-validate's schemas (strict: unknown fields are errors); the
prometheus-operator kinds with the CRDs vendored under tests/data/crds, made strict
the same way.
"""

from __future__ import annotations

import copy
import functools
import importlib.resources
import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml
from referencing import Registry, Resource

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "helm" / "pdserve"
CRDS = Path(__file__).resolve().parent / "data" / "crds"
RELEASE, NAMESPACE = "demo", "llm"
K8S_LATEST = kubernetes_validate.latest_version()
# The oldest Kubernetes the chart claims (Chart.yaml kubeVersion ">=X.Y.Z-0").
K8S_OLDEST = re.match(r">=\s*(\d+\.\d+\.\d+)", yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]).group(1)

Obj = dict[str, Any]


def render(values: dict | None = None, chart: Path = CHART, name: str = RELEASE, namespace: str = NAMESPACE) -> list[Obj]:
    """Every object the chart renders with `values`, as `helm template` would."""
    with helm.Chart.load(chart) as loaded:
        manifests = loaded.render(values or {}, name=name, namespace=namespace)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def load_values(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def one(objects: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: found {len(found)} among {[(o['kind'], o['metadata']['name']) for o in objects]}"
    return found[0]


def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def name(component: str, release: str = RELEASE) -> str:
    return f"{release}-pdserve-{component}"


def pod_spec(workload: Obj) -> Obj:
    return workload["spec"]["template"]["spec"]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# -- validation ------------------------------------------------------------------------


def validate(obj: Obj, version: str = K8S_LATEST) -> None:
    """Raise jsonschema.ValidationError (or SchemaNotFoundError) unless `obj` is valid."""
    if obj["apiVersion"].startswith("monitoring.coreos.com/"):
        validate_custom_resource(obj, version)
    else:
        builtin_validator(obj["kind"], obj["apiVersion"], version).validate(obj)


@functools.cache
def builtin_validator(kind: str, api_version: str, version: str) -> jsonschema.Draft202012Validator:
    """kubernetes-validate's strict schema of `kind` at `api_version` for Kubernetes
    `version`, as its `validate(obj, version, strict=True)` builds it, but once: it reads
    the definitions (megabytes of JSON) again on every call."""
    major_minor = ".".join(version.split(".")[:2])
    schema_version = [v for v in kubernetes_validate.utils.all_versions()
                      if kubernetes_validate.utils.major_minor(v) <= major_minor][-1]
    folder = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{schema_version}-local-strict"
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)  # rbac.authorization.k8s.io/v1 -> rbac-v1
    path = folder / f"{kind.lower()}-{group_version}.json"
    if not path.is_file():
        raise kubernetes_validate.SchemaNotFoundError(version=major_minor, kind=kind, api_version=api_version)
    schema = json.loads(path.read_text())
    registry = Resource.from_contents(json.loads((folder / "_definitions.json").read_text())) @ (
        Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate_custom_resource(obj: Obj, version: str = K8S_LATEST) -> None:
    group_version = obj["apiVersion"]
    crd_validator(obj["kind"], group_version).validate(obj)
    object_meta_validator(version).validate(obj["metadata"])


@functools.cache
def crd_validator(kind: str, api_version: str) -> jsonschema.Draft7Validator:
    """The served schema of `kind` at `api_version` from the vendored CRDs, strict."""
    group, version = api_version.split("/")
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["group"] != group or crd["spec"]["names"]["kind"] != kind:
            continue
        for served in crd["spec"]["versions"]:
            if served["name"] == version and served["served"]:
                return jsonschema.Draft7Validator(strict_schema(served["schema"]["openAPIV3Schema"]))
    raise LookupError(f"no vendored CRD serves {kind} {api_version} (tests/data/crds)")


def strict_schema(schema: Any) -> Any:
    """A copy where every object with known properties rejects unknown ones, as the
    API server's strict field validation does (a structural schema would prune them
    silently), unless the schema keeps unknown fields on purpose."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
            return
        if not isinstance(node, dict):
            return
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        for key in ("properties", "patternProperties"):
            for child in node.get(key, {}).values():
                walk(child)
        for key in ("items", "additionalProperties", "not"):
            walk(node.get(key))
        for key in ("allOf", "anyOf", "oneOf"):
            walk(node.get(key, []))

    walk(schema)
    return schema


@functools.cache
def object_meta_validator(version: str) -> jsonschema.Draft202012Validator:
    """ObjectMeta from kubernetes-validate's definitions (CRD schemas leave metadata open)."""
    major_minor = ".".join(version.split(".")[:2])
    folder = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    (strict,) = [d for d in folder.iterdir() if d.name.startswith(f"v{major_minor}.") and d.name.endswith("-local-strict")]
    definitions = json.loads((strict / "_definitions.json").read_text())
    registry = Resource.from_contents(definitions) @ Registry()
    schema = {"$ref": f"{definitions['$id']}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
    return jsonschema.Draft202012Validator(schema, registry=registry)
