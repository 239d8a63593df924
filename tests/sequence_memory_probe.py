"""Activation bytes one rank keeps for backward, without and with Ulysses sequence parallelism.

Run by tests/test_sequence_parallel.py under torchrun on 2 CPU ranks (gloo):

    python -m torch.distributed.run --nproc_per_node 2 tests/sequence_memory_probe.py

Each rank runs a tiny fp32 Llama (sdpa) on the same 2 × 256-token batch twice: whole sequences
(sp 1), then its half of each sequence through dplaunch's Ulysses attention (sp 2). It counts the
distinct storages the forward saves for backward (weights left out), for 3 layers and for 2: the
difference is one layer's activations. Rank 0 prints one line: ``MEMORY {json}``.
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
    group = sequence_parallel_groups([list(range(world))], rank)
    install_ulysses(models[3], group)  # one table for every model of the process
    local, _ = SequenceShards(world, rank, pad_id=0).slice({"input_ids": ids, "labels": ids})
    local.pop("shift_labels")
    sliced = per_layer(models, local)
    if rank == 0:
        report = {"sp": world, "seq_len": SEQ_LEN, "micro_batch": MICRO_BATCH}
        print("MEMORY " + json.dumps({**report, "sp1_layer": whole, "sp_layer": sliced}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
