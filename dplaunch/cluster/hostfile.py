"""DeepSpeed hostfiles ("worker-1 slots=4"): every node launched from one command over pdsh/ssh.

Pure except `read_hostfile`, which reads the file. The format is DeepSpeed's own (its runner
parses the same file): one `host slots=N` per line, `#` comments and blank lines ignored.
"""

from __future__ import annotations

import re
from pathlib import Path

from dplaunch.config.schema import LaunchConfig
from dplaunch.errors import UserError

# the runner's own pattern (deepspeed/launcher/runner.py: _parse_hostfile)
_LINE_RE = re.compile(r"^(\S+)\s+slots=(\d+)")
LOCAL_NAMES = ("localhost", "127.0.0.1")


def parse_hostfile(text: str, source: str = "hostfile") -> list[tuple[str, int]]:
    """(host, slots) per line, in file order; UserError for what DeepSpeed would refuse."""
    hosts: list[tuple[str, int]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE_RE.match(line)
        if not match:
            raise UserError(
                "launch.hostfile",
                f"{source} line {number} is not 'host slots=N': {line!r}",
                "write one 'hostname slots=GPUS' per line",
            )
        host, slots = match.group(1), int(match.group(2))
        if any(host == seen for seen, _ in hosts):
            raise UserError(
                "launch.hostfile", f"{source} lists {host} twice", "list every host once"
            )
        if slots < 1:
            raise UserError(
                "launch.hostfile", f"{source}: {host} has slots=0", "give every host slots ≥ 1"
            )
        hosts.append((host, slots))
    if not hosts:
        raise UserError("launch.hostfile", f"{source} lists no host", "add 'hostname slots=GPUS'")
    return hosts


def read_hostfile(path: str | Path) -> list[tuple[str, int]]:
    """Read and parse a hostfile; a missing file is a UserError (DeepSpeed would only warn)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise UserError(
            "launch.hostfile",
            f"cannot read {path} ({error.strerror or error})",
            "give the path of a DeepSpeed hostfile ('host slots=N' lines)",
        ) from None
    return parse_hostfile(text, str(path))


def is_local(host: str, own_names: tuple[str, ...] = ()) -> bool:
    """True for names of this machine: localhost, 127.0.0.1, or one of `own_names`."""
    return host in LOCAL_NAMES or host in own_names


def launch_for_hostfile(
    launch: LaunchConfig, hosts: list[tuple[str, int]], own_names: tuple[str, ...] = ()
) -> tuple[LaunchConfig, list[str]]:
    """The launch section for a hostfile: nodes, GPUs per node and head node come from it."""
    given = launch.model_fields_set
    if "nodes" in given and launch.nodes != len(hosts):
        raise UserError(
            "launch.nodes",
            f"{launch.nodes} node(s) planned but the hostfile lists {len(hosts)}",
            "drop --nodes with --hostfile (the hostfile decides)",
        )
    if launch.node_rank != 0:
        raise UserError(
            "launch.node_rank",
            "--node-rank with --hostfile: one command starts every node",
            "drop --node-rank, or drop --hostfile and start one dplaunch per node",
        )
    slots = {count for _, count in hosts}
    if len(slots) > 1:
        listed = ", ".join(f"{host}:{count}" for host, count in hosts)
        raise UserError(
            "launch.hostfile",
            f"hosts have different slot counts ({listed})",
            "give every host the same slots=N: dplaunch plans the same number of ranks per node",
        )
    per_node = slots.pop()
    if launch.gpus_per_node is not None and launch.gpus_per_node != per_node:
        raise UserError(
            "launch.gpus_per_node",
            f"{launch.gpus_per_node} planned but the hostfile gives slots={per_node}",
            "drop --gpus-per-node with --hostfile, or change the slots",
        )
    total = per_node * len(hosts)
    if launch.gpus is not None and launch.gpus != total:
        raise UserError(
            "launch.gpus",
            f"{launch.gpus} requested but the hostfile holds {total} "
            f"({len(hosts)} host(s) × {per_node} slots)",
            f"use --gpus {total} or change the hostfile",
        )
    head = hosts[0][0]
    if len(hosts) == 1 and not is_local(head, own_names):
        # DeepSpeed's runner starts a one-host hostfile on *this* machine, whatever the name says
        raise UserError(
            "launch.hostfile",
            f"its only host {head} is not this machine, and DeepSpeed's runner would start "
            "the ranks here",
            f"run dplaunch on {head}, or list every node in the hostfile",
        )
    update: dict[str, object] = {"nodes": len(hosts), "gpus_per_node": per_node, "gpus": total}
    if "master_addr" not in given:
        update["master_addr"] = "127.0.0.1" if is_local(head, own_names) else head
    resolved = launch.model_copy(update=update)
    names = ", ".join(host for host, _ in hosts)
    notes = [
        f"hostfile: {len(hosts)} node(s) × {per_node} ({names}), launched by DeepSpeed's runner"
        + (" over pdsh/ssh" if len(hosts) > 1 else " on this machine (no ssh for one host)")
    ]
    return resolved, notes
