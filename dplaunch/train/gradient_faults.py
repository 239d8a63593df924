"""TEST ONLY: the rank side of `dplaunch verify --inject-fault`, which proves verify's FAIL path.

A fault run's ranks start through this module instead of dplaunch.train: it hooks DDP's gradient
all-reduce as Accelerate wraps the model ("no-grad-average": every rank keeps its own gradient;
"summed-gradients": a sum, never divided), then trains as dplaunch.train does. Nothing here runs
in a real run; the training loop knows nothing of it.
"""

from __future__ import annotations

import sys
from typing import Any

GRADIENT_FAULTS = ("no-grad-average", "summed-gradients")


def install_gradient_fault(fault: str) -> None:
    """Hook DDP's gradient all-reduce as soon as Accelerate wraps the model."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.nn.parallel import DistributedDataParallel

    # no annotations on the hooks: DDP checks them against dist.GradBucket, and this module's
    # annotations are strings (from __future__ import annotations)
    def local_gradient(_state, bucket):  # noqa: ANN001
        future = torch.futures.Future()
        future.set_result(bucket.buffer())  # no all-reduce: every rank keeps its own gradient
        return future

    def summed_gradient(_state, bucket):  # noqa: ANN001
        work = dist.all_reduce(bucket.buffer(), async_op=True)  # a sum, never divided
        return work.get_future().then(lambda done: done.value()[0])

    hook = local_gradient if fault == "no-grad-average" else summed_gradient
    original = Accelerator.prepare_model

    def prepare_model(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        model = original(self, model, *args, **kwargs)
        if isinstance(model, DistributedDataParallel):
            model.register_comm_hook(None, hook)
        else:
            raise RuntimeError(f"--inject-fault {fault}: the model is not wrapped in DDP")
        return model

    Accelerator.prepare_model = prepare_model


def _rank_main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "--inject-fault" or argv[1] not in GRADIENT_FAULTS:
        print(
            "usage: python -m dplaunch.train.gradient_faults --inject-fault FAULT RUN_DIR",
            file=sys.stderr,
        )
        return 2
    install_gradient_fault(argv[1])
    from dplaunch.train.__main__ import main

    return main([argv[2]])


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1:]))
