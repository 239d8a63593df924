"""Planning and rendering, as users describe their runs. Pure: no process is started."""

from __future__ import annotations

import json

import pytest
import yaml

from dplaunch.config.schema import LaunchConfig, ParallelConfig, TrainConfig
from dplaunch.errors import UserError
from dplaunch.planning.mesh import Mesh
from dplaunch.planning.model_facts import ModelFacts
from dplaunch.planning.plan import Machine, ModelChoices, batch_math, make_plan
from dplaunch.planning.rules import ParallelDims
from dplaunch.planning.workload import Workload
from dplaunch.rendering.accelerate_config import accelerate_config_dict, render_accelerate_config
from dplaunch.rendering.deepspeed_config import deepspeed_config_dict
from tests.helpers import LLAMA, TINY_LLAMA, plan_for, run_cli

BERT = ModelFacts.from_config_dict(
    {
        "model_type": "bert",
        "hidden_size": 384,
        "num_hidden_layers": 6,
        "num_attention_heads": 12,
        "vocab_size": 30522,
    }
)


def test_16_gpus_zero2_global_512_micro_8_gives_grad_accum_4():
    plan = plan_for(
        gpus=16, render_only=True, zero_stage=2, global_batch_size=512, micro_batch_size=8
    )
    assert (plan.world_size, plan.data_parallel_size, plan.gradient_accumulation_steps) == (
        16,
        16,
        4,
    )
    assert plan.engine == "deepspeed"
    assert plan.batch_line() == "micro batch 8 × grad-accum 4 × dp 16 = global batch 512"


def test_the_global_batch_is_kept_when_the_gpu_count_changes():
    for gpus, accumulation in ((1, 8), (2, 4), (4, 2), (8, 1)):
        plan = plan_for(gpus=gpus, visible=8, global_batch_size=64, micro_batch_size=8)
        assert plan.gradient_accumulation_steps == accumulation
        assert plan.micro_batch_size * accumulation * plan.data_parallel_size == 64


def test_a_batch_that_does_not_divide_names_the_three_numbers_and_the_nearest_valid_ones():
    with pytest.raises(UserError) as caught:
        plan_for(gpus=3, visible=4, global_batch_size=32, micro_batch_size=4)
    line = caught.value.line()
    assert "global batch 32" in line and "micro batch 4" in line and "data-parallel size 3" in line
    assert "24 or 36" in line


def test_without_a_micro_batch_the_planner_picks_the_largest_that_divides():
    assert batch_math(96, None, 4) == (8, 3)
    assert batch_math(12, None, 4) == (3, 1)


def test_no_gpu_visible_runs_cpu_ranks_on_gloo_and_says_so():
    plan = plan_for(gpus=2, visible=0)
    assert plan.target == "cpu" and plan.backend == "gloo" and plan.world_size == 2
    assert any("CPU rank" in note for note in plan.notes)


def test_more_gpus_than_visible_on_one_node_points_to_nodes_and_slurm():
    with pytest.raises(UserError) as caught:
        plan_for(gpus=16, visible=8)
    assert "--nodes" in caught.value.line() and "slurm" in caught.value.line()


def test_config_renders_a_16_gpu_cluster_on_a_laptop():
    plan = plan_for(gpus=16, visible=0, render_only=True, nodes=4)
    assert (plan.target, plan.num_nodes, plan.processes_per_node) == ("gpu", 4, 4)
    config = accelerate_config_dict(plan)
    assert config["distributed_type"] == "MULTI_GPU"
    assert (config["num_processes"], config["num_machines"], config["use_cpu"]) == (16, 4, False)


def test_gpus_per_node_derives_the_node_count():
    plan = plan_for(gpus=16, render_only=True, gpus_per_node=8)
    assert (plan.num_nodes, plan.processes_per_node) == (2, 8)


def test_mesh_layout_tp_fastest_then_dp_then_pp():
    # (tp × pp is a rank layout the mesh lays out, though no engine composes the two)
    mesh = Mesh(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert mesh.world_size == 8
    assert mesh.tensor_parallel_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.pipelines() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.data_parallel_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.coordinates(5) == (1, 0, 1)


def test_impossible_mesh_is_refused():
    with pytest.raises(UserError, match="does not divide 6 GPUs"):
        ParallelDims(6, 6, tp=4)


LLAMA_6_LAYERS = ModelFacts.from_config_dict(
    {**LLAMA.raw, "num_hidden_layers": 6, "num_key_value_heads": 4}
)


def test_tp_4_on_two_nodes_of_6_gpus_is_refused_because_a_tp_group_would_span_both():
    # ranks 4-7 would form a tensor-parallel group on node 0 (ranks 0-5) and node 1
    with pytest.raises(UserError, match="does not divide the 6 GPUs of a node"):
        plan_for(
            gpus=12, nodes=2, render_only=True, tp=4, global_batch_size=48, model=LLAMA_6_LAYERS
        )


@pytest.mark.parametrize(
    "gpus, nodes, task",
    [(12, 2, "causal-lm"), (4, 1, "causal-lm"), (4, 1, "sft"), (4, 1, "sequence-classification")],
)
def test_the_plan_and_the_plan_table_allow_the_same_tp_and_pp(gpus, nodes, task):
    """6 layers on 4 stages and pipelined SFT run; tp 4 on nodes of 6 GPUs does not: both agree."""
    from dplaunch.planning.candidates import candidate_plans

    table = candidate_plans(
        LLAMA_6_LAYERS,
        Workload(micro_batch=1, seq_len=64, mixed_precision="bf16", task=task),
        gpus=gpus,
        gpus_per_node=gpus // nodes,
        gpu_memory_gb=80,
    )
    listed = {(c.tp, c.pp) for c in table}
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4):
            try:
                make_plan(
                    LaunchConfig(gpus=gpus, nodes=nodes),
                    ParallelConfig(tp=tp, pp=pp),
                    TrainConfig(global_batch_size=48),
                    Machine(render_only=True),
                    LLAMA_6_LAYERS,
                    ModelChoices(task),
                )
                planned = True
            except UserError:
                planned = False
            assert planned == ((tp, pp) in listed), (tp, pp)
    assert ((1, 4) in listed) == (gpus % 4 == 0 and task != "sequence-classification")


def test_tp_must_divide_the_kv_heads():
    with pytest.raises(UserError, match="2 KV heads"):
        plan_for(gpus=4, visible=4, tp=4, model=LLAMA)


def test_pipeline_with_zero2_is_refused_up_front():
    with pytest.raises(UserError, match="pipeline"):
        plan_for(gpus=2, visible=2, pp=2, zero_stage=2, model=LLAMA)


def test_pipeline_needs_a_supported_family():
    with pytest.raises(UserError, match="supported: llama"):
        plan_for(gpus=2, visible=2, pp=2, model=BERT)


def test_pipeline_stages_are_balanced_by_parameters():
    plan = plan_for(gpus=2, visible=2, pp=2, model=LLAMA)
    assert len(plan.stage_layers) == 2
    assert plan.stage_layers[0].startswith("embeddings, blocks 0-")
    assert "lm_head" in plan.stage_layers[1]


def test_offload_needs_zero():
    with pytest.raises(UserError, match="offload"):
        plan_for(gpus=2, visible=2, offload="optimizer")


def test_fp16_on_cpu_ranks_is_refused():
    with pytest.raises(UserError, match="fp16"):
        plan_for(gpus=2, visible=0, mixed_precision="fp16")


def test_deepspeed_json_states_the_batch_trio_explicitly():
    plan = plan_for(
        gpus=16,
        render_only=True,
        zero_stage=3,
        offload="all",
        global_batch_size=512,
        micro_batch_size=8,
    )
    config = deepspeed_config_dict(plan, max_grad_norm=1.0)
    assert (
        config["train_batch_size"],
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
    ) == (512, 8, 4)
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert config["gradient_clipping"] == 1.0
    # Accelerate keeps dplaunch's DeepSpeedCPUAdam (AdamW mode) instead of building its own
    assert config["zero_force_ds_cpu_optimizer"] is False
    assert "auto" not in json.dumps(config)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_under_zero_accumulates_and_reduces_gradients_in_fp32_as_ddp_does(stage):
    plan = plan_for(gpus=8, visible=8, zero_stage=stage, mixed_precision="bf16")
    config = deepspeed_config_dict(plan, max_grad_norm=1.0)
    assert config["data_types"] == {"grad_accum_dtype": "fp32"}
    assert config["communication_data_type"] == "fp32"


def test_fp32_gradients_are_asked_for_only_where_deepspeed_accepts_them():
    # DeepSpeed 0.19 refuses bf16 weights with fp32 accumulation without ZeRO (pipeline, AutoTP)
    for plan in (
        plan_for(gpus=2, visible=2, pp=2, model=LLAMA, mixed_precision="bf16"),
        plan_for(gpus=8, visible=8, zero_stage=2, mixed_precision="fp16"),
        plan_for(gpus=8, visible=8, zero_stage=2),
    ):
        config = deepspeed_config_dict(plan, max_grad_norm=1.0)
        assert "data_types" not in config and "communication_data_type" not in config, plan


def test_tensor_parallel_batch_fields_count_every_rank_as_deepspeed_does():
    plan = plan_for(gpus=4, visible=4, tp=2, global_batch_size=16, micro_batch_size=4, model=LLAMA)
    config = deepspeed_config_dict(plan, max_grad_norm=1.0)
    assert plan.data_parallel_size == 2 and plan.gradient_accumulation_steps == 2
    # the user's global batch is micro × ga × dp = 16; DeepSpeed's assertion multiplies by all 4 ranks
    assert config["train_batch_size"] == 4 * 2 * 4
    assert config["tensor_parallel"] == {"autotp_size": 2}


def test_rendered_yaml_loads_with_accelerates_own_loader(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    for kwargs in (
        {"gpus": 2, "visible": 0},
        {"gpus": 16, "render_only": True, "nodes": 4, "zero_stage": 2},
    ):
        plan = plan_for(**kwargs)
        path = tmp_path / "accelerate.yaml"
        path.write_text(render_accelerate_config(plan, str(tmp_path / "deepspeed.json")))
        loaded = load_config_from_file(str(path))
        assert loaded.num_processes == plan.world_size
        assert loaded.num_machines == plan.num_nodes
        assert yaml.safe_load(path.read_text())["machine_rank"] == 0


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_deepspeed_json_passes_deepspeeds_own_config_class_for_the_planned_world(
    monkeypatch, zero_stage
):
    import deepspeed.comm as ds_comm
    from deepspeed.runtime.config import DeepSpeedConfig

    plan = plan_for(
        gpus=16, render_only=True, zero_stage=zero_stage, global_batch_size=256, micro_batch_size=4
    )

    class DataParallelWorld:  # what DeepSpeed asks a model-parallel unit for
        def get_data_parallel_world_size(self):
            return plan.data_parallel_size

    monkeypatch.setattr(ds_comm, "get_rank", lambda *a, **k: 0)
    checked = DeepSpeedConfig(
        deepspeed_config_dict(plan, max_grad_norm=1.0), mpu=DataParallelWorld()
    )
    assert checked.world_size == 16
    assert checked.train_batch_size == 256 and checked.gradient_accumulation_steps == 4
    assert checked.zero_optimization_stage == zero_stage
    # a wrong trio is what DeepSpeed itself rejects: prove the check can fail
    wrong = deepspeed_config_dict(plan, max_grad_norm=1.0) | {"train_batch_size": 128}
    with pytest.raises(AssertionError):
        DeepSpeedConfig(wrong, mpu=DataParallelWorld())


def gpu_plan(*, attn_implementation=None, task="causal-lm", model=LLAMA, **kwargs):
    """A GPU plan rendered here (no GPU needed) for the run file's keys in ``kwargs``."""
    launch = LaunchConfig(**{k: v for k, v in kwargs.items() if k in LaunchConfig.model_fields})
    parallel = ParallelConfig(
        **{k: v for k, v in kwargs.items() if k in ParallelConfig.model_fields}
    )
    train = TrainConfig(**{k: v for k, v in kwargs.items() if k in TrainConfig.model_fields})
    return make_plan(
        launch,
        parallel,
        train,
        Machine(render_only=True),
        model,
        ModelChoices(task, attn_implementation),
    )


@pytest.mark.parametrize("kernel", ["flash_attention_2", "flash_attention_3"])
def test_flash_attention_in_fp32_is_refused_before_launch_with_bf16_as_the_fix(kernel):
    # flash kernels take bf16/fp16 queries only: with mixed_precision no every rank failed at
    # its first forward
    with pytest.raises(UserError) as refused:
        gpu_plan(gpus=2, attn_implementation=kernel, mixed_precision="no")
    assert refused.value.field == "train.mixed_precision"
    assert f"{kernel} computes in bf16 or fp16 only" in str(refused.value)
    assert "train.mixed_precision: bf16" in refused.value.fix
    assert gpu_plan(gpus=2, attn_implementation=kernel, mixed_precision="bf16").world_size == 2


def test_flex_attention_on_cpu_ranks_is_refused_as_flash_attention_is():
    cpu = dict(launch=LaunchConfig(gpus=2, cpu=True), parallel=ParallelConfig())
    with pytest.raises(UserError, match="flex_attention has no backward on CPU"):
        make_plan(**cpu, train=TrainConfig(), machine=Machine(), model=LLAMA,
                  choices=ModelChoices(attn_implementation="flex_attention"))  # fmt: skip
    assert gpu_plan(gpus=2, attn_implementation="flex_attention", mixed_precision="bf16")


def test_sequence_parallelism_with_flex_attention_is_refused_it_would_train_non_causally():
    with pytest.raises(UserError) as refused:
        gpu_plan(gpus=2, sp=2, attn_implementation="flex_attention", mixed_precision="bf16")
    assert refused.value.field == "model.attn_implementation"
    assert "attend to later tokens" in str(refused.value)
    for kernel in (None, "sdpa", "flash_attention_2"):
        plan = gpu_plan(gpus=2, sp=2, attn_implementation=kernel, mixed_precision="bf16")
        assert plan.sequence_parallel_size == 2


def test_sequence_parallel_rows_are_not_listed_for_flex_attention():
    from dplaunch.planning.candidates import candidate_plans

    def sp_rows(kernel):
        rows = candidate_plans(LLAMA, Workload(micro_batch=1, seq_len=256, mixed_precision="bf16", attn_implementation=kernel, sequence_parallel=True), gpus=2, gpus_per_node=2, gpu_memory_gb=80)  # fmt: skip
        return [row for row in rows if row.sp > 1]

    assert sp_rows("sdpa") and not sp_rows("flex_attention")


GPT2 = ModelFacts.from_config_dict(
    {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 259}
)


def test_fsdp_with_tp_is_checked_against_the_models_tp_plan_not_autotps_families():
    # gpt2 is an AutoTP family, but FSDP × TP splits by the HF tp_plan, which GPT-2 lacks: before,
    # the plan passed and every rank failed ("GPT2LMHeadModel has no tp_plan")
    with pytest.raises(UserError) as refused:
        gpu_plan(gpus=4, fsdp="full", tp=2, model=GPT2)
    assert refused.value.field == "parallel.tp" and "base_model_tp_plan" in str(refused.value)
    assert gpu_plan(gpus=4, zero_stage=1, tp=2, model=GPT2).tensor_parallel_size == 2  # AutoTP
    assert gpu_plan(gpus=4, fsdp="full", tp=2).tensor_parallel_size == 2  # llama has one
    # and the other way round: gemma has a tp_plan FSDP × TP applies, and no AutoTP preset
    gemma = ModelFacts.from_config_dict(
        {"model_type": "gemma", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 259}
    )  # fmt: skip
    assert gpu_plan(gpus=4, fsdp="full", tp=2, model=gemma).tensor_parallel_size == 2
    with pytest.raises(UserError, match="AutoTP cannot split model type 'gemma'"):
        gpu_plan(gpus=4, zero_stage=1, tp=2, model=gemma)


def test_the_fsdp_tp_families_are_those_whose_hf_tp_plan_the_engine_applies():
    transformers = pytest.importorskip("transformers")
    from dplaunch.planning.model_facts import SDPA_FAMILIES
    from dplaunch.planning.rules import (
        AUTOTP_FAMILIES,
        FSDP_TP_FAMILIES,
        PIPELINE_FAMILIES,
        SEQUENCE_PARALLEL_FAMILIES,
    )
    from dplaunch.train.fsdp import TP_STYLES

    known = {*AUTOTP_FAMILIES, *SDPA_FAMILIES, *PIPELINE_FAMILIES, *SEQUENCE_PARALLEL_FAMILIES}
    applicable = set()
    for family in known:
        try:
            config = transformers.AutoConfig.for_model(family)
        except ValueError:  # a family this transformers no longer builds
            continue
        styles = set((getattr(config, "base_model_tp_plan", None) or {}).values())
        if styles and styles <= set(TP_STYLES):
            applicable.add(family)
    assert set(FSDP_TP_FAMILIES) == applicable


def test_fp16_with_fsdp_and_tp_is_refused_the_scalers_overflow_check_is_not_agreed_over_tp():
    with pytest.raises(UserError) as refused:
        gpu_plan(gpus=4, fsdp="full", tp=2, mixed_precision="fp16")
    assert refused.value.field == "train.mixed_precision" and "bf16" in refused.value.fix
    assert gpu_plan(gpus=4, fsdp="full", mixed_precision="fp16").engine == "fsdp"  # tp 1: fine
    assert gpu_plan(gpus=4, fsdp="full", tp=2, mixed_precision="bf16").engine == "fsdp"


def test_fsdp_offload_on_gpus_gets_a_gloo_group_beside_nccl_for_the_host_gradients():
    # with CPUOffloadPolicy the gradients are host DTensors: clipping and the fp16 scaler
    # all-reduce them, which a plain nccl group refuses ("No backend type associated with
    # device type cpu")
    offload = gpu_plan(gpus=2, fsdp="full", offload="all")
    assert offload.process_group_backend == "cuda:nccl,cpu:gloo"
    assert "backend cuda:nccl,cpu:gloo" in offload.summary_lines()[0]
    assert gpu_plan(gpus=2, fsdp="full").process_group_backend == "nccl"
    assert gpu_plan(gpus=2, zero_stage=3, offload="all").process_group_backend == "nccl"
    cpu = make_plan(LaunchConfig(gpus=2, cpu=True), ParallelConfig(fsdp="full", offload="all"),
                    TrainConfig(), Machine())  # fmt: skip
    assert cpu.process_group_backend == "gloo"


def test_a_run_shorter_than_its_warm_up_says_the_warm_up_never_ends():
    short = plan_for(gpus=2, cpu=True, max_steps=10, warmup_steps=20)
    assert any(
        "train.warmup_steps 20 is not below the run's 10 steps (train.max_steps): the warm-up "
        "never ends, the learning rate rises the whole run to 10/20 of train.lr" in note
        for note in short.notes
    ), short.notes
    assert not any(
        "warm-up" in n for n in plan_for(gpus=2, cpu=True, max_steps=30, warmup_steps=20).notes
    )


def test_hsdp_on_one_node_says_it_is_full_sharding():
    one_node = gpu_plan(gpus=4, fsdp="hybrid")
    note = "--fsdp hybrid on one node is full sharding"
    assert one_node.fsdp_shard_size == 4 and any(note in n for n in one_node.notes)
    two_nodes = gpu_plan(gpus=8, gpus_per_node=4, fsdp="hybrid")
    assert two_nodes.fsdp_shard_size == 4 and not any(note in n for n in two_nodes.notes)


def test_plan_json_rows_name_their_engine_and_fsdp_kind():
    from dplaunch.planning.candidates import Eligible, candidate_plans, to_json_rows

    rows = to_json_rows(
        candidate_plans(
            LLAMA,
            Workload(micro_batch=1, seq_len=256, mixed_precision="bf16"),
            gpus=4,
            gpus_per_node=2,
            gpu_memory_gb=80,
            eligible=Eligible(fsdp="full"),
        )  # fmt: skip
    )
    kinds = {(row["name"], row["engine"], row["fsdp"]) for row in rows}
    assert ("DDP", "ddp", None) in kinds and ("ZeRO-3", "deepspeed", None) in kinds
    assert ("FSDP", "fsdp", "full") in kinds and ("HSDP", "fsdp", "hybrid") in kinds


def cpu_profile_file(path) -> str:
    """A profile of CPU ranks (as `dplaunch calibrate --cpu --gpus 2` writes one), round numbers."""
    from dplaunch.planning.profiles import CALIBRATED, DensePoint, Link, Profile, profile_text

    link = Link(50e-6, 1e9)
    ops = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")
    profile = Profile(
        device="cpu", devices_per_node=2, nodes=1, interconnect="gloo", intra="gloo",
        source=CALIBRATED, peak_flops={"fp32": 1e10},
        dense=(DensePoint("fp32", 64, 128, 1e10),), attention=(),
        collectives={"intra": dict.fromkeys(ops, link)}, overlap=0.0,
        optimizer_s_per_param=1e-9, cpu_adam_s_per_param=1e-9, host_device_bytes_per_s=10e9,
    )  # fmt: skip
    path.write_text(profile_text(profile))
    return str(path)


def plan_rows(tmp_path, *flags: str) -> list[dict]:
    """`dplaunch plan examples/tiny-llama.yaml --gpus 2 --cpu FLAGS --json` on a CPU profile;
    every row's micro batch and accumulation checked against make_plan's for its layout (what
    `train` runs), and every forecast against the tokens a step they make."""
    profile = cpu_profile_file(tmp_path / "cpu.json")
    args = ("plan", TINY_LLAMA, "--gpus", "2", "--cpu", "--profile", profile, *flags, "--json")
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    train = dict(yaml.safe_load(TINY_LLAMA.read_text())["train"])
    for flag, key in (
        ("--micro-batch", "micro_batch_size"),
        ("--global-batch", "global_batch_size"),
    ):
        if flag in flags:
            train[key] = int(flags[flags.index(flag) + 1])
    batch = {key: train.get(key) for key in ("micro_batch_size", "global_batch_size")}
    for row in rows:
        layout = {key: row[key] for key in ("zero_stage", "offload", "tp", "pp", "sp", "fsdp")}
        # a row the tuner chose a micro batch for: what `train` runs with it (auto sets it)
        micro = {"micro_batch_size": row["settings"].get("micro_batch", batch["micro_batch_size"])}
        try:
            plan = plan_for(gpus=2, cpu=True, render_only=True, **{**batch, **micro}, **layout)
        except UserError:  # `train` refuses this layout for this batch: no forecast either
            assert row["micro_batch"] is row["step_time_s"] is None, row
            continue
        accumulation = plan.gradient_accumulation_steps
        tokens = plan.micro_batch_size * accumulation * plan.data_parallel_size * 64
        assert tokens == train["global_batch_size"] * 64
        assert row["tokens_per_s"] * row["step_time_s"] == pytest.approx(tokens, rel=1e-3), row
        assert (row["micro_batch"], row["gradient_accumulation_steps"]) == (
            plan.micro_batch_size,
            accumulation,
        )
    return rows


def test_every_row_of_the_plan_table_trains_the_runs_global_batch_a_step(tmp_path):
    # tiny-llama: global batch 8 × 64 tokens = 512 tokens a step on every layout of 2 ranks; each
    # row takes a micro batch that splits the rank's share (DDP: 4 a rank, tp 2: 8 on one dp
    # rank), the tuner's fastest with a profile, and accumulation follows
    rows = plan_rows(tmp_path)
    assert all(r["step_time_s"] is not None for r in rows)
    assert {r["micro_batch"] for r in rows if r["dp"] == 2} <= {1, 2, 4}
    # the same tokens a step everywhere: DDP's two ranks beat tp 2's one, and are recommended
    [best] = [r for r in rows if r["recommended"]]
    fitting = [r for r in rows if r["fits"] and r["fsdp"] is None]
    assert best["step_time_s"] == min(r["step_time_s"] for r in fitting)
    assert (best["engine"], best["dp"]) == ("ddp", 2)
    [tp] = [r for r in rows if (r["tp"], r["zero_stage"]) == (2, 0)]
    assert tp["step_time_s"] > best["step_time_s"]


def test_a_layout_that_cannot_split_the_global_batch_has_no_forecast_and_is_not_picked(tmp_path):
    # micro batch 4 × dp 2 does not split a global batch of 4: only the dp-1 layouts (tp 2, pp 2)
    # can train it, each 256 tokens a step
    rows = plan_rows(tmp_path, "--micro-batch", "4", "--global-batch", "4")
    assert {r["dp"] for r in rows if r["step_time_s"] is None} == {2}
    [best] = [r for r in rows if r["recommended"]]
    assert best["dp"] == 1 and best["step_time_s"] is not None
