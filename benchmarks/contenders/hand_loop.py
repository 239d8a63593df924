"""The ceiling: a minimal hand-written Accelerate loop, written the way Accelerate's docs write one.

`accelerate launch --config_file RUN/accelerate.yaml -m benchmarks.contenders.hand_loop RUN BLOCKS
TIMES` trains the run file's model on pre-tokenised blocks with the plan's micro batch, gradient
accumulation, learning rate, clipping and precision, and writes the wall-clock time of every
optimizer step to TIMES. With RUN/deepspeed.json it uses DeepSpeed through Accelerate; on CPU that
needs the gloo process-group handler (without it Accelerate finds no backend and DeepSpeed's batch
check fails: world size 1).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs
from transformers import get_scheduler

from benchmarks.contenders.common import (
    StepClock,
    backend,
    build_model,
    dplaunch_fuses_adamw,
    read_rendered_run,
)
from dplaunch.run_directory.layout import DEEPSPEED_FILE


def main(run_dir: Path, blocks_path: Path, times_path: Path) -> None:
    run, plan = read_rendered_run(run_dir)
    train = run["train"]
    deepspeed_json = run_dir / DEEPSPEED_FILE
    if deepspeed_json.exists():
        accelerator = Accelerator(
            deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=str(deepspeed_json)),
            kwargs_handlers=[InitProcessGroupKwargs(backend=backend(plan))],
        )
    else:
        accelerator = Accelerator(
            cpu=plan["target"] == "cpu",
            mixed_precision=plan["mixed_precision"],
            gradient_accumulation_steps=plan["gradient_accumulation_steps"],
        )
    data = torch.load(blocks_path)
    model = build_model(run, data["pad_token_id"])
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=train["lr"],
        weight_decay=0.0,
        fused=dplaunch_fuses_adamw(model, run_dir),
    )
    loader = torch.utils.data.DataLoader(
        data["input_ids"], batch_size=plan["micro_batch_size"], shuffle=True, drop_last=True
    )
    max_steps = train["max_steps"]
    scheduler = get_scheduler(
        train["scheduler"], optimizer, num_warmup_steps=0, num_training_steps=max_steps
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    clock = StepClock(times_path if accelerator.is_main_process else None)

    model.train()
    step = 0
    while step < max_steps:
        for ids in loader:
            with accelerator.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), train["max_grad_norm"])
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            if step % train["log_every"] == 0:
                mean = accelerator.reduce(loss.detach(), reduction="mean").item()
                accelerator.print(f"step {step}/{max_steps}  loss {mean:.4f}")
            clock.tick(step)
            if step == max_steps:
                break
    clock.close()
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
