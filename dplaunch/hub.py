"""Where Hugging Face files come from: the local cache folders, offline mode, a path or a Hub id.

The model checks (model_facts.py) and the dataset checks (arrow_datasets.py) answer these the way
huggingface_hub, transformers and datasets do, without importing them.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit

from dplaunch.errors import UserError

_RUN_FILE_SUFFIXES = (".yaml", ".yml")


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


def find_model_file(
    name_or_path: str,
    wanted: tuple[str, ...],
    field: str,
    what: str = "model",
    file_ok: bool = False,
) -> Path:
    """The first of ``wanted`` in a local folder or a cached hub snapshot; UserError when absent.

    A local path that exists is judged as it is (never looked up on the hub), so a broken folder is
    reported for what it is. ``what`` names the thing in messages ("model", "tokenizer");
    ``file_ok``: a file given directly is the one wanted (a model's config.json under any name).
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        if path.is_file() and path.suffix in _RUN_FILE_SUFFIXES:
            raise UserError(
                field,
                f"{path} is a dplaunch run file, not a Hugging Face {what}",
                "a run file goes first on the command line (dplaunch plan RUN.yaml); here give a "
                f"Hugging Face {what} folder or a hub id",
            )
        if path.is_file():
            if file_ok:
                return path
            raise UserError(
                field, f"{path} is a file", f"give the Hugging Face {what} folder that holds it"
            )
        for name in wanted:
            if (path / name).is_file():
                return path / name
        raise UserError(
            field,
            f"{path} has no {' or '.join(wanted[:2])}",
            f"point it at a Hugging Face {what} folder",
        )
    cached = _hub_cache_file(name_or_path, wanted)
    if cached is not None:
        return cached
    if looks_like_path(name_or_path):
        raise UserError(field, f"{what} directory {name_or_path} does not exist", "check the path")
    raise UserError(
        field,
        f"{name_or_path!r} is neither a local folder nor in the Hugging Face cache",
        "download it first (hf download ID) or give a local path",
    )


# how long `dplaunch plan --model ID` waits to reach the Hub before saying it cannot
HUB_CONNECT_SECONDS = 5
_PROXY_VARIABLES = (
    "HTTPS_PROXY",
    "https_proxy",
    "HTTP_PROXY",
    "http_proxy",
    "ALL_PROXY",
    "all_proxy",
)


def hub_unreachable() -> str | None:
    """Why the Hub endpoint (HF_ENDPOINT, else huggingface.co) takes no connection within
    HUB_CONNECT_SECONDS, or None when it does; None too behind a proxy, which decides itself.
    huggingface_hub would retry a refused connection five times over 24 s first."""
    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return None
    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    problem: list[str] = [f"no answer within {HUB_CONNECT_SECONDS} s"]

    def connect() -> None:
        # in a thread: the name lookup has no timeout of its own
        try:
            socket.create_connection((host, port), timeout=HUB_CONNECT_SECONDS).close()
            problem.clear()
        except OSError as error:
            problem[0] = str(error.strerror or error)

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(HUB_CONNECT_SECONDS + 1)
    return f"{host}:{port}: {problem[0]}" if problem else None


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloaded models (HF_HUB_CACHE, the older
    HUGGINGFACE_HUB_CACHE, else HF_HOME/hub)."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    return Path(os.path.expandvars(os.path.expanduser(cache))) if cache else hf_home() / "hub"


def _hub_cache_file(repo_id: str, wanted: tuple[str, ...]) -> Path | None:
    snapshots = hub_cache_dir() / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    if not snapshots.is_dir():
        return None
    for snapshot in sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
        for name in wanted:
            if (snapshot / name).is_file():
                return snapshot / name
    return None
