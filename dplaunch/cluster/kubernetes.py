"""Applying a job's manifests with the `kubernetes` Python client (the [kubernetes] extra).

The only side effect of `dplaunch k8s`: the ConfigMap of the run file is created or replaced,
then the TrainJob (or PyTorchJob) is created. Every refusal of the client or the API server is
one UserError naming --submit.
"""

from __future__ import annotations

from typing import Any

from dplaunch.errors import UserError

# group, version and plural of each kind dplaunch writes, as the API server serves them
CUSTOM_RESOURCES = {
    "TrainJob": ("trainer.kubeflow.org", "v1alpha1", "trainjobs"),
    "PyTorchJob": ("kubeflow.org", "v1", "pytorchjobs"),
}


def apply_manifests(documents: list[dict[str, Any]]) -> str:
    """Create the ConfigMaps (replacing older ones of the same name) and the job; 'KIND NAME'."""
    client = _client()
    core, custom = client.CoreV1Api(), client.CustomObjectsApi()
    created = ""
    for body in documents:
        kind, name = body["kind"], body["metadata"]["name"]
        namespace = body["metadata"]["namespace"]
        if kind == "ConfigMap":
            try:
                _call(core.create_namespaced_config_map, namespace, body)
            except _Conflict:
                _call(core.replace_namespaced_config_map, name, namespace, body)
            continue
        group, version, plural = CUSTOM_RESOURCES[kind]
        try:
            _call(custom.create_namespaced_custom_object, group, version, namespace, plural, body)
        except _Conflict:
            raise UserError(
                "--submit",
                f"{kind} {name} already exists in namespace {namespace}",
                f"delete it first (kubectl -n {namespace} delete {plural} {name}) "
                "or give another --job-name",
            ) from None
        created = f"{kind} {name}"
    return created


class _Conflict(Exception):
    """The object exists already (HTTP 409)."""


def _client() -> Any:
    """The client module with this user's kubeconfig (or the pod's service account) loaded."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise UserError(
            "--submit",
            "the kubernetes Python client is not installed",
            "pip install 'dplaunch[kubernetes]', or apply the file with kubectl",
        ) from None
    try:
        config.load_kube_config()
    except Exception:  # noqa: BLE001 — the client raises several kinds for a missing config
        try:
            config.load_incluster_config()
        except Exception:  # noqa: BLE001
            raise UserError(
                "--submit",
                "no Kubernetes cluster configured here (no kubeconfig, not in a pod)",
                "set KUBECONFIG or run `kubectl config use-context CONTEXT`, or apply the file "
                "with kubectl",
            ) from None
    return client


def _call(method: Any, *args: Any) -> Any:
    # the API server's refusal as one line; a 409 is the caller's to handle
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        return method(*args)
    except ApiException as error:
        if error.status == 409:
            raise _Conflict() from None
        raise UserError(
            "--submit",
            f"the API server refused it: {error.status} {error.reason}: {_message(error)}",
            "fix what it names and run this command again, or apply the written file yourself",
        ) from None
    except (OSError, HTTPError) as error:  # the connection's, not the server's
        raise UserError(
            "--submit",
            f"cannot reach the API server ({error})",
            "check the cluster's address in your kubeconfig and your network",
        ) from None


def _message(error: Any) -> str:
    import json

    try:
        return str(json.loads(error.body).get("message", "")).splitlines()[0]
    except (TypeError, ValueError, AttributeError, IndexError):
        return ""
