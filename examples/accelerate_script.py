"""An unmodified Accelerate script: `dplaunch launch examples/accelerate_script.py --gpus 2`.

It trains a tiny regression for a few steps and reports the world it saw, so a test can check
that dplaunch really started a 2-rank job (on CPU too, where Accelerate needs ACCELERATE_USE_CPU).
"""

import json
import sys

import torch
from accelerate import Accelerator


def main() -> None:
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for inputs, targets in loader:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    total = accelerator.reduce(torch.ones(1, device=accelerator.device), reduction="sum")
    report = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "ranks_counted_by_all_reduce": int(total.item()),
        "distributed_type": str(accelerator.distributed_type),
    }
    print("REPORT " + json.dumps(report), flush=True)
    if len(sys.argv) > 1:
        print(f"args: {sys.argv[1:]}", flush=True)


if __name__ == "__main__":
    main()
