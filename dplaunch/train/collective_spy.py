"""A record of every collective one training step issues: what the forecast's traffic is checked
against (tests/test_forecast_collectives.py) and what the forecast benchmark reads.

With DPLAUNCH_COLLECTIVE_SPY=FOLDER in the ranks' environment, each rank watches one optimizer
step (DPLAUNCH_COLLECTIVE_SPY_STEP, 1-based, default 3: the first two steps set engines up) and writes
FOLDER/rank-R.json, one entry per collective in the order issued:
``{"op": "all_reduce", "bytes": 4096, "ranks": [0, 1]}``.

The spy is a TorchDispatchMode: every collective reaches the dispatcher as a ``c10d`` op (the
``torch.distributed`` functions, DDP's C++ reducer, DeepSpeed and FSDP2 alike) or a
``_c10d_functional`` op (DTensor), whatever library issued it. ``bytes`` counts the payload the
way nccl-tests sizes a collective: the whole buffer of an all-reduce or broadcast, the gathered
output of an all-gather, the input of a reduce-scatter or all-to-all, the tensor of a send.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dplaunch.run_directory.environment import COLLECTIVE_SPY_ENV, COLLECTIVE_SPY_STEP_ENV

# dispatcher op name (without namespace and overload) → (collective, how its bytes are counted)
_OPS = {
    "allreduce_": ("all_reduce", "inputs"),
    "allreduce_coalesced_": ("all_reduce", "inputs"),
    "all_reduce": ("all_reduce", "inputs"),
    "all_reduce_coalesced": ("all_reduce", "inputs"),
    "allgather_": ("all_gather", "outputs"),
    "_allgather_base_": ("all_gather", "outputs"),
    "allgather_coalesced_": ("all_gather", "outputs"),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
    "all_gather_into_tensor": ("all_gather", "result"),
    "all_gather_into_tensor_coalesced": ("all_gather", "result"),
    "reduce_scatter_": ("reduce_scatter", "inputs"),
    "_reduce_scatter_base_": ("reduce_scatter", "inputs"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "reduce_scatter_tensor": ("reduce_scatter", "inputs"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs"),
    "alltoall_base_": ("all_to_all", "inputs"),
    "alltoall_": ("all_to_all", "inputs"),
    "all_to_all_single": ("all_to_all", "inputs"),
    "broadcast_": ("broadcast", "inputs"),
    "broadcast": ("broadcast", "inputs"),
    "reduce_": ("reduce", "inputs"),
    "send": ("send", "inputs"),
    "recv_": ("recv", "inputs"),
    "gather_": ("gather", "inputs"),
    "scatter_": ("scatter", "outputs"),
    "barrier": ("barrier", "none"),
}
# a library's own collective op, by a word of its name (its first argument is the payload)
_WORDS = {"all_to_all": "all_to_all", "all_gather": "all_gather", "all_reduce": "all_reduce"}


def _tensors(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _bytes(tensors: list[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _group_ranks(args: tuple, kwargs: dict) -> list[int] | None:
    """The global ranks of the op's process group (a ProcessGroup argument, or a functional
    collective's group name)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    for value in (*args, *kwargs.values()):
        group = None
        if isinstance(value, dist.ProcessGroup):
            group = value
        elif isinstance(value, torch.ScriptObject):
            # the dispatcher hands a c10d op its group boxed (ReduceOp is boxed too)
            with contextlib.suppress(Exception):
                group = dist.ProcessGroup.unbox(value)
        elif isinstance(value, str):
            with contextlib.suppress(Exception):
                group = distributed_c10d._resolve_process_group(value)
        if group is not None:
            with contextlib.suppress(Exception):
                return sorted(dist.get_process_group_ranks(group))
            return list(range(group.size()))
    return None


class CollectiveSpy:
    """Records the collectives issued while it is active (``watch``)."""

    def __init__(self, folder: Path, rank: int, step: int):
        self.folder = folder
        self.rank = rank
        self.step = step
        self.records: list[dict[str, Any]] = []

    def record(self, func: Any, args: tuple, kwargs: dict, result: Any) -> None:
        namespace = getattr(func, "namespace", "")
        name = func._schema.name.split("::")[-1]
        if namespace not in ("c10d", "_c10d_functional"):
            # a library's own collective op (DeepSpeed's Ulysses exchange is
            # deepspeed::dim_zero_all_to_all): the mode sees it, not the c10d op inside it
            if namespace in ("aten", "prims") or not any(word in name for word in _WORDS):
                return
            ranks = _group_ranks(args, kwargs)
            if ranks is None:  # no process group named: a local op (FSDP2's all_gather_copy_in)
                return
            op = next(op for word, op in _WORDS.items() if word in name)
            self.records.append({"op": op, "bytes": _bytes(_tensors(args[0])), "ranks": ranks})
            return
        known = _OPS.get(name)
        if known is None:  # wait_tensor, _wrap_tensor_autograd: bookkeeping, no traffic
            return
        op, counted = known
        # c10d ops take (outputs, inputs) for gathers, scatters and all-to-all, (tensors) for the
        # rest; a functional collective takes its input first and returns its output
        first_input = namespace == "_c10d_functional" or op not in ("reduce_scatter", "all_to_all")
        if counted == "inputs":
            tensors = _tensors(args[0] if first_input else args[1])
        elif counted == "outputs":
            tensors = _tensors(args[0])
        elif counted == "result":
            tensors = _tensors(result)
        else:
            tensors = []
        ranks = _group_ranks(args, kwargs)
        if op in ("send", "recv") and ranks is not None:
            # a point-to-point op names its peer by its rank in the group: the pair is its group
            ranks = sorted({dist_rank(), ranks[int(args[2])]})
        self.records.append({"op": op, "bytes": _bytes(tensors), "ranks": ranks})

    @contextlib.contextmanager
    def watch(self, step: int) -> Iterator[None]:
        """Record the collectives of STEP (1-based) when it is the one watched; write them after."""
        if step != self.step:
            yield
            return
        from torch.distributed.tensor import DTensor
        from torch.utils._python_dispatch import TorchDispatchMode

        spy = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if DTensor in types:
                    # let DTensor desugar its op first: the collectives it issues (FSDP2's
                    # gradient norm, tensor parallelism) come back through this mode
                    return NotImplemented
                kwargs = kwargs or {}
                result = func(*args, **kwargs)
                spy.record(func, args, kwargs, result)
                return result

        with Mode():
            yield
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank-{self.rank}.json"
        path.write_text(json.dumps({"step": step, "collectives": self.records}) + "\n")


def spy_from_environment(rank: int) -> CollectiveSpy | None:
    """The spy DPLAUNCH_COLLECTIVE_SPY asks for, or None (no spy: the ordinary case)."""
    folder = os.environ.get(COLLECTIVE_SPY_ENV)
    if not folder:
        return None
    return CollectiveSpy(Path(folder), rank, int(os.environ.get(COLLECTIVE_SPY_STEP_ENV, "3")))


@contextlib.contextmanager
def watched(spy: CollectiveSpy | None, step: int) -> Iterator[None]:
    """``spy.watch(step)``, or nothing without a spy."""
    if spy is None:
        yield
        return
    with spy.watch(step):
        yield
