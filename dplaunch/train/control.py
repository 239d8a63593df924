"""Small collective decisions of the ranks (stop now? did the save work?), off the engine's way."""

from __future__ import annotations


class ControlChannel:
    """Small collective decisions (stop now? did the save work?) on a CPU gloo group of all ranks.

    A separate group keeps these few-byte all-reduces off the GPU (no device sync) and never
    interleaves them with the engine's own collectives.
    """

    def __init__(self, timeout_minutes: float):
        import torch.distributed as dist

        self.dist = dist
        self.group = None
        self.enabled = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if self.enabled:
            from datetime import timedelta

            self.group = dist.new_group(backend="gloo", timeout=timedelta(minutes=timeout_minutes))

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on at least one."""
        if not self.enabled:
            return flag
        import torch

        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        self.dist.all_reduce(value, op=self.dist.ReduceOp.MAX, group=self.group)
        return bool(value.item())

    def barrier(self) -> None:
        if self.enabled:
            self.dist.barrier(group=self.group)
