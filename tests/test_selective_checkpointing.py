"""Selective activation checkpointing (model.gradient_checkpointing: every-K): blocks 0, K, 2K…
are checkpointed and the others not, the gradients equal those without checkpointing; the memory
estimate keeps the others' activations and the forecast recomputes only the checkpointed blocks;
bad values are refused in one line."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dplaunch.config.schema import ModelConfig
from dplaunch.errors import UserError
from dplaunch.planning.estimate import estimate_memory
from dplaunch.planning.forecast import micro_batch_flops
from dplaunch.planning.model_facts import ModelFacts
from dplaunch.planning.rules import ParallelDims, check_checkpoint_every
from dplaunch.planning.workload import Workload
from dplaunch.train.modeling import checkpoint_every_kth

TINY = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=97, max_position_embeddings=64,
)  # fmt: skip
LLAMA_1B = {
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
    "vocab_size": 32000,
}  # fmt: skip


def _gradients(checkpointing: int) -> tuple[float, dict[str, torch.Tensor], list[bool]]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if checkpointing > 1:
            checkpoint_every_kth(model, checkpointing)
    flags = [bool(layer.gradient_checkpointing) for layer in model.model.layers]
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss), grads, flags


def test_every_kth_block_is_checkpointed_and_the_gradients_equal_no_checkpointing():
    loss, plain, flags = _gradients(0)
    assert flags == [False] * 4
    for every, expected in (
        (1, [True] * 4),
        (2, [True, False, True, False]),
        (3, [True, False, False, True]),
    ):
        other_loss, grads, flags = _gradients(every)
        assert flags == expected
        assert other_loss == pytest.approx(loss, abs=1e-6)
        for name, grad in plain.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_the_run_file_reads_true_false_and_every_k():
    config = {"model_type": "llama"}
    read = {
        value: ModelConfig(config=config, gradient_checkpointing=value).checkpoint_every
        for value in (True, False, "every-1", "every-4", "off")
    }
    assert read == {True: 1, False: 0, "every-1": 1, "every-4": 4, "off": 0}
    for bad in ("every-0", "every-x", "sometimes"):
        with pytest.raises(ValueError, match="neither true, false nor every-K"):
            ModelConfig(config=config, gradient_checkpointing=bad)


def test_every_k_larger_than_the_blocks_is_refused():
    check_checkpoint_every(4, 4)
    with pytest.raises(UserError) as refused:
        check_checkpoint_every(5, 4)
    assert refused.value.line().startswith(
        "model.gradient_checkpointing: every-5 checkpoints every 5th block, and the model has 4"
    )


def test_the_estimate_and_the_forecast_count_the_checkpointed_blocks_only():
    facts = ModelFacts.from_config_dict(LLAMA_1B)
    dims = ParallelDims(8, 8)

    def work(on: bool, every: int = 1) -> Workload:
        return Workload(
            micro_batch=4, seq_len=2048, activation_checkpointing=on, checkpoint_every=every
        )

    none, every2, every1 = (
        estimate_memory(facts, dims, w).activations_gb
        for w in (work(False), work(True, 2), work(True, 1))
    )
    assert every1 < every2 < none
    # 11 of 22 blocks keep everything, 11 their input: about halfway
    assert every2 == pytest.approx((none + every1) / 2, rel=0.1)
    flops = {
        every: micro_batch_flops(
            facts, micro_batch=1, seq_len=2048, activation_checkpointing=every
        )
        for every in (0, 1, 2)
    }  # fmt: skip
    assert flops[0].dense_recompute == 0
    assert flops[2].dense_recompute == pytest.approx(flops[1].dense_recompute / 2)
