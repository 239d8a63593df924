"""Derive the JSON Schemas tests/test_k8s.py validates manifests against from CRD files.

    python tests/kubernetes_schemas/derive.py TRAINJOBS_CRD.yaml PYTORCHJOBS_CRD.yaml

writes trainjob.v1alpha1.json and pytorchjob.v1.json beside this file (README.md says which
CRDs). From each CRD's openAPIV3Schema: descriptions dropped; an object with properties and no
x-kubernetes-preserve-unknown-fields refuses unknown fields (as `kubectl apply`'s strict field
validation does); the CEL rules an API server checks on create become JSON Schema where they
can (RULES below); a rule not in RULES stops the script, so a new CRD needs a decision.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
DNS_1035 = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
MANAGERS = ["trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue"]
URI_RULE = "self == '' || self.matches('^[A-Za-z][A-Za-z0-9+.-]*://.+$')"
# create-time CEL rules (path in the schema, rule) → the JSON Schema keywords that say the same
RULES = {
    ("", f"self.metadata.name.matches('{DNS_1035}')"): {
        "properties": {"metadata": {"properties": {"name": {"pattern": DNS_1035}}}}
    },
    ("", "size(self.metadata.name) <= 63"): {
        "properties": {"metadata": {"properties": {"name": {"maxLength": 63}}}}
    },
    ("/spec/trainer/numProcPerNode", "self >= 1"): {"minimum": 1},
    ("/spec/managedBy", f"self in {MANAGERS}"): {"enum": MANAGERS},
    # fields dplaunch never writes: left to the API server
    ("/spec/initializer/dataset/storageUri", URI_RULE): {},
    ("/spec/initializer/model/storageUri", URI_RULE): {},
    ("/status/trainerStatus", "has(self.lastUpdatedTime)"): {},
}


def convert(node: object, path: str) -> object:
    """The JSON Schema of one openAPIV3Schema node."""
    if isinstance(node, list):
        return [convert(item, path) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict = {}
    for key, value in node.items():
        if key == "description" or key.startswith("x-kubernetes"):
            continue
        if key == "properties":
            out[key] = {name: convert(sub, f"{path}/{name}") for name, sub in value.items()}
        else:
            out[key] = convert(value, path)
    if out.get("type") == "object" and "properties" in out:
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
    for rule in node.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            continue  # an update's rule (immutability): nothing to check on create
        if (path, rule["rule"]) not in RULES:
            raise SystemExit(f"{path or '/'}: no translation for the CEL rule {rule['rule']!r}")
        merge(out, RULES[(path, rule["rule"])])
    return out


def merge(into: dict, extra: dict) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value


def derive(crd_path: str, out_name: str) -> None:
    crd = yaml.safe_load(Path(crd_path).read_text())
    (version,) = crd["spec"]["versions"]
    schema = convert(version["schema"]["openAPIV3Schema"], "")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    text = json.dumps(schema, separators=(",", ":"), sort_keys=True) + "\n"
    (HERE / out_name).write_text(text)
    print(f"{out_name}: {crd['spec']['group']}/{version['name']} {crd['spec']['names']['kind']}")


if __name__ == "__main__":
    derive(sys.argv[1], "trainjob.v1alpha1.json")
    derive(sys.argv[2], "pytorchjob.v1.json")
