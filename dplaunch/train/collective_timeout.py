"""launch.timeout_minutes as the timeout of every process group a rank builds, whoever builds it.

torch gives a group made without a timeout its own default (30 min for gloo, 10 for NCCL), and
that is how the libraries make theirs (torch 2.13, DeepSpeed 0.19.8, Accelerate 1.15):
DeepSpeed's data-, tensor-, pipeline- and sequence-parallel groups (``deepspeed.utils.groups``,
``runtime/pipe/topology.py``: ``dist.new_group(ranks)``), DeviceMesh's dimension groups (FSDP2's
mesh, its TP mesh), dplaunch's Ulysses groups. Accelerate hands ``InitProcessGroupKwargs``'
timeout to the world group only (to ``deepspeed.comm.init_distributed`` under DeepSpeed). So a
rank frozen under ZeRO-2 kept the others waiting 30 minutes in the data-parallel group's
all-reduce, where DDP's world group timed out at launch.timeout_minutes.

The rank therefore sets torch's default itself, before any group exists: torch reads it
(``distributed_c10d.default_pg_timeout``, ``_get_default_timeout``) each time a group is made
without a timeout, so every later group, made by any library and on any backend, carries it.
``group_timeouts_s`` reads back what the groups hold (the metrics header records it).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta


def use_collective_timeout(minutes: float) -> timedelta:
    """Make MINUTES the timeout of every process group this rank builds from now on; returns it."""
    import torch.distributed.distributed_c10d as c10d

    timeout = timedelta(minutes=minutes)
    c10d.default_pg_timeout = timeout
    if c10d.default_pg_nccl_timeout is not None:  # None: torch built without NCCL
        c10d.default_pg_nccl_timeout = timeout
    return timeout


def collective_timeout() -> timedelta:
    """The timeout this rank's new process groups get (for a library that wants it spelled out)."""
    import torch.distributed.distributed_c10d as c10d

    return c10d.default_pg_timeout


def group_timeouts_s() -> list[float]:
    """The distinct timeouts, in seconds, that the process groups this rank belongs to hold, as
    their backends (gloo, NCCL, one per device type) will apply them."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if not (dist.is_available() and dist.is_initialized()):
        return []
    found: set[float] = set()
    for group, devices in list(c10d._world.pg_backend_config.items()):
        for device in {entry.split(":")[0] for entry in devices.split(",")}:
            # a device type the group names but this build lacks (cuda:gloo on a CPU torch)
            with contextlib.suppress(RuntimeError, ValueError):
                options = getattr(group._get_backend(torch.device(device)), "options", None)
                timeout = getattr(options, "_timeout", None)
                if timeout is not None:
                    found.add(round(timeout.total_seconds(), 3))
    return sorted(found)
