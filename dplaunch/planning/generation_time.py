"""The forecast of grpo's sampling (the step's "generate" phase): decode steps, their weights
read, their gathers, and the forwards that score the completions before training on them.

A rank samples the completions it trains: one prompt's num_generations rows at a time
(train/generation.py), each completion up to max_completion_length tokens (the forecast assumes
every one reaches it: an upper bound, the run's `completions/mean_length` says how far below).
A batch of completions serves num_iterations steps: a step pays 1/μ of its sampling.

One decode step of a group runs the whole model on one token a row. It is bound by the larger
of two: reading the rank's weights from memory once (bandwidth-bound, as every decoder is:
the weights ÷ 70 % of the memory bandwidth of the GPU's datasheet; DEFAULT_CPU_BYTES_PER_S on
CPU ranks) and the matrix products of its rows (2 FLOPs a parameter a row, at the profile's
dense rate for so few tokens). Its host side is the engine family's forward overhead per
parameter tensor (planning/forecast.py Overheads: ZeRO-3's fetch and release of every weight,
FSDP2's unit hooks), which a GPU hides behind the device where it is shorter. Under ZeRO-3 and
FSDP2 every decode step gathers the rank's share of every weight from the others: an all-gather
of the 16-bit (or fp32) weights each step. The prompt's own forward (prefill) is counted as one
forward of its tokens.

Then the rollout scores the completions: with beta > 0 the reference model's forward of every
row, with num_iterations > 1 the policy's (the log-probabilities at generation), each a
forward of the step's micro-batches, at the training forward's rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dplaunch.planning.profiles import GPU_SHEETS, Profile, gpu_sheet_name

if TYPE_CHECKING:
    from dplaunch.planning.mesh import ParallelDims
    from dplaunch.planning.workload import Workload

# a CPU rank's memory bandwidth when reading weights for a decode step (one core's share of a
# server's DRAM, roughly)
DEFAULT_CPU_BYTES_PER_S = 10e9
# what a decoder reaches of the datasheet's memory bandwidth
BANDWIDTH_SHARE = 0.7


def memory_bytes_per_s(profile: Profile) -> float:
    """The bytes a second one rank reads its weights at."""
    if profile.device.upper().startswith("CPU"):
        return DEFAULT_CPU_BYTES_PER_S
    sheet = GPU_SHEETS.get(gpu_sheet_name(profile.device) or "")
    return BANDWIDTH_SHARE * (sheet.memory_bytes_per_s if sheet else 2e12)


def decode_steps(workload: Workload, dims: ParallelDims) -> tuple[float, float]:
    """(decode forwards, prefill forwards) one rank runs a step: the groups its completions
    touch × (max_completion_length, 1), ÷ num_iterations."""
    generation = workload.generation
    assert generation is not None
    completions = workload.micro_batch * (workload.accumulation_steps(dims.dp) or 1)
    groups = -(-completions // generation.rows)
    return (
        groups * generation.completion_tokens / generation.iterations,
        groups / generation.iterations,
    )


@dataclass(frozen=True)
class DecodeCosts:
    """What a decode step costs on a rank of the layout: PARAMS, the parameters it runs (its
    tensor-parallel share); WEIGHT_BYTES, their bytes as the forward reads them; DENSE_RATE, the
    profile's FLOP/s at a decode step's few tokens; TENSORS_OVERHEAD_S, the engine family's host
    seconds of one forward; GATHER_S, ZeRO-3's or FSDP2's all-gather of the weights a forward
    (0 otherwise); SCORING_FORWARD_S, one forward of the step's micro-batches at the training
    rate."""

    params: float
    weight_bytes: float
    dense_rate: float
    tensors_overhead_s: float
    gather_s: float
    scoring_forward_s: float


def generation_seconds(
    workload: Workload, dims: ParallelDims, profile: Profile, costs: DecodeCosts
) -> dict[str, float]:
    """The generate phase's terms (seconds a step): ``decode`` (the device's share of the
    decode and prefill forwards: weights read or FLOPs, the larger), ``overhead`` (the host's
    beyond it on a GPU, all of it on CPU), ``communication`` (ZeRO-3's and FSDP2's gathers each
    forward) and ``scoring`` (the reference's and the old policy's forwards)."""
    generation = workload.generation
    assert generation is not None
    decodes, prefills = decode_steps(workload, dims)
    rows, prompt = generation.rows, workload.seq_len - generation.completion_tokens
    read = costs.weight_bytes / memory_bytes_per_s(profile)
    per_decode = max(read, 2.0 * costs.params * rows / costs.dense_rate)
    per_prefill = max(read, 2.0 * costs.params * rows * max(prompt, 1) / costs.dense_rate)
    device = decodes * per_decode + prefills * per_prefill
    forwards = decodes + prefills
    host = forwards * costs.tensors_overhead_s
    cpu = profile.device.upper().startswith("CPU")
    overhead = host if cpu else max(host - device, 0.0)
    scorers = (workload.reference is not None) + (generation.iterations > 1)
    return {
        "decode": device,
        "overhead": overhead,
        "communication": forwards * costs.gather_s,
        "scoring": scorers * costs.scoring_forward_s / generation.iterations,
    }
