"""What the planner needs to know about a model, read from its config.json alone (never the weights)."""

from __future__ import annotations

import difflib
import functools
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dplaunch.config.schema import BYTE_LEVEL, ModelConfig
from dplaunch.errors import UserError
from dplaunch.hub import find_model_file, hub_offline, looks_like_path

# families whose HF classes run SDPA (transformers 5 ``_supports_sdpa``, checked by
# tests/test_estimate.py): transformers picks sdpa for them on CPU and GPU unless told otherwise
SDPA_FAMILIES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "gpt2",
    "gptj",
    "gpt_neox",
    "bert",
    "opt",
    "falcon",
    "phi",
    "phi3",
    "gemma",
)

# HF config field names differ per family; first match wins
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads")
_KV_HEAD_KEYS = ("num_key_value_heads", "multi_query_group_num", "n_head_kv")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
_INTERMEDIATE_KEYS = ("intermediate_size", "n_inner", "ffn_dim")
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "seq_length")


def _first(config: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return None


@dataclass(frozen=True)
class ModelFacts:
    """Shape facts of a transformer, as its config.json states them."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    hidden_size: int
    intermediate_size: int | None
    vocab_size: int
    max_positions: int | None
    tied_embeddings: bool
    raw: dict[str, Any]

    @classmethod
    def from_config_dict(cls, config: dict[str, Any]) -> ModelFacts:
        """Read the shape facts out of an HF config dict."""
        model_type = str(config.get("model_type", "unknown"))
        heads = int(_first(config, _HEAD_KEYS) or 1)
        return cls(
            model_type=model_type,
            num_layers=int(_first(config, _LAYER_KEYS) or 1),
            num_heads=heads,
            num_kv_heads=int(_first(config, _KV_HEAD_KEYS) or heads),
            hidden_size=int(_first(config, _HIDDEN_KEYS) or 0),
            intermediate_size=_first(config, _INTERMEDIATE_KEYS),
            vocab_size=int(config.get("vocab_size", 0)),
            max_positions=_first(config, _POSITION_KEYS),
            tied_embeddings=bool(config.get("tie_word_embeddings", model_type in ("gpt2", "bert"))),
            raw=dict(config),
        )


def attention_implementation(model_type: str, requested: str | None = None) -> str:
    """The attention kernel the ranks run: ``requested`` (model.attn_implementation), else what
    transformers 5 picks when given none (``get_correct_attn_implementation``): sdpa where the
    model class supports it, eager otherwise. A family dplaunch does not know counts as eager,
    the case that needs the most memory."""
    if requested is not None:
        return requested
    return "sdpa" if model_type in SDPA_FAMILIES else "eager"


# files that make a folder (or a hub snapshot) a tokenizer AutoTokenizer can load
TOKENIZER_FILES = (
    "tokenizer_config.json",
    "tokenizer.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def load_config_json(name_or_path: str, field: str = "model.name_or_path") -> dict[str, Any]:
    """The config.json of a local model dir or a cached hub model, without importing transformers."""
    config_file = find_model_file(name_or_path, ("config.json",), field, file_ok=True)
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(
            field, f"cannot read {config_file}: {exc}", "fix or replace the file"
        ) from None
    if not isinstance(config, dict):
        raise UserError(
            field, f"{config_file} holds no JSON object", "point it at a Hugging Face model folder"
        )
    return config


def check_tokenizer(model: ModelConfig, field: str = "model.tokenizer") -> None:
    """The tokenizer the ranks will load is there: built in, the model's own (its folder is
    checked with model.name_or_path), a folder, or a cached hub id (found as model.name_or_path
    is). A hub id that is not cached passes while the Hub is on: the ranks download it (a model
    trained from scratch with the tokenizer of gpt2, say). Offline it must be cached."""

    name_or_path = model.tokenizer
    if name_or_path is None and model.name_or_path is None:
        raise UserError(
            field,
            "model.config builds a model from scratch, and no tokenizer is named",
            f"set model.tokenizer: {BYTE_LEVEL} (built in), a tokenizer folder or a hub id",
        )
    if name_or_path is None or name_or_path in (BYTE_LEVEL, model.name_or_path):
        return
    is_hub_id = not Path(name_or_path).expanduser().exists() and not looks_like_path(name_or_path)
    if is_hub_id and not hub_offline(for_datasets=False):
        return
    find_model_file(name_or_path, TOKENIZER_FILES, field, what="tokenizer")


def check_sequence_length(model: ModelFacts, max_length: int, *, from_run_file: bool) -> str | None:
    """data.max_length must fit the model's position table: beyond a learned table every rank
    fails on an index. Rotary positions run at any length, so there it is a note (returned).

    ``from_run_file``: the config is the run file's model.config, where the table can be enlarged.
    """
    if model.max_positions is None or max_length <= int(model.max_positions):
        return None
    key = next(key for key in _POSITION_KEYS if model.raw.get(key) is not None)
    beyond = (
        f"{max_length} tokens per sample, but the {model.model_type} model has only "
        f"{model.max_positions} positions ({key})"
    )
    if _rotary(model):
        return (
            f"data.max_length: {beyond}; its rotary positions run at any length, but it was "
            "not trained beyond them (set rope_scaling to extend the context)"
        )
    raise UserError(
        "data.max_length",
        beyond,
        f"use data.max_length ≤ {model.max_positions}"
        + (f", or raise {key} in model.config" if from_run_file else ""),
    )


# config keys of rotary position embeddings (Llama, Mistral, Qwen, GPT-NeoX, GPT-J, Phi, …)
_ROTARY_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "rotary_dim", "rotary_pct")


def _rotary(model: ModelFacts) -> bool:
    # a model.config rarely spells out rope_theta (a default of its config class): the class's
    # defaults count too. Only on this rare path (a length past the table) is transformers
    # imported (a few seconds)
    if any(model.raw.get(name) is not None for name in _ROTARY_KEYS):
        return True
    try:
        from transformers import AutoConfig

        defaults = AutoConfig.for_model(model.model_type).to_dict()
    except Exception:  # noqa: BLE001 — an unknown or broken type: judge by what was written
        return False
    return any(defaults.get(name) is not None for name in _ROTARY_KEYS)


@functools.lru_cache(maxsize=1)
def known_model_types() -> frozenset[str]:
    """The model types the installed transformers can build, read from its source (no import).

    Importing transformers' CONFIG_MAPPING_NAMES costs about 2 s and imports torch (measured); the
    mapping is written out as ("type", "TypeConfig") pairs in two files, read here in about 5 ms.
    Empty when transformers is missing or its layout is unknown (then nothing is checked).
    """
    spec = importlib.util.find_spec("transformers")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    auto = Path(list(spec.submodule_search_locations)[0]) / "models" / "auto"
    names: set[str] = set()
    for source in ("auto_mappings.py", "configuration_auto.py"):
        try:
            text = (auto / source).read_text()
        except OSError:
            continue
        names |= {m[0] for m in _CONFIG_PAIR.findall(text) if m[1] != "AutoConfig"}
    return frozenset(names)


_CONFIG_PAIR = re.compile(r"""["']([\w.-]+)["']\s*[,:]\s*["'](\w+Config)["']""")


def check_model_type(model_type: str, field: str) -> None:
    """Refuse a model_type the installed transformers does not know, naming the closest one."""
    known = known_model_types()
    if not known or model_type in known or _known_to_transformers(model_type):
        return
    close = difflib.get_close_matches(model_type, sorted(known), n=1, cutoff=0.6)
    fix = (
        f"did you mean {close[0]!r}?"
        if close
        else "use a model type transformers knows (e.g. llama, gpt2, bert), or upgrade transformers"
    )
    raise UserError(field, f"transformers does not know model type {model_type!r}", fix)


def _known_to_transformers(model_type: str) -> bool:
    # the source reading above is fast but could miss a type a later transformers writes another
    # way: before refusing, ask transformers itself (the ~2 s import only on this error path)
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        return True  # nothing to ask: do not refuse
    return model_type in CONFIG_MAPPING_NAMES
