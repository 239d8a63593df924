"""Activation bytes one rank keeps for backward, without and with Ulysses sequence parallelism.

Run by tests/test_sequence_parallel.py under torchrun on 2 CPU ranks (gloo):

    python -m torch.distributed.run --nproc_per_node 2 tests/sequence_memory_probe.py

Each rank runs a tiny fp32 Llama (sdpa) on the same 2 × 256-token batch twice: whole sequences
(sp 1), then its half of each sequence through dplaunch's Ulysses attention (sp 2). It counts the
distinct storages the forward saves for backward (weights left out), for 3 layers and for 2: the
difference is one layer's activations. Then the same for packed rows (4 examples a row, masked
apart over the gathered rows), the bytes of that one mask, and the dtypes Ulysses' all-to-alls
move under bf16 autocast. Rank 0 prints one line: ``MEMORY {json}``.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

SEQ_LEN = 256
MICRO_BATCH = 2
# Llama-2-7B's MLP width ratio (11008 / 4096), no GQA: k and v as big as q
SHAPE = dict(
    model_type="llama",
    hidden_size=128,
    intermediate_size=344,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=259,
    max_position_embeddings=SEQ_LEN,
    tie_word_embeddings=False,
)


def saved_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct storages the forward keeps for backward, weights left out."""
    from torch.autograd.graph import saved_tensors_hooks

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in weights:
            storages[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with saved_tensors_hooks(keep, lambda tensor: tensor):
        model(**batch, use_cache=False)
    return sum(storages.values())


def per_layer(models: dict[int, torch.nn.Module], batch: dict[str, torch.Tensor]) -> int:
    return saved_bytes(models[3], batch) - saved_bytes(models[2], batch)


def main() -> None:
    import transformers
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    from dplaunch.train.sequence_parallel import (
        SequenceShards,
        install_ulysses,
        sequence_parallel_groups,
    )

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    fields = dict(SHAPE)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    models = {
        layers: transformers.AutoModelForCausalLM.from_config(
            config.__class__(**{**config.to_dict(), "num_hidden_layers": layers})
        ).train()
        for layers in (2, 3)
    }
    ids = torch.randint(0, SHAPE["vocab_size"], (MICRO_BATCH, SEQ_LEN))
    whole = per_layer(models, {"input_ids": ids})
    # packed rows (sft): 4 examples of 64 tokens a row, which transformers masks apart
    positions = (torch.arange(SEQ_LEN) % 64).expand(MICRO_BATCH, SEQ_LEN)
    whole_packed = {"input_ids": ids, "position_ids": positions}
    whole_packed_layer = per_layer(models, whole_packed)
    whole_packed_mask = saved_bytes(models[2], whole_packed) - saved_bytes(
        models[2], {"input_ids": ids}
    )
    group = sequence_parallel_groups([list(range(world))], rank)
    attention = install_ulysses(models[3], group)  # one table for every model of the process
    shards = SequenceShards(world, rank, pad_id=0)
    local, _ = shards.slice({"input_ids": ids, "labels": ids})
    local.pop("shift_labels")
    sliced = per_layer(models, local)
    # the same packed rows, masked apart over the gathered rows
    packed = {"input_ids": ids, "labels": ids, "position_ids": positions}
    packed_local, _ = shards.slice(packed)
    packed_local.pop("shift_labels")
    attention.prepare(shards, packed)
    packed_layer = per_layer(models, packed_local)
    packed_forward = saved_bytes(models[2], packed_local)
    attention.release()
    unpacked_forward = saved_bytes(models[2], local)
    # the dtypes Ulysses' all-to-alls move under DDP's bf16 autocast
    moved: set[str] = set()
    exchange = ulysses_sp._dim_zero_all_to_all

    def spy(group, tensor):
        moved.add(str(tensor.dtype).removeprefix("torch."))
        return exchange(group, tensor)

    ulysses_sp._dim_zero_all_to_all = spy
    with torch.autocast("cpu", dtype=torch.bfloat16):
        models[2](**local, use_cache=False)
    if rank == 0:
        report = {"sp": world, "seq_len": SEQ_LEN, "micro_batch": MICRO_BATCH}
        print(
            "MEMORY "
            + json.dumps(
                {
                    **report,
                    "sp1_layer": whole,
                    "sp1_packed_layer": whole_packed_layer,
                    "sp1_packed_mask": whole_packed_mask,
                    "sp_layer": sliced,
                    "sp_packed_layer": packed_layer,
                    "sp_packed_mask": packed_forward - unpacked_forward,
                    "all_to_all_dtypes": sorted(moved),
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
