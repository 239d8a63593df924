"""A model.lora the ranks could not train is refused before launch: one line naming the key and the
fix, exit code 2, nothing written. The cases run the command line in this process
(tests/helpers.run_cli), one of them as a process too."""

from __future__ import annotations

import pytest

from tests.helpers import (
    TINY_LLAMA,
    child_environment,
    files_under,
    refusal_line,
    run_cli,
    run_dplaunch,
)

TRAIN = ["train", TINY_LLAMA, "--cpu"]
QUANTIZE_4BIT = "model.lora.quantize=4bit"

CASES = [
    (
        "lora-with-tensor-parallelism",
        [*TRAIN, "--gpus", "2", "--lora", "4", "--tp", "2"],
        "model.lora: LoRA with tensor parallelism (tp 2)",
    ),
    (
        "lora-with-pipeline-parallelism",
        [*TRAIN, "--gpus", "2", "--lora", "4", "--pp", "2"],
        "model.lora: LoRA with pipeline parallelism (pp 2)",
    ),
    (
        "lora-with-sequence-parallelism",
        [*TRAIN, "--gpus", "2", "--lora", "4", "--sp", "2"],
        "model.lora: LoRA with sequence parallelism (sp 2)",
    ),
    (
        "qlora-with-fsdp",
        [*TRAIN, "--gpus", "2", "--lora", "4", "--fsdp", "full", "--set", QUANTIZE_4BIT],
        "model.lora.quantize: 4bit (QLoRA) with FSDP",
    ),
    (
        "rank-as-large-as-the-model",
        [*TRAIN, "--lora", "64"],
        "model.lora.r: rank 64 is not below the model's hidden size 64",
    ),
    (
        "rank-zero",
        [*TRAIN, "--lora", "0"],
        "model.lora.r",
    ),
    (
        "target-module-the-model-lacks",
        [*TRAIN, "--lora", "4", "--set", "model.lora.target_modules=[q_proj, query_key_value]"],
        "model.lora.target_modules: query_key_value names no linear or embedding layer of a llama",
    ),
    (
        "a-norm-as-target-module",
        [*TRAIN, "--lora", "4", "--set", "model.lora.target_modules=[input_layernorm]"],
        "model.lora.target_modules: input_layernorm names no linear or embedding layer",
    ),
    (
        "no-target-module",
        [*TRAIN, "--lora", "4", "--set", "model.lora.target_modules=[]"],
        "model.lora.target_modules: the list is empty",
    ),
    (
        "module-to-save-the-model-lacks",
        [*TRAIN, "--lora", "4", "--set", "model.lora.modules_to_save=[classifier]"],
        "model.lora.modules_to_save: classifier names no module of a llama model",
    ),
    (
        "quantized-random-init-model",
        [*TRAIN, "--lora", "4", "--set", "model.lora.quantize=4bit"],
        "model.lora.quantize: bitsandbytes quantizes a pretrained model's weights",
    ),
    (
        "quantize-to-an-unknown-width",
        [*TRAIN, "--lora", "4", "--set", "model.lora.quantize=2bit"],
        "model.lora.quantize",
    ),
    (
        "dropout-of-one",
        [*TRAIN, "--lora", "4", "--set", "model.lora.dropout=1.0"],
        "model.lora.dropout",
    ),
    (
        "alpha-zero",
        [*TRAIN, "--lora", "4", "--set", "model.lora.alpha=0"],
        "model.lora.alpha",
    ),
    (
        "misspelt-lora-key",
        [*TRAIN, "--set", "model.lora.rank=8"],
        "model.lora.rank",
    ),
]


@pytest.mark.parametrize("argv,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_lora_input_is_one_line_exit_2_and_nothing_written(tmp_path, argv, expected):
    before = files_under(tmp_path)
    result = run_cli(*argv, "-o", tmp_path / "run", env=child_environment(), timeout=120)
    refusal_line(result, expected)
    assert files_under(tmp_path) == before, "something was written"


def test_a_bad_lora_in_a_process_is_one_line_and_no_traceback(tmp_path):
    [(argv, expected)] = [c[1:] for c in CASES if c[0] == "target-module-the-model-lacks"]
    result = run_dplaunch(*argv, "-o", tmp_path / "run", timeout=120)
    refusal_line(result, expected)
    assert not (tmp_path / "run").exists()


def test_qlora_without_bitsandbytes_names_the_extra_to_install():
    from dplaunch.config.schema import ModelConfig
    from dplaunch.errors import UserError
    from dplaunch.planning.lora_check import check_lora
    from dplaunch.planning.model_facts import ModelFacts
    from dplaunch.planning.rules import ParallelDims

    model = ModelConfig(name_or_path="some/model", lora={"r": 8, "quantize": "4bit"})
    facts = ModelFacts.from_config_dict({"model_type": "llama", "hidden_size": 64})
    check_lora(model, facts, ParallelDims(1, 1), installed=lambda: True)
    with pytest.raises(UserError) as refused:
        check_lora(model, facts, ParallelDims(1, 1), installed=lambda: False)
    assert refused.value.field == "model.lora.quantize"
    assert "pip install 'dplaunch[qlora]'" in refused.value.fix


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gpt2"])
def test_the_module_names_checked_before_launch_are_the_hf_classes(model_type):
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from dplaunch.planning.lora_check import OTHER_MODULES, adaptable_names, head_name
    from dplaunch.planning.model_facts import ModelFacts

    config = AutoConfig.for_model(
        model_type,
        hidden_size=32,
        n_embd=32,
        intermediate_size=64,
        num_hidden_layers=1,
        n_layer=1,
        num_attention_heads=2,
        n_head=2,
        num_key_value_heads=1,
        vocab_size=64,
    )
    for auto, task in (
        (AutoModelForCausalLM, "causal-lm"),
        (AutoModelForSequenceClassification, "sequence-classification"),
    ):
        with torch.device("meta"):
            model = auto.from_config(config)
        leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}
        leaves = {leaf for leaf in leaves if not leaf.isdigit()}
        linear, embeddings = adaptable_names(ModelFacts.from_config_dict(config.to_dict()), task)
        others = OTHER_MODULES[model_type]
        assert leaves == {*linear, *embeddings, *others, head_name(task)}, (task, leaves)
        adapted = {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
        }
        assert adapted == {*linear, head_name(task)}


def test_the_catalogue_is_large_enough():
    assert len(CASES) >= 12
