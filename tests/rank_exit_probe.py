"""A user script for `dplaunch launch`: leaves gloo collectives in flight when it returns.

Started directly by `accelerate launch`, at least one of its two ranks aborts in the
interpreter's teardown nearly every time ("terminate called without an active exception");
dplaunch's rank entry must end both ranks with status 0. It also reports what `python SCRIPT`
would have given it (argv, __name__, sys.path[0]).
"""

import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator


def main() -> None:
    accelerator = Accelerator()
    for _ in range(200):
        dist.all_reduce(torch.ones(100_000), async_op=True)  # never waited for
    report = {
        "rank": accelerator.process_index,
        "argv": sys.argv,
        "name": __name__,
        "path0": sys.path[0],
    }
    print("PROBE", json.dumps(report))


if __name__ == "__main__":
    main()
