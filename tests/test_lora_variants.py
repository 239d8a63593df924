"""The newer adapters (model.lora.use_dora, use_rslora, init): passed to peft, counted by the plan,
exported so that PeftModel.from_pretrained loads them, and refused where they cannot work. In
this process; DoRA with rsLoRA on real ranks (DDP, ZeRO-1/2/3, FSDP, resumed across them):
tests/test_layout_matrix_lora.py."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.helpers import REPO, TINY_LLAMA, refusal_line, run_cli

torch = pytest.importorskip("torch")
pytest.importorskip("peft")


def _model(**lora):
    from dplaunch.config.schema import ModelConfig

    spec = yaml.safe_load(TINY_LLAMA.read_text())["model"]
    return ModelConfig.model_validate({**spec, "lora": {"r": 4, **lora}})


def test_dora_and_rslora_reach_peft_and_the_plan_counts_doras_magnitudes():
    from dplaunch.launching.prepare import model_facts
    from dplaunch.planning.lora import count_lora
    from dplaunch.planning.workload import LoraSpec
    from dplaunch.train.lora import add_adapters
    from dplaunch.train.modeling import load_model, load_tokenizer

    model = _model(use_dora=True, use_rslora=True, init="gaussian")
    unadapted = model.model_copy(update={"lora": None})
    peft_model = add_adapters(load_model(unadapted, load_tokenizer(model), 7), model, 7)
    settings = peft_model.peft_config["default"]
    assert (settings.use_dora, settings.use_rslora, settings.init_lora_weights) == (
        True,
        True,
        "gaussian",
    )
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == pytest.approx(8 / 4**0.5)  # alpha / √r
    trained = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    counted = count_lora(model_facts(model), LoraSpec.from_config(model.lora, random_base=True))
    assert counted.trainable == trained  # lora_A, lora_B and a magnitude per output feature


def test_a_pissa_adapter_is_exported_as_a_lora_of_the_original_base_that_peft_loads(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from dplaunch.config.schema import RunConfig
    from dplaunch.train.lora import add_adapters, trained_names
    from dplaunch.train.lora_export import write_exports
    from dplaunch.train.modeling import load_model, load_tokenizer

    spec = yaml.safe_load(TINY_LLAMA.read_text())
    spec["model"]["lora"] = {"r": 4, "init": "pissa"}
    config = RunConfig.model_validate(spec)
    tokenizer = load_tokenizer(config.model)
    # the adapters as training leaves them: PiSSA's start (on the residual base), then moved
    unadapted = config.model.model_copy(update={"lora": None})
    trained = add_adapters(load_model(unadapted, tokenizer, 7), config.model, 7)
    generator = torch.Generator().manual_seed(1)
    state = {
        name: p.detach() + 0.05 * torch.randn(p.shape, generator=generator)
        for name, p in trained.named_parameters()
        if name in set(trained_names(trained))
    }
    trained.load_state_dict(state, strict=False)
    write_exports(config, "no", tokenizer, state, tmp_path / "adapter", tmp_path / "model")
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    # peft's conversion: ΔW = BA − B₀A₀, a plain LoRA of rank 2r on the untouched base
    assert (settings["r"], settings["init_lora_weights"]) == (8, True)
    base = AutoModelForCausalLM.from_pretrained(settings["base_model_name_or_path"])
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model")).eval()
    trained.eval()
    ids = torch.randint(0, 259, (2, 24), generator=generator)
    with torch.no_grad():
        expected = trained(ids).logits
        assert (adapted(ids).logits - expected).abs().max() < 1e-4
        assert (merged(ids).logits - expected).abs().max() < 1e-4


@pytest.mark.parametrize(
    "lora, task, layout, field, words",
    [
        ({"init": "pissa"}, "dpo", {}, "model.lora.init", "dpo's reference is the policy with"),
        ({"init": "olora", "use_dora": True}, None, {}, "model.lora.use_dora", "no DoRA magnitude"),
        ({"init": "pissa", "modules_to_save": ["lm_head"]}, None, {}, "model.lora.init", "lost"),
        (
            {"use_dora": True, "quantize": "4bit"},
            None,
            {"zero_stage": 3},
            "model.lora.use_dora",
            "DeepSpeed cannot gather bitsandbytes' quantized parameters",
        ),
        ({"init": "olora", "quantize": "8bit"}, None, {}, "model.lora.init", "QLoRA quantized"),
    ],
    ids=["pissa-dpo", "olora-dora", "pissa-saved-modules", "qdora-zero3", "olora-qlora"],
)
def test_an_adapter_that_cannot_work_is_refused_with_the_reason(lora, task, layout, field, words):
    from dplaunch.errors import UserError
    from dplaunch.planning.lora_check import check_lora_variant
    from dplaunch.planning.rules import ParallelDims

    model = _model(**lora)
    if task is not None:
        model = model.model_copy(update={"task": task})
    with pytest.raises(UserError) as refused:
        check_lora_variant(model, ParallelDims(world_size=2, gpus_per_node=2, **layout))
    assert refused.value.field == field and words in refused.value.problem, refused.value.line()


def test_the_refusal_is_one_line_before_anything_starts(tmp_path):
    dpo = REPO / "configs" / "dpo.yaml"
    run = tmp_path / "run"
    args = ("-o", run, "--cpu", "--gpus", "2", "--lora", "4", "--set", "model.lora.init=pissa")
    result = run_cli("train", dpo, *args)
    refusal_line(result, "model.lora.init: pissa takes the adapters' start out of the base")
    assert not run.exists()
