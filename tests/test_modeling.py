"""How the model is built for training: float32 weights, the tokenizer's token ids, and the
weight-decay groups, also when ZeRO-3 builds a pretrained model already partitioned."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from dplaunch.config.schema import ModelConfig
from dplaunch.train.modeling import load_model, load_tokenizer
from tests.helpers import one_rank_script

TINY_LLAMA_FIELDS = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 259,
    "max_position_embeddings": 64,
}


def test_a_bf16_checkpoint_is_trained_from_float32_weights(tmp_path):
    # transformers 5 keeps a checkpoint's own dtype by default: mixed precision wants fp32 masters
    spec = ModelConfig(config=TINY_LLAMA_FIELDS, tokenizer="byte-level")
    tokenizer = load_tokenizer(spec)
    saved = load_model(spec, tokenizer, seed=1).to(torch.bfloat16)
    saved.save_pretrained(tmp_path / "bf16")
    stored = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert {tensor.dtype for tensor in stored.values()} == {torch.bfloat16}
    pretrained = ModelConfig(name_or_path=str(tmp_path / "bf16"), tokenizer="byte-level")
    model = load_model(pretrained, tokenizer, seed=1)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    for (name, ours), theirs in zip(model.named_parameters(), saved.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=0, msg=name)


def test_a_model_built_from_a_config_dict_takes_its_tokenizers_token_ids():
    # GPT2Config's own ids are 50256, outside a 259-token vocabulary: generate() would never stop
    gpt2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "vocab_size": 259}
    spec = ModelConfig(config=gpt2, tokenizer="byte-level")
    tokenizer = load_tokenizer(spec)
    model = load_model(spec, tokenizer, seed=1)
    assert tokenizer.eos_token_id is not None
    for config in (model.config, model.generation_config):
        assert config.eos_token_id == tokenizer.eos_token_id
        assert config.bos_token_id == tokenizer.bos_token_id
        assert config.pad_token_id == tokenizer.pad_token_id
    # ids the run file gives are kept
    spec = ModelConfig(config={**gpt2, "eos_token_id": 7}, tokenizer="byte-level")
    assert load_model(spec, tokenizer, seed=1).config.eos_token_id == 7


ZERO3_GROUPS = """
import json, os, sys, types
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[2])
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs
from transformers import AutoModelForCausalLM
from dplaunch.train.engines import build_optimizer

def groups(model):
    optimizer = build_optimizer(
        model, types.SimpleNamespace(lr=1e-3, weight_decay=0.1),
        types.SimpleNamespace(offload="none", target="cpu"))
    return [len(group["params"]) for group in optimizer.param_groups]

whole = groups(AutoModelForCausalLM.from_pretrained(sys.argv[1]))
ds = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3},
      "zero_allow_untested_optimizer": True}
Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
            deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds))
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])  # built partitioned (zero.Init)
assert all(p.numel() == 0 for p in model.parameters()), "not partitioned"
print(json.dumps({"whole": whole, "zero3": groups(model)}))
"""


def test_zero3_keeps_weight_decay_on_a_pretrained_models_partitioned_weights(tmp_path):
    # under ZeRO-3 every parameter of a pretrained model is an empty 1-D stand-in at first
    from dplaunch.launching.ports import free_port

    spec = ModelConfig(config=TINY_LLAMA_FIELDS, tokenizer="byte-level")
    load_model(spec, load_tokenizer(spec), seed=1).save_pretrained(tmp_path / "model")
    groups = one_rank_script(ZERO3_GROUPS, str(tmp_path / "model"), str(free_port()))
    assert groups["whole"][0] > 0 and groups["zero3"] == groups["whole"], groups


def test_the_run_files_attention_kernel_reaches_the_model(tmp_path):
    # the planner's estimate counts the s×s scores only for eager: the ranks must run that kernel
    spec = ModelConfig(config=TINY_LLAMA_FIELDS, tokenizer="byte-level")
    tokenizer = load_tokenizer(spec)
    assert load_model(spec, tokenizer, seed=1).config._attn_implementation == "sdpa"
    eager = ModelConfig(
        config=TINY_LLAMA_FIELDS, tokenizer="byte-level", attn_implementation="eager"
    )
    model = load_model(eager, tokenizer, seed=1)
    assert model.config._attn_implementation == "eager"
    model.save_pretrained(tmp_path)
    pretrained = ModelConfig(
        name_or_path=str(tmp_path), tokenizer="byte-level", attn_implementation="eager"
    )
    assert load_model(pretrained, tokenizer, seed=1).config._attn_implementation == "eager"


ZERO3_RANDOM = """
import json, os, sys
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1])
import deepspeed
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs
from dplaunch.config.schema import ModelConfig
from dplaunch.train.modeling import load_model, load_tokenizer

specs = [ModelConfig(config=fields, tokenizer="byte-level") for fields in json.loads(sys.argv[2])]
whole = [dict(load_model(spec, load_tokenizer(spec), seed=3).named_parameters()) for spec in specs]
ds = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3},
      "zero_allow_untested_optimizer": True}
Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
            deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds))
report = []
for spec, reference in zip(specs, whole):
    model = load_model(spec, load_tokenizer(spec), seed=3)
    parameters = dict(model.named_parameters())
    partitioned = all(p.numel() == 0 and hasattr(p, "ds_id") for p in parameters.values())
    with deepspeed.zero.GatheredParameters(list(parameters.values())):
        differ = [name for name, p in parameters.items() if not p.equal(reference[name])]
    report.append({"partitioned": partitioned, "names": sorted(parameters) == sorted(reference),
                   "differ": differ})
print(json.dumps(report))
"""


def test_zero3_builds_a_random_model_partitioned_with_the_weights_it_has_built_whole():
    # under ZeRO-3 no rank may hold the whole model, random or pretrained (transformers' zero.Init);
    # DDP, ZeRO and the pipeline still start from the same seeded weights (tied GPT-2 included)
    from dplaunch.launching.ports import free_port
    from tests.helpers import TINY_GPT2_CONFIG

    models = [TINY_LLAMA_FIELDS, TINY_GPT2_CONFIG]
    report = one_rank_script(ZERO3_RANDOM, str(free_port()), json.dumps(models))
    assert report == [{"partitioned": True, "names": True, "differ": []}] * 2, report
