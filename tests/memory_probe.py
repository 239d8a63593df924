"""Bytes one rank really holds in parameters, gradients and optimizer states, under DDP or ZeRO 1-3.

Run by tests/test_planning_tools.py as a user script through dplaunch itself:

    dplaunch launch tests/memory_probe.py --cpu --gpus 2 --zero S --global-batch 8 --micro-batch 2

It builds a Llama the way the training loop does (random init from a config, whole, before
DeepSpeed wraps it; the loop's AdamW groups), prepares it with Accelerate (the rendered
DeepSpeed JSON, gloo), takes one optimizer step (2 micro-batches) so Adam's states exist, runs
the forward and backward of the first micro-batch of a second step — gradients accumulate next
to the optimizer states, as in every step — and sums the storage of every tensor the rank holds,
by kind:

- parameters: the module's parameters (under ZeRO-3 the rank's partition, ``ds_tensor``);
- gradients: ``.grad`` of the parameters and the gradient partitions and accumulation buffers
  DeepSpeed keeps (ZeRO-1/2 ``averaged_gradients``/``all_grad_tensors``, ZeRO-3 its flat
  gradient partition);
- optimizer: torch's AdamW states (exp_avg, exp_avg_sq, step) and DeepSpeed's fp32 master
  partition (ZeRO-1/2 ``single_partition_of_fp32_groups``, ZeRO-3 ``fp32_partitioned_groups_flat``).

Communication buffers are reported apart (``buffers``): DeepSpeed's reduce bucket (ZeRO-1/2 with
contiguous gradients: ``ipg_buffer``), which is a fixed size set by ``reduce_bucket_size``, not a
model state. A tensor that is a view into a buffer already counted adds nothing (storages are
deduplicated). Prints one line per rank: ``MEMORY {json}``.

With ``PROBE_LORA_RANK=R`` in the environment the model gets rank-R LoRA adapters on every linear
layer, as the ranks add them (train/lora.py ``add_adapters``): the base is frozen and only the
adapters have gradients and optimizer states.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch

# big enough that every matrix (≥ 2**17 elements) is partitioned under ZeRO-3 (persistence
# threshold 100k elements), small enough to build in a second
PROBE_CONFIG = dict(
    model_type="llama",
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=320,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
SEQ_LEN = 16
MICRO_BATCH = 2
ACCUMULATION = 2


class StorageCounter:
    """Sums the bytes of distinct storages, each counted once, under the first kind that claims it."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes: dict[str, int] = {}

    def add(self, kind: str, tensor: object) -> None:
        self.bytes.setdefault(kind, 0)
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            return
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self.seen:
            return
        self.seen.add(storage.data_ptr())
        self.bytes[kind] += storage.nbytes()

    def add_all(self, kind: str, value: object) -> None:
        """Tensors in nested lists, tuples and dicts."""
        if isinstance(value, torch.Tensor):
            self.add(kind, value)
        elif isinstance(value, dict):
            for item in value.values():
                self.add_all(kind, item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                self.add_all(kind, item)


def innermost(optimizer: object) -> torch.optim.Optimizer:
    while not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def main() -> None:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs
    from transformers import AutoConfig, AutoModelForCausalLM, set_seed

    from dplaunch.train.engines import build_optimizer

    accelerator = Accelerator(
        kwargs_handlers=[
            InitProcessGroupKwargs(backend="gloo"),
            DistributedDataParallelKwargs(bucket_cap_mb=100),
        ]
    )
    plugin = accelerator.state.deepspeed_plugin
    zero_stage = plugin.zero_stage if plugin is not None else 0
    if plugin is not None:
        batch = plugin.deepspeed_config
        assert (batch["train_micro_batch_size_per_gpu"], batch["gradient_accumulation_steps"]) == (
            MICRO_BATCH,
            ACCUMULATION,
        ), "launch with --global-batch 8 --micro-batch 2 on 2 ranks"
    if plugin is not None:
        # the loop builds a randomly initialised model whole, then DeepSpeed partitions it
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    set_seed(0)
    fields = dict(PROBE_CONFIG)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(fields.pop("model_type"), **fields)
    )
    lora_rank = os.environ.get("PROBE_LORA_RANK")
    if lora_rank:
        from dplaunch.config.schema import LoraConfig, ModelConfig
        from dplaunch.train.lora import add_adapters

        settings = ModelConfig(config=PROBE_CONFIG, lora=LoraConfig(r=int(lora_rank)))
        model = add_adapters(model, settings, seed=0)
    parameters = sum(p.numel() for p in model.parameters())
    if plugin is not None:
        plugin.set_deepspeed_weakref()
    optimizer = build_optimizer(
        model,
        SimpleNamespace(lr=1e-3, weight_decay=0.0),
        SimpleNamespace(offload="none", target="cpu"),
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(accelerator.process_index)

    def forward_backward() -> None:
        ids = torch.randint(
            0, PROBE_CONFIG["vocab_size"], (MICRO_BATCH, SEQ_LEN), generator=generator
        )
        loss = model(input_ids=ids, labels=ids).loss
        if plugin is not None:
            model.backward(loss)  # the engine's own backward: accelerator.backward would also step
        else:
            accelerator.backward(loss)

    def after_micro_batch(last: bool) -> None:
        if plugin is not None:
            model.step()  # DeepSpeed counts micro-batches and updates at the accumulation boundary
        elif last:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    for micro in range(ACCUMULATION):  # step 1: Adam's states exist afterwards
        forward_backward()
        after_micro_batch(last=micro == ACCUMULATION - 1)
    # step 2, mid-accumulation: gradients accumulate next to the optimizer states, as in every step
    forward_backward()

    counter = StorageCounter()
    zero = getattr(
        optimizer, "optimizer", None
    )  # Accelerate's wrapper → DeepSpeed's ZeRO optimizer
    parameters_held = list(accelerator.unwrap_model(model).parameters())
    for parameter in parameters_held:
        # ZeRO-3: the rank's partition, plus the whole tensor of parameters too small to partition
        counter.add("parameters", getattr(parameter, "ds_tensor", None))
        counter.add("parameters", parameter.data)
    for state in innermost(optimizer).state.values():
        counter.add_all("optimizer", state)
    # DeepSpeed's own tensors, by name: its fp32 master partition (kept even in fp32 training),
    # its reduce buckets, and its gradient partitions / accumulation buffers
    deepspeed_tensors = sorted(vars(zero).items()) if plugin is not None else []
    for name, value in deepspeed_tensors:
        if "fp32" in name:
            counter.add_all("optimizer", value)
    for name, value in deepspeed_tensors:
        if "ipg" in name:
            counter.add_all("buffers", value)
    for parameter in parameters_held:
        counter.add("gradients", parameter.grad)
        counter.add("gradients", getattr(parameter, "grad_accum", None))
    for name, value in deepspeed_tensors:
        if "grad" in name and "fp32" not in name and "ipg" not in name:
            counter.add_all("gradients", value)
    report = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "zero_stage": zero_stage,
        "parameters_total": parameters,
        **counter.bytes,
    }
    print("MEMORY " + json.dumps(report), flush=True)
    after_micro_batch(last=False)
    for micro in range(1, ACCUMULATION):
        forward_backward()
        after_micro_batch(last=micro == ACCUMULATION - 1)
    accelerator.end_training()


if __name__ == "__main__":
    main()
