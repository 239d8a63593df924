"""Plan → deepspeed.json, with the batch trio stated explicitly (DeepSpeed asserts when they disagree)."""

from __future__ import annotations

import json
from typing import Any

from dplaunch.planning.estimate import BUCKET_SIZE
from dplaunch.planning.plan import Plan


def deepspeed_batch_world(plan: Plan) -> int:
    """The rank count DeepSpeed multiplies into train_batch_size.

    With AutoTP, DeepSpeed's batch assertion still counts every rank (micro × ga × all ranks),
    although tensor-parallel ranks share their batch; the pipeline engine counts only its
    data-parallel ranks.
    """
    if plan.pipeline_parallel_size > 1:
        return plan.data_parallel_size
    return plan.world_size


def deepspeed_config_dict(plan: Plan, *, max_grad_norm: float) -> dict[str, Any]:
    """The DeepSpeed config for the plan (ZeRO, offload, precision, AutoTP, batch trio)."""
    world = deepspeed_batch_world(plan)
    zero: dict[str, Any] = {"stage": plan.zero_stage}
    if plan.zero_stage >= 1:
        zero.update(
            {
                "overlap_comm": plan.target == "gpu",
                "contiguous_gradients": True,
                "reduce_scatter": True,
                "reduce_bucket_size": BUCKET_SIZE,
                "allgather_bucket_size": BUCKET_SIZE,
            }
        )
    if plan.zero_stage == 3:
        zero.update(
            {
                "stage3_prefetch_bucket_size": BUCKET_SIZE // 4,
                "stage3_param_persistence_threshold": 100_000,
                # export needs full weights gathered on save
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        )
        zero.pop("allgather_bucket_size")
    if plan.tensor_parallel_size > 1:
        # the consolidated export gathers AutoTP shards through the same DeepSpeed path as ZeRO-3
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    pin = plan.target == "gpu"
    if plan.offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if plan.offload == "all":
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    config: dict[str, Any] = {
        "train_batch_size": plan.micro_batch_size * plan.gradient_accumulation_steps * world,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
        "gradient_clipping": float(max_grad_norm),
        "zero_optimization": zero,
        "bf16": {"enabled": plan.mixed_precision == "bf16"},
        "fp16": {
            "enabled": plan.mixed_precision == "fp16",
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        # dplaunch builds torch's AdamW itself (DeepSpeedCPUAdam under offload): same maths as DDP
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }
    if plan.mixed_precision == "bf16" and plan.zero_stage >= 1:
        # DeepSpeed's bf16 keeps gradients in bf16 by default: summed over the micro-batches and
        # reduced over the ranks in 8 bits of mantissa, where DDP's autocast keeps fp32 gradients.
        # fp32 accumulation (DeepSpeed 0.19 supports it with ZeRO, not without: stage 0 would
        # refuse the mix) and fp32 reduction, as DDP does
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        config["communication_data_type"] = "fp32"
    if plan.offload != "none":
        # dplaunch builds DeepSpeedCPUAdam in AdamW mode itself; without this key Accelerate
        # replaces it with its own DeepSpeedCPUAdam, in Adam mode (L2-coupled weight decay) for any
        # optimizer that is not torch's AdamW (accelerate.utils.deepspeed.map_pytorch_optim_to_deepspeed)
        config["zero_force_ds_cpu_optimizer"] = False
    if plan.tensor_parallel_size > 1:
        config["tensor_parallel"] = {"autotp_size": plan.tensor_parallel_size}
    return config


def render_deepspeed_config(plan: Plan, *, max_grad_norm: float) -> str:
    """deepspeed.json text."""
    return json.dumps(deepspeed_config_dict(plan, max_grad_norm=max_grad_norm), indent=2) + "\n"
