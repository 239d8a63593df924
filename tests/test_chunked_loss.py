"""The chunked loss (train.loss_chunk): the head and the token loss a chunk at a time give the
full logits' loss and gradients (head, hidden states, the last block) within 1e-5, in both forms
(the fused one, gradients in the forward; the checkpointed one ZeRO-3 takes); a 2-rank run with
it trains as without it, per step, under DDP, ZeRO-3 and LoRA for causal-lm and sft; `auto` turns
it on for a large vocabulary and not for a tiny model, and the plan counts one chunk's logits;
what cannot run it is refused in one line."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dplaunch.data.example_tokens import IGNORE_INDEX
from dplaunch.errors import UserError
from dplaunch.planning.estimate import estimate_memory
from dplaunch.planning.loss_chunk import check_loss_chunk
from dplaunch.planning.model_facts import ModelFacts
from dplaunch.planning.rules import ParallelDims
from dplaunch.planning.workload import Workload
from dplaunch.train.chunked_loss import (
    chunked_head,
    cross_entropy_sum,
    fused_cross_entropy,
    pieces_for,
)
from tests.helpers import REPO, child_environment, read_metrics, train

TINY = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=97, max_position_embeddings=64,
)  # fmt: skip


def _labels(rows: int, tokens: int) -> torch.Tensor:
    labels = torch.randint(0, 97, (rows, tokens), generator=torch.Generator().manual_seed(2))
    labels[0, :3] = IGNORE_INDEX  # a prompt's tokens, as sft's
    labels[1, -2:] = IGNORE_INDEX  # padding
    return labels


@pytest.mark.parametrize("form", ["fused", "checkpointed"])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_the_chunked_loss_and_gradients_equal_the_full_logits(form, chunk):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).train()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = _labels(2, 12)

    def gradients(loss_of) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad()
        hidden = model.model(input_ids=ids).last_hidden_state
        loss = loss_of(hidden)
        loss.backward()
        kept = ("lm_head.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight")
        return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if n in kept}

    full_loss, full = gradients(lambda h: cross_entropy_sum(model.lm_head(h), labels))
    if form == "fused":
        loss, grads = gradients(
            lambda h: fused_cross_entropy(h, model.lm_head.weight, labels, chunk)
        )
    else:
        loss, grads = gradients(
            lambda h: torch.stack(
                chunked_head(
                    lambda a, y: cross_entropy_sum(model.lm_head(a), y),
                    h,
                    pieces_for(2, 12, chunk),
                    labels,
                )
            ).sum()
        )
    assert loss == pytest.approx(full_loss, rel=1e-6)
    assert set(grads) == set(full) and len(full) == 3
    for name, grad in full.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)


class _LiveBytes:
    """The peak of glibc's allocated bytes (mallinfo2: heap in use + mmapped blocks) while a
    block runs, over what was allocated before it, sampled by a thread (torch's operators
    release the GIL): a peak it misses only makes the figure lower."""

    def __init__(self):
        import ctypes

        class MallInfo2(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                "uordblks", "fordblks", "keepcost",
            )]  # fmt: skip

        self.libc = ctypes.CDLL("libc.so.6")
        self.libc.mallinfo2.restype = MallInfo2

    def live(self) -> int:
        info = self.libc.mallinfo2()
        return info.uordblks + info.hblkhd

    def peak_over(self, block) -> int:
        import threading

        base = self.live()
        peak, done = [base], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], self.live())

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            block()
        finally:
            done.set()
            sampler.join()
        return peak[0] - base


def test_the_fused_form_holds_one_chunk_of_logits_at_a_time():
    # the chunk's fp32 [rows, vocab] buffer and the head's fp32 gradient, as the plan counts
    # (planning/estimate.py FUSED_BYTES_PER_LOGIT); before, the next chunk's logits were made
    # while the last one's were still bound, and logsumexp held two more of their size
    rows, chunk, vocab, width = 512, 128, 16384, 32
    hidden = torch.randn(rows, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,))
    buffer, head_gradient = chunk * vocab * 4, vocab * width * 4
    fused_cross_entropy(hidden, weight, targets, chunk)  # warm-up (thread pools, caches)
    peak = _LiveBytes().peak_over(lambda: fused_cross_entropy(hidden, weight, targets, chunk))
    assert peak >= head_gradient  # the sampler saw the step at all
    assert peak < 1.5 * buffer + head_gradient + 4 * rows * width + 2**20, peak / 2**20


def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_theirs():
    hidden = torch.randn(3, 4, 8, requires_grad=True)
    weight = torch.randn(11, 8)  # LoRA's frozen head
    labels = torch.randint(0, 11, (3, 4))
    fused_cross_entropy(hidden, weight, labels, 2).backward()
    got = hidden.grad.clone()
    hidden.grad = None
    cross_entropy_sum(hidden @ weight.t(), labels).backward()
    torch.testing.assert_close(got, hidden.grad, atol=1e-6, rtol=1e-5)


LLAMA3_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256,
}  # fmt: skip


def test_auto_chunks_a_large_vocabulary_and_the_plan_counts_one_chunk():
    facts, dims = ModelFacts.from_config_dict(LLAMA3_8B), ParallelDims(8, 8, zero_stage=3)
    work = Workload(micro_batch=1, seq_len=8192, activation_checkpointing=True)
    full = estimate_memory(facts, dims, work)
    auto = estimate_memory(facts, dims, Workload(**{**work.__dict__, "loss_chunk": None}))
    # 8,192 tokens × 128,256 × 12 bytes ≈ 11.7 GiB of logits, against checkpointed activations
    assert full.loss_chunk == 0 and full.logits_gb > 11
    assert auto.loss_chunk == 4096
    assert auto.logits_gb == pytest.approx(full.logits_gb * 4096 / 8192)
    assert "logits of a 4,096-token chunk of the loss" in "\n".join(auto.breakdown_lines())
    tiny = ModelFacts.from_config_dict({"model_type": "llama", **TINY})
    small = Workload(micro_batch=8, seq_len=64, loss_chunk=None)
    assert estimate_memory(tiny, ParallelDims(2, 2), small).loss_chunk == 0
    # the fused form (the head whole on the rank: DDP, FSDP2) holds one fp32 buffer of the
    # chunk's logits (+ the bf16 cast) and the head's fp32 gradient
    for dims in (ParallelDims(8, 8), ParallelDims(8, 8, fsdp="full")):
        fused = estimate_memory(facts, dims, Workload(**{**work.__dict__, "loss_chunk": 4096}))
        assert fused.logits_gb * 2**30 == pytest.approx(
            4096 * 128256 * (4 + 2) + 4 * 128256 * 4096, rel=1e-6
        ), dims


@pytest.mark.parametrize(
    "task,dims,expected",
    [
        (
            "sequence-classification",
            ParallelDims(2, 2),
            "model.task sequence-classification has no vocabulary head",
        ),
        ("causal-lm", ParallelDims(2, 2, tp=2), "a tensor-parallel head splits the vocabulary"),
        (
            "causal-lm",
            ParallelDims(2, 2, fsdp="full", tp=2),
            "a tensor-parallel head splits the vocabulary",
        ),
        ("causal-lm", ParallelDims(2, 2, pp=2), "the pipeline's last stage"),
    ],
    ids=["classification", "tp", "fsdp-tp", "pp"],
)
def test_a_chunk_where_it_cannot_run_is_refused(task, dims, expected):
    check_loss_chunk("auto", task, dims, tiled_mlp=False)  # auto stays off there
    with pytest.raises(UserError) as refused:
        check_loss_chunk(512, task, dims, tiled_mlp=False)
    assert refused.value.line().startswith("train.loss_chunk: cannot chunk the loss: " + expected)


# -- 2 ranks: the same per-step losses ---------------------------------------------------------

# a head of 2,048 × 64 weights: over DeepSpeed's persistence threshold (100 k), so that ZeRO-3
# partitions it (the tiny Llama's 259 × 64 stays whole on every rank)
PARTITIONED_HEAD = ("--set", "model.config.vocab_size=2048")
# (run file, flags, train.loss_chunk); every layout trains as DDP per step (the layout matrix)
CHUNKED_RUNS = {
    "causal-ddp-full": ("examples/tiny-llama.yaml", PARTITIONED_HEAD, "off"),
    "causal-ddp": ("examples/tiny-llama.yaml", PARTITIONED_HEAD, "7"),
    "causal-zero3": ("examples/tiny-llama.yaml", (*PARTITIONED_HEAD, "--zero", "3"), "7"),
    "causal-fsdp2": ("examples/tiny-llama.yaml", (*PARTITIONED_HEAD, "--fsdp", "full"), "7"),
    "sft-lora-full": ("configs/sft-lora.yaml", (), "off"),
    "sft-lora": ("configs/sft-lora.yaml", (), "7"),
}

# a spy in the ZeRO-3 run's ranks (their sitecustomize: they start as usual, not from the
# suite's fork server): the partitioned parameters of 2,048 rows (the embedding's and the
# head's) that DeepSpeed's coordinator all-gathers, by micro-batch (reset_step ends each one)
GATHER_SPY = """
import json, os, sys


def _install(module):
    coordinator = module.PartitionedParameterCoordinator
    gather = coordinator._PartitionedParameterCoordinator__all_gather_params
    reset = coordinator.reset_step
    log = open(os.environ["GATHER_SPY"] + "." + os.environ["RANK"], "a", buffering=1)
    seen = {"micro_batch": 0}

    def all_gather(self, params, forward):
        ids = sorted(p.ds_id for p in params if tuple(p.ds_shape)[:1] == (2048,))
        if ids:
            log.write(json.dumps({"micro_batch": seen["micro_batch"], "ids": ids}) + "\\n")
        return gather(self, params, forward)

    def reset_step(self):
        seen["micro_batch"] += 1
        return reset(self)

    coordinator._PartitionedParameterCoordinator__all_gather_params = all_gather
    coordinator.reset_step = reset_step


class _Spy:
    NAME = "deepspeed.runtime.zero.partitioned_param_coordinator"

    def find_spec(self, name, path=None, target=None):
        if name != self.NAME:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _install(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("RANK") is not None:
    sys.meta_path.insert(0, _Spy())
"""


@pytest.fixture(scope="module")
def chunked_runs(tmp_path_factory) -> dict[str, Any]:
    """Each run's per-step losses (4 steps on 2 ranks), and what the ZeRO-3 run's rank 0
    all-gathered of its 2,048-row weights."""
    tmp = tmp_path_factory.mktemp("chunked")
    spy = tmp / "spy"
    spy.mkdir()
    (spy / "sitecustomize.py").write_text(GATHER_SPY)
    runs: dict[str, Any] = {}
    for name, (run_file, flags, chunk) in CHUNKED_RUNS.items():
        common = ("--cpu", "--gpus", "2", "--max-steps", "4", "--set", "train.log_every=1")
        env = None
        if name == "causal-zero3":
            env = child_environment(GATHER_SPY=str(tmp / "gathers"))
            env["PYTHONPATH"] = os.pathsep.join([str(spy), str(REPO)])
        run = tmp / name
        result = train(
            run, *common, *flags, "--set", f"train.loss_chunk={chunk}",
            config=REPO / run_file, env=env,
        )  # fmt: skip
        said = "chunked loss: the head and the loss 7 tokens at a time"
        assert (said in result.stdout) == (chunk != "off"), result.stdout[-2000:]
        # the plan's note: what the chunk's logits take against the full logits
        planned = re.search(
            r"counts (\S+) GiB for them instead of the full logits' (\S+) GiB",
            result.stdout,
        )
        assert (planned is not None) == (chunk != "off"), result.stdout[-2000:]
        if planned:
            assert float(planned[1]) < float(planned[2]), planned[0]
        runs[name] = [r["loss"] for r in read_metrics(run) if r["type"] == "train"]
    lines = (tmp / "gathers.0").read_text().splitlines()
    runs["zero3-gathers"] = [json.loads(line) for line in lines]
    return runs


@pytest.mark.parametrize(
    "chunked,full",
    [("causal-ddp", "causal-ddp-full"), ("causal-zero3", "causal-ddp-full"),
     ("causal-fsdp2", "causal-ddp-full"), ("sft-lora", "sft-lora-full")],
)  # fmt: skip
def test_a_chunked_run_trains_as_the_full_logits(chunked_runs, chunked, full):
    assert len(chunked_runs[full]) == 4
    assert chunked_runs[chunked] == pytest.approx(chunked_runs[full], abs=1e-5)


def test_zero3_gathers_the_chunked_head_once_a_micro_batch_not_once_a_chunk(chunked_runs):
    # DeepSpeed's coordinator records the first micro-batch's order of modules (its trace), then
    # keeps a parameter gathered while the trace says it is used again soon (stage 3's
    # max_reuse_distance): the head, from its prefetch through every chunk of the forward and
    # each chunk's recompute in the backward. The spy sees the head's gathers on rank 0.
    heads: Counter[int] = Counter()
    for gather in chunked_runs["zero3-gathers"]:
        # the 2,048-row weights: the embedding (ds_id 0, the first parameter) and the head
        heads[gather["micro_batch"]] += any(ds_id > 0 for ds_id in gather["ids"])
    first, *later = sorted(heads)
    assert heads[first] > 2, heads  # while the trace is recorded: each chunk gathers it
    assert len(later) >= 3 and all(heads[m] == 1 for m in later), heads
