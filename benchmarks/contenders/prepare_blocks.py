"""Pre-tokenise a rendered run's data once: `python -m benchmarks.contenders.prepare_blocks RUN OUT.pt`.

The blocks are exactly the ones dplaunch's loop builds (same loader, tokenizer and packing), saved
as one int64 tensor [samples, max_length], so the peers train on identical data without paying
for tokenisation.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from dplaunch.config.schema import RunConfig
from dplaunch.run_directory.files import read_run_file
from dplaunch.train.data import load_splits, tokenize
from dplaunch.train.modeling import load_tokenizer


def main(run_dir: Path, out: Path) -> None:
    config = RunConfig.model_validate(read_run_file(run_dir))
    tokenizer = load_tokenizer(config.model)
    train, _ = load_splits(config.data, config.train.seed)
    blocks = tokenize(train, tokenizer, config.data, config.model.task)
    tensor = torch.tensor(blocks["input_ids"], dtype=torch.long)
    torch.save({"input_ids": tensor, "pad_token_id": tokenizer.pad_token_id}, out)
    print(f"{tensor.shape[0]} blocks of {tensor.shape[1]} tokens → {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
