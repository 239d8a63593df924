"""HF `Trainer` on the same run: `accelerate launch --config_file RUN/accelerate.yaml -m
benchmarks.contenders.hf_trainer RUN BLOCKS TIMES`.

Same model, pre-tokenised blocks, per-device micro batch × gradient accumulation, learning rate,
schedule, clipping and precision as the rendered plan; the optimizer is torch's AdamW with the
kernel dplaunch's loop picks for the run (`adamw_torch_fused` when dplaunch fuses it, else
`adamw_torch`). A run file with model.lora gets PEFT's LoRA adapters (get_peft_model). Everything else is Trainer's default. A callback writes the wall-clock time of every optimizer step to TIMES.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from benchmarks.contenders.common import (
    StepClock,
    backend,
    build_model,
    dplaunch_fuses_adamw,
    read_rendered_run,
)
from dplaunch.run_directory.layout import DEEPSPEED_FILE


class Blocks(torch.utils.data.Dataset):
    """Packed causal-LM blocks: labels are the inputs (the model shifts them)."""

    def __init__(self, input_ids: torch.Tensor):
        self.input_ids = input_ids

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.input_ids[index]
        return {"input_ids": row, "labels": row}


def with_lora(model: torch.nn.Module, lora: dict) -> torch.nn.Module:
    """The model with PEFT's LoRA adapters as the run file's model.lora says (alpha unset: 2r),
    written the way a PEFT user writes it."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora["r"],
        lora_alpha=lora.get("alpha") or 2 * lora["r"],
        lora_dropout=lora.get("dropout", 0.0),
        target_modules=lora.get("target_modules", "all-linear"),
        modules_to_save=lora.get("modules_to_save"),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


class StepTimes(TrainerCallback):
    def __init__(self, clock: StepClock):
        self.clock = clock

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.tick(state.global_step)


def main(run_dir: Path, blocks_path: Path, times_path: Path) -> None:
    run, plan = read_rendered_run(run_dir)
    train = run["train"]
    deepspeed_json = run_dir / DEEPSPEED_FILE
    precision = plan["mixed_precision"]
    data = torch.load(blocks_path)
    model = build_model(run, data["pad_token_id"])
    lora = run["model"].get("lora")
    if lora:
        model = with_lora(model, lora)
    output_dir = tempfile.mkdtemp(prefix="hf-trainer-")
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=plan["micro_batch_size"],
        gradient_accumulation_steps=plan["gradient_accumulation_steps"],
        max_steps=train["max_steps"],
        learning_rate=train["lr"],
        weight_decay=0.0,
        lr_scheduler_type=train["scheduler"],
        warmup_steps=0,
        max_grad_norm=train["max_grad_norm"],
        optim="adamw_torch_fused" if dplaunch_fuses_adamw(model, run_dir) else "adamw_torch",
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        use_cpu=plan["target"] == "cpu",
        ddp_backend=backend(plan) if plan["world_size"] > 1 else None,
        deepspeed=str(deepspeed_json) if deepspeed_json.exists() else None,
        logging_steps=train["log_every"],
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=train["seed"],
    )
    trainer = Trainer(model=model, args=args, train_dataset=Blocks(data["input_ids"]))
    clock = StepClock(times_path if trainer.is_world_process_zero() else None)
    trainer.add_callback(StepTimes(clock))
    trainer.train()
    clock.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
