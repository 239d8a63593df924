"""Where Hugging Face files come from: the local cache folders, offline mode, a path or a Hub id.

The model checks (model_facts.py) and the dataset checks (arrow_datasets.py) answer these the way
huggingface_hub, transformers and datasets do, without importing them.
"""

from __future__ import annotations

import os
from pathlib import Path


def looks_like_path(name: str) -> bool:
    """A name that can only be a local path (a hub id is `owner/name` at most)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def hf_home() -> Path:
    """Hugging Face's home folder, as huggingface_hub and datasets find it: HF_HOME, else
    $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface."""
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(os.path.expandvars(os.path.expanduser(home)))


def hub_offline(for_datasets: bool = True) -> bool:
    """Offline as `datasets` decides it (HF_DATASETS_OFFLINE when set, else HF_HUB_OFFLINE), or
    for models and tokenizers (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE)."""
    true = {"1", "ON", "YES", "TRUE"}
    datasets_offline = os.environ.get("HF_DATASETS_OFFLINE") if for_datasets else None
    if datasets_offline is not None:
        return datasets_offline.upper() in true
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in true
