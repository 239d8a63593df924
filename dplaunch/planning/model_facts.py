"""What the planner needs to know about a model, read from its config.json alone (never the weights)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dplaunch.errors import UserError

# families whose decoder DeepSpeed AutoTP knows how to split (DESIGN.md), by HF model_type
AUTOTP_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "bloom",
    "chatglm",
    "mixtral",
    "deepseek_v2",
    "phi3",
    "gpt2",
    "gptj",
    "opt",
    "falcon",
)
# families dplaunch can cut into pipeline stages (dplaunch/train/pipeline.py)
PIPELINE_FAMILIES = ("llama", "mistral", "qwen2", "gpt2")

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


def load_config_json(name_or_path: str, field: str = "model.name_or_path") -> dict[str, Any]:
    """The config.json of a local model dir or a cached hub model, without importing transformers."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        config_file = path / "config.json" if path.is_dir() else path
        if not config_file.is_file():
            raise UserError(
                field, f"{path} has no config.json", "point it at a Hugging Face model folder"
            )
        try:
            return json.loads(config_file.read_text())
        except (OSError, ValueError) as exc:
            raise UserError(
                field, f"cannot read {config_file}: {exc}", "fix or replace the file"
            ) from None
    cached = _hub_cache_config(name_or_path)
    if cached is not None:
        return json.loads(cached.read_text())
    looks_like_path = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_like_path:
        raise UserError(field, f"model directory {name_or_path} does not exist", "check the path")
    raise UserError(
        field,
        f"{name_or_path!r} is neither a local folder nor in the Hugging Face cache",
        "download it first (huggingface-cli download) or give a local path",
    )


def _hub_cache_config(repo_id: str) -> Path | None:
    import os

    home = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub"
    )
    snapshots = Path(home) / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    if not snapshots.is_dir():
        return None
    for snapshot in sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
        if (snapshot / "config.json").is_file():
            return snapshot / "config.json"
    return None
