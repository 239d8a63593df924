"""`dplaunch k8s`: plan → a Kubeflow Trainer TrainJob (or a legacy PyTorchJob) → optionally apply it.

Every pod runs `dplaunch train RUN_FILE <the same flags> --output-dir /runs/NAME --resume auto`.
Inside it, `dplaunch train` reads the pod's PET_* variables (nodes, its node rank, the head pod,
the port, processes per pod) as it reads a SLURM allocation (cluster/environments.py), so the
batch maths and checkpoints are those `dplaunch train` prints here.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from dplaunch.commands.options import command
from dplaunch.config.flags import RunFlags
from dplaunch.errors import UserError
from dplaunch.run_directory.environment import JOB_ID_ENV
from dplaunch.run_directory.layout import PYTORCHJOB_FILE, RUN_FILE, TRAINJOB_FILE

if TYPE_CHECKING:
    from dplaunch.rendering.kubernetes import PodJob

_JOB = "Kubernetes job"
# PodJob fields → the flag a user would change
POD_JOB_FLAGS = {
    "name": "--job-name",
    "namespace": "--namespace",
    "image": "--image",
    "pvc": "--pvc",
}


@dataclass
class K8sOptions:
    """The `dplaunch k8s` options that are not run flags, each one typer option."""

    image: Annotated[
        str | None,
        typer.Option(
            "--image",
            help="Container image with dplaunch installed (and the run's data, or a PVC).",
            rich_help_panel=_JOB,
        ),
    ] = None
    namespace: Annotated[
        str, typer.Option("--namespace", help="Kubernetes namespace.", rich_help_panel=_JOB)
    ] = "default"
    pvc: Annotated[
        str | None,
        typer.Option(
            "--pvc",
            help="PersistentVolumeClaim (ReadWriteMany) every pod mounts at /runs for the run "
            "directory; needed for more than one node.",
            rich_help_panel=_JOB,
        ),
    ] = None
    kind: Annotated[
        Literal["trainjob", "pytorchjob"],
        typer.Option(
            "--kind",
            help="trainjob: Kubeflow Trainer v2 (trainer.kubeflow.org); pytorchjob: the v1 "
            "training-operator's PyTorchJob (kubeflow.org/v1).",
            rich_help_panel=_JOB,
        ),
    ] = "trainjob"
    job_name: Annotated[
        str | None,
        typer.Option(
            "--job-name",
            help="The job's name, a DNS label (default: the run's name).",
            rich_help_panel=_JOB,
        ),
    ] = None
    out: Annotated[
        str | None,
        typer.Option(
            "--out",
            help=f"Where to write the manifests (default RUN/{TRAINJOB_FILE}; '-' = stdout).",
        ),
    ] = None
    submit: Annotated[
        bool,
        typer.Option(
            "--submit",
            help="Apply them with the kubernetes Python client (pip install 'dplaunch[kubernetes]') "
            "and print how to follow the pods.",
        ),
    ] = False


@command()
def k8s_command(flags: RunFlags, options: K8sOptions) -> int:
    """Write a Kubeflow TrainJob that trains with this plan on Kubernetes pods (one per node)."""
    return run_k8s(flags, options)


def run_k8s(flags: RunFlags, options: K8sOptions) -> int:
    """Plan the run for the pods, write the job's manifests, and apply them with --submit."""
    from dplaunch.commands.slurm import _say, refuse_flags_the_job_decides, train_command
    from dplaunch.config.load import load_run_config
    from dplaunch.launching.prepare import prepare_training_run
    from dplaunch.launching.rundir import check_output_file
    from dplaunch.rendering.kubernetes import RUNS_FOLDER
    from dplaunch.run_directory.files import write_text_atomic

    refuse_flags_the_job_decides(
        flags, "the pods' runtime", "(PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT)"
    )
    if options.submit and options.out == "-":
        raise UserError("--submit", "cannot apply manifests printed to stdout", "give --out FILE")
    config = load_run_config(
        flags.config, overrides=flags.overrides(), assignments=flags.assignments
    )
    nodes, per_node = _pod_shape(config.launch)
    name = _job_name(options.job_name, config.name)
    pod = _pod_job(options, name, nodes, per_node, config.launch.cpu, flags)
    plan_flags = dataclasses.replace(
        flags, gpus=nodes * per_node, gpus_per_node=per_node, nodes=None
    )
    # the same validation `dplaunch train` does, for the pods' layout rather than this machine's
    prepared = prepare_training_run(plan_flags, render_only=True, use_allocation=False)
    in_pod = dataclasses.replace(
        plan_flags,
        config=pod.run_file_path if flags.config is not None else None,
        output_dir=f"{RUNS_FOLDER}/{name}",
    )
    # the console script the image's dplaunch installs, then `train RUN_FILE <flags> …`
    pod = dataclasses.replace(pod, command=["dplaunch", *train_command(in_pod)[3:]])
    documents, text = _manifests(pod, options.kind, prepared)
    kind = documents[-1]["kind"]
    file_name = TRAINJOB_FILE if options.kind == "trainjob" else PYTORCHJOB_FILE
    path = None if options.out == "-" else Path(options.out or prepared.run_dir / file_name)
    if path is not None:
        check_output_file(path, "--out" if options.out else "output_dir", file_name)
    say = _say(to_stderr=path is None)  # the manifests alone on stdout with --out -
    for line in pod_summary_lines(prepared.plan):
        say(line)
    if pod.pvc is None:
        say(
            f"note: no --pvc: the run directory {RUNS_FOLDER}/{name} is the pod's own disk and "
            "goes with it (checkpoints included)"
        )
    if path is None:
        sys.stdout.write(text)
        return 0
    write_text_atomic(path, text)
    say(f"{kind}: {path}")
    if not options.submit:
        say(f"apply with: kubectl apply -f {shlex.quote(str(path))}")
        return 0
    _apply(pod, documents, say)
    return 0


def pod_summary_lines(plan: Any) -> list[str]:
    """The plan as the pods will run it: their runtime decides the rendezvous, not this machine."""
    lines = [
        line
        for line in plan.summary_lines()
        if not line.startswith("node rank ") and "rendezvous at 127.0.0.1" not in line
    ]
    if plan.num_nodes > 1:
        lines.append("rendezvous: the first pod (PET_MASTER_ADDR, PET_MASTER_PORT)")
    return lines


def _pod_shape(launch: Any) -> tuple[int, int]:
    """(pods, ranks per pod) from --gpus and --nodes (or --gpus-per-node), as the plan splits them."""
    from dplaunch.planning.plan import _nodes

    if launch.gpus is None:
        raise UserError("--gpus", "dplaunch k8s needs the total GPU count", "pass --gpus N")
    return _nodes(launch, launch.gpus)


def _job_name(given: str | None, run_name: str | None) -> str:
    """The job's name: --job-name as given, else the run's name made a DNS label."""
    import re

    from dplaunch.rendering.kubernetes import DNS_1035_LABEL

    if given is not None:
        if not DNS_1035_LABEL.fullmatch(given):
            raise UserError(
                "--job-name",
                f"{given!r} is not a DNS label (RFC 1035): its pods and service are named after it",
                "use lowercase letters, digits and '-', starting with a letter (63 at most)",
            )
        return given
    name = re.sub(r"[^a-z0-9-]+", "-", (run_name or "dplaunch").lower()).strip("-")
    if not name or not name[0].isalpha():
        name = f"dplaunch-{name}".rstrip("-")
    return name[:63].rstrip("-")


def _pod_job(
    options: K8sOptions, name: str, nodes: int, per_node: int, cpu: bool, flags: RunFlags
) -> PodJob:
    """The job's pods before their command is known; UserError naming the flag of a value the
    API server would refuse, or of a layout that cannot work."""
    from dplaunch.rendering.kubernetes import PodJob, check_pod_job

    if options.image is None:
        raise UserError(
            "--image", "the pods need an image", "give --image REGISTRY/IMAGE:TAG (with dplaunch)"
        )
    if nodes > 1 and options.pvc is None:
        raise UserError(
            "--pvc",
            f"{nodes} pods must share one run directory (checkpoints, metrics, the restart "
            "agreement), and without a volume each pod has its own",
            "give a ReadWriteMany PersistentVolumeClaim: --pvc NAME",
        )
    run_file = Path(flags.config).read_text() if flags.config is not None else None
    pod = PodJob(
        name=name,
        namespace=options.namespace,
        image=options.image,
        command=[],
        num_nodes=nodes,
        procs_per_node=per_node,
        cpu=cpu,
        env={
            # dplaunch's own lines reach the pods' logs in order with the ranks' output
            "PYTHONUNBUFFERED": "1",
            # the job every pod (and a pod started again) belongs to: they share the run
            # directory's lock (launching/rundir.py job_identity)
            JOB_ID_ENV: f"{options.kind}/{options.namespace}/{name}",
        },
        run_file=run_file,
        run_file_name=Path(flags.config).name if flags.config is not None else RUN_FILE,
        pvc=options.pvc,
        labels={"app.kubernetes.io/managed-by": "dplaunch"},
    )
    try:
        check_pod_job(pod)
    except ValueError as error:
        field, _, problem = str(error).partition(": ")
        raise UserError(POD_JOB_FLAGS.get(field, field), problem, _fix(field)) from None
    return pod


def _fix(field: str) -> str:
    return {
        "image": "give an image reference such as ghcr.io/me/train:1.0 or registry:5000/train@sha256:…",
        "namespace": "use lowercase letters, digits and '-' (63 at most), e.g. --namespace team-a",
        "name": "give --job-name with lowercase letters, digits and '-', starting with a letter",
        "pvc": "give the claim's name as `kubectl get pvc` shows it",
    }.get(field, "change that value")


def _manifests(pod: PodJob, kind: str, prepared: Any) -> tuple[list[dict[str, Any]], str]:
    """The manifests (the job last) and their text."""
    from dplaunch.commands.slurm import comment_join
    from dplaunch.rendering.kubernetes import (
        render_configmap,
        render_manifests,
        render_pytorchjob,
        render_trainjob,
    )

    documents = [render_configmap(pod)] if pod.run_file is not None else []
    job = render_trainjob(pod) if kind == "trainjob" else render_pytorchjob(pod)
    documents.append(job)
    comments = [
        "generated by dplaunch; regenerate it rather than edit it:",
        "  dplaunch " + comment_join(sys.argv[1:]),
        *(
            f"  {line}"
            for line in pod_summary_lines(prepared.plan)
            if not line.startswith("note: ")
        ),
    ]
    return documents, render_manifests(documents, comments)


def _apply(pod: PodJob, documents: list[dict[str, Any]], say: Any) -> None:
    """Create the ConfigMap and the job with the kubernetes client; how to follow the pods."""
    from dplaunch.cluster.kubernetes import apply_manifests
    from dplaunch.rendering.kubernetes import follow_commands

    created = apply_manifests(documents)
    say(f"created {created} in namespace {pod.namespace}; follow it with:")
    for line in follow_commands(pod, documents[-1]["kind"]):
        say(f"  {line}")
