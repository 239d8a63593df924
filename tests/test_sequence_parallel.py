"""Long context: Ulysses sequence parallelism (--sp) and tiled MLP + loss give DP's numbers.

Real ranks on gloo. Each distributed configuration runs once (module fixtures) and many checks
read its outputs: a tiny Llama (hidden 64, 4 heads, 2 KV heads, 2 layers) on blocks of 256 tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.helpers import (
    LLAMA_7B,
    SFT_CONFIG,
    TINY_LLAMA,
    assert_forecast_collectives,
    max_relative_gap,
    read_metrics,
    refusal_line,
    run_dplaunch,
    spy_environment,
    train,
    train_losses,
    write_config,
)

# fp32 on CPU: the sp slices sum their losses in another order than one rank does
TOLERANCE = 1e-5
SEQUENCE = 256


def _tiny_model() -> dict:
    model = yaml.safe_load(TINY_LLAMA.read_text())["model"]["config"]
    return {**model, "num_hidden_layers": 2, "max_position_embeddings": SEQUENCE}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sequence-parallel")


@pytest.fixture(scope="module")
def long_config(runs) -> Path:
    """The tiny Llama as a causal LM on packed blocks of 256 tokens, 3 steps of 4 samples,
    evaluated before the first step and after the last."""
    return write_config(
        runs / "long.yaml",
        model={"config": _tiny_model()},
        data={"max_length": SEQUENCE},
        train={"max_steps": 3, "global_batch_size": 4, "micro_batch_size": 2, "eval_every": 3},
    )


def evaluations(run: Path) -> list[tuple[int, float, float]]:
    return [
        (r["step"], r["eval_loss"], r["eval_token_accuracy"])
        for r in read_metrics(run)
        if r["type"] == "eval"
    ]


def assert_same_evaluations(run: Path, reference: Path, steps: list[int]) -> None:
    """The evaluations of RUN at STEPS are REFERENCE's: loss to fp32 rounding, accuracy to one
    token in ten thousand (an argmax tie may break the other way)."""
    ours = evaluations(run)
    theirs = [e for e in evaluations(reference) if e[0] in steps]
    assert [e[0] for e in ours] == [e[0] for e in theirs] == steps, (ours, theirs)
    for (_, loss, accuracy), (_, loss_ref, accuracy_ref) in zip(ours, theirs, strict=True):
        assert loss == pytest.approx(loss_ref, rel=TOLERANCE), (ours, theirs)
        assert accuracy == pytest.approx(accuracy_ref, abs=1e-4), (ours, theirs)


@pytest.fixture(scope="module")
def ddp_run(runs, long_config) -> Path:
    """The reference: plain DDP on 2 ranks (dp 2), each rank whole sequences; a checkpoint at 2."""
    run = runs / "ddp"
    train(run, "--cpu", "--gpus", "2", "--set", "train.checkpoint_every=2", config=long_config)
    return run


@pytest.fixture(scope="module")
def sp_verify(runs, long_config, ddp_run) -> tuple[Path, str]:
    """`dplaunch verify` of sp 2 on 2 ranks (dp 1) against the DDP run: the plan run and its output."""
    out = runs / "verify"
    flags = ("--cpu", "--gpus", "2", "--sp", "2", "--steps", "3", "--reference", ddp_run)
    result = run_dplaunch(
        "verify", long_config, *flags, "-o", out, timeout=600, env=spy_environment(out / "plan")
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out / "plan", result.stdout


@pytest.mark.multiprocess
def test_sp2_gives_ddp_losses_and_verify_says_so(ddp_run, sp_verify):
    run, output = sp_verify
    header = read_metrics(run)[0]
    assert (header["data_parallel_size"], header["sequence_parallel_size"]) == (1, 2)
    assert header["gradient_accumulation_steps"] == 2  # micro 2 × accum 2 × dp 1 = 4 samples
    assert "mesh: dp 1 × sp 2 × tp 1 × pp 1 = 2 ranks" in output
    assert "sequence-parallel groups: [[0, 1]]" in output
    # Ulysses' all-to-alls and position gathers, every layer and micro-batch: the forecast's
    assert_forecast_collectives(run)
    reference = train_losses(ddp_run)
    assert len(reference) == 3 and reference[-1] < reference[0]
    assert max_relative_gap(train_losses(run), reference) < TOLERANCE, (
        train_losses(run),
        reference,
    )
    assert "DDP dp 1 × sp 2 vs DDP (2 ranks" in output
    # each rank evaluated its slice of every sequence (Ulysses in evaluation too): DDP's numbers
    assert "slice 0 of each sequence, in training and evaluation" in output
    assert_same_evaluations(run, ddp_run, [0, 3])
    assert "verify: PASS" in output
    exported = load_file(str(run / "model" / "model.safetensors"))
    reference_weights = load_file(str(ddp_run / "model" / "model.safetensors"))
    assert exported.keys() == reference_weights.keys()
    for name in exported:
        torch.testing.assert_close(
            exported[name], reference_weights[name], rtol=1e-4, atol=1e-5, msg=name
        )


@pytest.mark.multiprocess
def test_a_dp2_checkpoint_resumes_on_sp2(runs, long_config, ddp_run):
    # DDP's step-2 checkpoint continued for step 3 by an sp 2 run: DDP's step 3 and weights
    checkpoint = ddp_run / "checkpoints" / "step-2"
    run = runs / "resumed-sp2"
    result = train(
        run, "--cpu", "--gpus", "2", "--sp", "2", "--resume", checkpoint, config=long_config
    )
    assert "DDP dp 2 → DDP dp 1 × sp 2: the checkpoint loads as it is" in result.stdout
    assert "Ulysses over 2 ranks" in result.stdout
    assert [r["step"] for r in read_metrics(run) if r["type"] == "train"] == [3]
    assert train_losses(run)[0] == pytest.approx(train_losses(ddp_run)[2], rel=TOLERANCE)
    assert_same_evaluations(run, ddp_run, [3])
    exported = load_file(str(run / "model" / "model.safetensors"))
    reference = load_file(str(ddp_run / "model" / "model.safetensors"))
    for name in reference:
        torch.testing.assert_close(exported[name], reference[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.multiprocess
def test_packed_sft_on_sp2_by_dp2_with_zero3_and_tiling_gives_one_rank_losses(runs):
    # packed chat examples (position ids restart per example, answers only trained): every example
    # attends only to itself across the two slices; ZeRO-3 partitions over all 4 ranks; the tiled
    # MLP and tiled logits + loss (2 tiles per slice) and activation checkpointing (the layers
    # recomputed in the backward mask the gathered rows as their forward did) change no number.
    # The reference: one rank
    config = write_config(
        runs / "sft.yaml",
        SFT_CONFIG,
        model={"config": _tiny_model()},
        data={"eval_dataset": None},
        train={
            "sample_prompts": None,
            "eval_every": None,
            "log_every": 1,
            "max_steps": 3,
            "global_batch_size": 12,
            "micro_batch_size": 3,
        },
    )
    one, tiled = runs / "sft-1", runs / "sft-sp2-dp2-zero3-tiled"
    train(one, "--cpu", "--gpus", "1", config=config)
    flags = ("--cpu", "--gpus", "4", "--sp", "2", "--zero", "3", "--set", "train.tiled_mlp=true",
             "--set", "model.gradient_checkpointing=true")  # fmt: skip
    result = train(tiled, *flags, "--set", "train.checkpoint_every=3", config=config)
    assert "DEEPSPEED" in result.stdout and "tiled MLP: 2 tiles" in result.stdout
    # the tiled loss is the chunked loss, recomputed per chunk under ZeRO-3's partitioned head
    assert "chunked loss: the head and the loss 256 tokens at a time (each chunk recomputed)" in (
        result.stdout
    )
    assert "sequence-parallel groups: [[0, 1], [2, 3]]" in result.stdout
    header = read_metrics(tiled)[0]
    assert (header["world_size"], header["data_parallel_size"]) == (4, 2)
    assert (header["sequence_parallel_size"], header["zero_stage"]) == (2, 3)
    assert len(train_losses(one)) == 3
    assert max_relative_gap(train_losses(tiled), train_losses(one)) < TOLERANCE, (
        train_losses(tiled),
        train_losses(one),
    )
    # the ZeRO-3 shards of 4 ranks (dp 2 × sp 2) export offline to the weights the run exported
    checkpoint = tiled / "checkpoints" / "step-3"
    exported = run_dplaunch("export", checkpoint, "--out", runs / "sft-export")
    assert exported.returncode == 0, exported.stderr[-3000:]
    offline = load_file(str(runs / "sft-export" / "model.safetensors"))
    online = load_file(str(tiled / "model" / "model.safetensors"))
    assert offline.keys() == online.keys()
    for name in online:
        torch.testing.assert_close(offline[name], online[name], msg=name)


@pytest.mark.parametrize(
    "flags,expected",
    [
        (["--gpus", "8", "--sp", "8"], "sp 8 does not divide the model's 4 attention heads"),
        (["--gpus", "4", "--sp", "2", "--tp", "2"], "Ulysses and AutoTP both split"),
        (
            ["--gpus", "2", "--sp", "2", "--set", "data.max_length=65"],
            "data.max_length: 65 tokens do not split evenly over sp 2 ranks",
        ),
        (
            ["--gpus", "2", "--sp", "2", "--set", "model.attn_implementation=eager"],
            "model.attn_implementation: eager attention",
        ),
    ],
)
def test_layouts_sequence_parallelism_cannot_run_are_refused_before_launch(
    tmp_path, flags, expected
):
    result = run_dplaunch("train", TINY_LLAMA, "--cpu", *flags, "-o", tmp_path / "run")
    refusal_line(result, expected)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "dims,task,expected",
    [
        (dict(world_size=3, sp=2), "causal-lm", "parallel.sp: sp 2 does not divide 3 GPUs"),
        (dict(world_size=4, pp=2, sp=2), "causal-lm", "the pipeline engine runs its own"),
        (dict(world_size=2, sp=2, fsdp="full"), "causal-lm", "sp 2 with FSDP: the FSDP engine"),
        (dict(world_size=2, sp=2), "sequence-classification", "sp 2) trains causal LMs"),
        (dict(world_size=2, sp=2, family="gpt2"), "causal-lm", "llama, mistral, qwen2, qwen3"),
    ],
)
def test_the_rules_refuse_what_ulysses_cannot_split(dims, task, expected):
    from dplaunch.errors import UserError
    from dplaunch.planning.model_facts import ModelFacts
    from dplaunch.planning.rules import ParallelDims

    family = dims.pop("family", "llama")
    model = ModelFacts(family, 2, 4, 2, 64, 128, 259, 256, False, {})
    with pytest.raises(UserError) as refused:
        ParallelDims(gpus_per_node=dims["world_size"], **dims).check(model, task)
    assert expected in str(refused.value)


def test_sp_divides_the_attention_heads_and_the_kv_heads():
    from dplaunch.errors import UserError
    from dplaunch.planning.model_facts import ModelFacts
    from dplaunch.planning.rules import check_sequence_parallel_model

    def facts(heads: int, kv: int) -> ModelFacts:
        return ModelFacts("llama", 2, heads, kv, 64, 128, 259, 256, False, {})

    check_sequence_parallel_model(2, facts(8, 4), "sft")  # 4 heads and 2 KV heads a rank
    with pytest.raises(UserError, match="sp 4 does not divide the model's 2 KV heads"):
        check_sequence_parallel_model(4, facts(8, 2), "causal-lm")


def test_mesh_puts_each_sequence_parallel_group_on_consecutive_ranks():
    from dplaunch.planning.rules import ParallelDims

    mesh = ParallelDims(8, 8, sp=4).mesh
    assert (mesh.data_parallel_size, mesh.world_size) == (2, 8)
    assert mesh.sequence_parallel_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # (stage, data-parallel rank, tensor-parallel rank) and the slice each rank holds
    assert [mesh.coordinates(r) for r in (0, 3, 4, 7)] == [(0, 0, 0), (0, 0, 0), (0, 1, 0)] + [
        (0, 1, 0)
    ]
    assert [mesh.sequence_parallel_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert mesh.rank_of(0, 1, 0, sp_rank=2) == 6


def test_a_zero_checkpoint_changes_shards_only_when_dp_times_sp_does():
    from types import SimpleNamespace

    from dplaunch.launching.resume import check_layout
    from tests.helpers import plan_for

    def plan(dp: int, sp: int):
        return plan_for(dp * sp, cpu=True, zero_stage=2, sp=sp, global_batch_size=8)

    info = SimpleNamespace(path=Path("ckpt"), name="ckpt", meta={"size_bytes": 0})
    # 4 ZeRO shards either way: dp and sp traded, loaded as they are
    assert check_layout(plan(2, 2).to_dict(), plan(4, 1).dims, "no", info)[0] is False
    # same dp, sp 2 → 1: 4 shards → 2, converted through the universal form
    convert, notes = check_layout(plan(2, 2).to_dict(), plan(2, 1).dims, "no", info)
    assert convert and "(other ZeRO partitions)" in notes[0], notes


# -- memory: what a rank keeps, what the plan says ------------------------------------------------


@pytest.mark.multiprocess
def test_sp2_halves_the_activations_a_rank_keeps_as_the_estimate_says(tmp_path):
    # 2 real ranks, fp32 Llama layer (hidden 128, MLP 344), 2 × 256 tokens: one layer's saved
    # activations with whole sequences, then with Ulysses' half of each; the same for packed
    # rows; the dtypes of the all-to-alls under autocast (tests/sequence_memory_probe.py)
    import json
    import subprocess
    import sys

    from tests.helpers import REPO, child_environment

    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        + ["--master_port", "29623", str(REPO / "tests" / "sequence_memory_probe.py")],
        env=child_environment(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("MEMORY "))
    measured = json.loads(line.removeprefix("MEMORY "))
    # measured on this machine: 5,451,776 and 2,856,960 bytes (0.52: the gathered position ids
    # and Ulysses' own copies of q, k, v around its all-to-alls)
    assert 0.45 < measured["sp_layer"] / measured["sp1_layer"] < 0.56, measured

    from dplaunch.planning.estimate import activation_bytes_per_layer, count_parameters
    from dplaunch.planning.model_facts import ModelFacts
    from tests.sequence_memory_probe import MICRO_BATCH, SEQ_LEN, SHAPE

    count = count_parameters(ModelFacts.from_config_dict(SHAPE))
    for sp, key in ((1, "sp1_layer"), (2, "sp_layer")):
        estimated = activation_bytes_per_layer(
            count,
            micro_batch=MICRO_BATCH,
            seq_len=SEQ_LEN // sp,
            mixed_precision="no",
            attention_scores=False,
        )
        assert measured[key] == pytest.approx(estimated, rel=0.10), (sp, measured, estimated)

    # packed rows: without sp SDPA turns transformers' boolean mask into an additive one in every
    # layer and keeps each; under sp the additive mask of the gathered rows is built once a
    # forward, whatever the layers (before: built, and kept, in every layer: +524,288 B a layer)
    from dplaunch.planning.estimate import packed_mask_bytes

    assert measured["sp_packed_layer"] == measured["sp_layer"], measured
    assert measured["sp1_packed_layer"] > measured["sp1_layer"], measured
    for sp, key in ((1, "sp1_packed_mask"), (2, "sp_packed_mask")):
        # measured: 1,114,112 (2 layers) and 524,288 bytes
        estimated = packed_mask_bytes(MICRO_BATCH, SEQ_LEN, 2, sp, 4, checkpointed=False)
        assert measured[key] == pytest.approx(estimated, rel=0.10), (sp, measured, estimated)
    # DDP + bf16 autocast: RoPE's fp32 cos/sin promote q and k; they move in v's bf16 (before:
    # float32 too, 1.5 times the traffic)
    assert measured["all_to_all_dtypes"] == ["bfloat16"], measured


def test_rows_of_one_sequence_take_the_mask_free_causal_kernel_and_packed_rows_one_mask():
    # the gathered rows' mask is decided before the forward, outside train.compile's graph
    # (where transformers cannot tell rows of one sequence and would mask every row L × L):
    # none for rows of one sequence, so SDPA runs its causal kernel; one for packed rows, causal
    # inside each example and closed across examples
    from dplaunch.train.sequence_parallel import SequenceShards, UlyssesAttention

    attention = UlyssesAttention(core=None, kernel_name="sdpa", config=None, group=None)
    shards = SequenceShards(size=2, rank=0, pad_id=0)
    ids = torch.zeros((2, 6), dtype=torch.long)
    for rows in (
        {"input_ids": ids},
        {"input_ids": ids, "position_ids": torch.arange(6).expand(2, 6)},
    ):
        attention.prepare(shards, rows)
        assert attention.mask is None
    packed = {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)}
    attention.prepare(shards, packed)
    assert attention.mask is not None and attention.mask.shape == (2, 1, 6, 6)
    example = torch.ones(3, 3, dtype=torch.bool).tril()
    assert torch.equal(attention.mask[0, 0], torch.block_diag(example, example))
    attention.release()
    assert attention.mask is None


def test_packed_rows_under_sdpa_are_charged_their_masks_whole_length_with_or_without_sp():
    # a 7B at 32K tokens of packed examples: without sp, 32 layers each keep a 2 GiB mask in
    # bf16; with sp 8 one mask of the whole row (not divided by sp) serves every layer
    from dplaunch.planning.estimate import estimate_memory
    from dplaunch.planning.model_facts import ModelFacts
    from dplaunch.planning.workload import Workload
    from tests.helpers import ranks

    facts = ModelFacts.from_config_dict(LLAMA_7B)
    packed = Workload(mixed_precision="bf16", seq_len=32768, packed=True)
    per_mask = 32768**2 * 2 / 2**30
    masks = estimate_memory(facts, ranks(dp=8, zero_stage=3), packed).mask_gb
    assert masks == pytest.approx(32 * per_mask)
    masks = estimate_memory(facts, ranks(sp=8, zero_stage=3), packed).mask_gb
    assert masks == pytest.approx(per_mask)
    rows = Workload(mixed_precision="bf16", seq_len=32768)  # one sequence a row: none
    assert estimate_memory(facts, ranks(dp=8, zero_stage=3), rows).mask_gb == 0
    flash = Workload(mixed_precision="bf16", seq_len=32768, packed=True,
                     attn_implementation="flash_attention_2")  # fmt: skip
    assert estimate_memory(facts, ranks(dp=8, zero_stage=3), flash).mask_gb == 0  # varlen


def test_the_estimate_splits_activations_and_logits_by_sp_and_zero_states_by_dp_times_sp():
    from dplaunch.planning.estimate import estimate_memory
    from dplaunch.planning.model_facts import ModelFacts
    from dplaunch.planning.workload import Workload
    from tests.helpers import ranks

    facts = ModelFacts.from_config_dict(LLAMA_7B)
    workload = Workload(mixed_precision="bf16", seq_len=32768)
    whole = estimate_memory(facts, ranks(dp=8, zero_stage=3), workload)
    split = estimate_memory(facts, ranks(dp=4, sp=2, zero_stage=3), workload)
    assert split.activations_gb == pytest.approx(whole.activations_gb / 2)
    assert split.logits_gb == pytest.approx(whole.logits_gb / 2)
    # ZeRO-3 over 4 dp × 2 sp ranks holds what it holds over 8 dp ranks
    assert split.model_states_gb == pytest.approx(whole.model_states_gb)


def test_auto_splits_sequences_only_when_activations_do_not_fit(tmp_path):
    # a 7B Llama on 8 × 80 GB, activation checkpointing: at 64K tokens ZeRO-3 fits, at 256K no
    # data-parallel plan does, and sp 4 is the least sequence splitting that fits (sp 2 does not)
    from dplaunch.config.load import build_run_config
    from dplaunch.planning.auto import resolve_auto_parallel
    from dplaunch.planning.model_facts import ModelFacts
    from dplaunch.planning.plan import Machine

    facts = ModelFacts.from_config_dict(LLAMA_7B)
    data = yaml.safe_load(TINY_LLAMA.read_text())
    data["model"]["config"] = dict(LLAMA_7B)
    data["model"]["gradient_checkpointing"] = True
    # the full logits (train.loss_chunk auto would chunk them: see the end)
    data["train"].update(
        global_batch_size=8, micro_batch_size=1, mixed_precision="bf16", loss_chunk="off"
    )
    data["parallel"] = "auto"
    picked = {}
    for length in (65536, 262144):
        data["data"]["max_length"] = length
        config = build_run_config(
            data, assignments=["launch.gpus=8", "launch.gpu_memory_gb=80"], base_dir=tmp_path
        )
        choice = resolve_auto_parallel(config, facts, Machine())
        p = choice.parallel
        picked[length] = (p.zero_stage, p.sp, p.tp, p.pp)
        table = {(c.zero_stage, c.offload, c.sp): c for c in choice.candidates if c.tp * c.pp == 1}
    assert picked == {65536: (3, 1, 1, 1), 262144: (3, 4, 1, 1)}
    assert not table[3, "none", 2].fits and table[3, "none", 4].fits
    assert "the activations are the problem, and sp 4 is the least" in choice.note
    # with the chunked loss (auto) the 256K tokens' logits (6.2 GiB a rank under sp 4) are one
    # chunk's: sp 2 fits
    data["train"]["loss_chunk"] = "auto"
    config = build_run_config(
        data, assignments=["launch.gpus=8", "launch.gpu_memory_gb=80"], base_dir=tmp_path
    )
    chunked = resolve_auto_parallel(config, facts, Machine()).parallel
    assert (chunked.zero_stage, chunked.sp) == (3, 2)


def test_plan_with_seq_len_lists_the_sequence_parallel_rows(tmp_path):
    import json

    config_json = tmp_path / "llama-7b" / "config.json"
    config_json.parent.mkdir()
    config_json.write_text(json.dumps(LLAMA_7B))
    flags = ["--model", config_json.parent, "--gpus", "8", "--gpu-memory", "80"]
    result = run_dplaunch("plan", *flags, "--seq-len", "131072", "--activation-checkpointing")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if "+ sp " in line]
    assert {line.split("+ sp ")[1].split()[0] for line in rows} == {"2", "4", "8"}
    marked = [line for line in result.stdout.splitlines() if line.startswith("* ")]
    assert marked[0].startswith("* ZeRO-3 + sp 2 ") and marked[0].endswith("yes")
    # without --seq-len the table is the one it was
    plain = run_dplaunch("plan", *flags)
    assert plain.returncode == 0 and "+ sp" not in plain.stdout


def test_zero3_builds_each_ranks_partition_over_dp_times_sp_in_host_memory():
    # the host-RAM check before launch: ZeRO-3's zero.Init builds 1/(dp × sp) of the model a rank
    from dplaunch.planning.model_facts import ModelFacts
    from dplaunch.planning.plan import check_host_memory
    from dplaunch.planning.rules import ParallelDims

    facts = ModelFacts.from_config_dict(LLAMA_7B)
    # 8 ranks a node: dp 8, dp 4 × sp 2, dp 4
    layouts = (ParallelDims(8, 8, zero_stage=3), ParallelDims(8, 8, zero_stage=3, sp=2))
    layouts += (ParallelDims(4, 8, zero_stage=3),)
    lines = [
        check_host_memory(facts, dims, "bf16", "causal-lm", 10.0, refuse=False) for dims in layouts
    ]
    assert lines[0] == lines[1] != lines[2]
