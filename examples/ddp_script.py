"""A plain PyTorch DDP script in the torchrun style (as in IDRIS's recipe): it reads RANK,
LOCAL_RANK, WORLD_SIZE and MASTER_ADDR from the environment. `dplaunch launch examples/ddp_script.py --gpus 2`.
"""

import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Linear(4, 1).to(device), device_ids=[local_rank] if use_cuda else None
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.randn(8, 4, device=device)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    total = torch.ones(1, device=device)
    dist.all_reduce(total)
    report = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "ranks_counted_by_all_reduce": int(total.item()),
        "master_addr": os.environ["MASTER_ADDR"],
    }
    print("REPORT " + json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
