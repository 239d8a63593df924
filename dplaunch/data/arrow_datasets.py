"""Datasets `datasets` has already prepared as Arrow, found and described before launch: a hub
dataset in the `datasets` cache (found as `load_dataset` finds it), or a folder written by
`save_to_disk` (read with `load_from_disk`). Also: whether the Hub has a dataset that is not cached.

On a cluster the compute nodes usually cannot reach the Hub: the data is loaded once where the
Hub is reachable, and the ranks read the prepared copy `datasets` keeps under
<cache>/<namespace>___<snake_name>/<config>/<version>/<hash>/. That folder, like a saved one,
holds dataset_info.json (the features: columns and a ClassLabel's names; in the cache, the
splits and their rows too) and Arrow stream files, so either is checked before launch as local
files are. Nothing here imports `datasets` (a second to import).
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dplaunch.errors import UserError
from dplaunch.hub import hf_home, hub_offline, looks_like_path

# how long the Hub may take to say whether a dataset that is not cached exists
HUB_TIMEOUT_S = 10.0
CONFIG_FIELD = "data.dataset_config"


@dataclass(frozen=True)
class PreparedSplit:
    """One split of a prepared dataset: its rows (None when only its files can tell) and files."""

    name: str
    rows: int | None
    files: tuple[Path, ...]
    features: dict[str, Any]


@dataclass(frozen=True)
class PreparedDataset:
    """The prepared copy of a dataset that the ranks read: a hub dataset's in the `datasets`
    cache (CONFIG its configuration) or a `save_to_disk` folder (CONFIG None)."""

    name: str
    config: str | None
    directory: Path
    splits: dict[str, PreparedSplit]
    # a folder saved from one Dataset, not a DatasetDict: its one split has no name
    single: bool = False

    @property
    def described(self) -> str:
        """How messages name it: hub dataset 'org/name' (config), or saved dataset FOLDER."""
        if self.config is None:
            return f"saved dataset {self.name}"
        return f"hub dataset {self.name!r} ({self.config})"

    def row(self, split: str, index: int) -> str:
        """How messages name one record: org/name (config) train[5], or FOLDER[5]."""
        where = self.name if self.config is None else f"{self.name} ({self.config})"
        return f"{where}[{index}]" if self.single else f"{where} {split}[{index}]"

    def split(self, split: str, field: str) -> PreparedSplit:
        """The split, or a UserError naming FIELD and the splits there are."""
        if self.single:
            return next(iter(self.splits.values()))
        if split in self.splits:
            return self.splits[split]
        raise UserError(
            field,
            f"{self.described} has no split {split!r}",
            f"its splits are {', '.join(sorted(self.splits))}",
        )

    def class_names(self, split: str, column: str) -> tuple[str, ...] | None:
        """The class names of COLUMN in SPLIT when it is a ClassLabel, else None."""
        feature = self.split(split, "data.split").features.get(column)
        if isinstance(feature, dict) and feature.get("_type") == "ClassLabel":
            names = feature.get("names")
            if isinstance(names, list) and all(isinstance(name, str) for name in names):
                return tuple(names)
        return None


def saved_folder(dataset: str | list[str]) -> Path | None:
    """The folder when DATASET names one written by `save_to_disk` (a Dataset or a DatasetDict)."""
    if isinstance(dataset, list):
        return None
    folder = Path(dataset).expanduser()
    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        return folder
    return None


def hub_layout_folder(dataset: str | list[str]) -> bool:
    """A folder of data files in the Hub's layout (data/train-*.jsonl, …), not one written by
    save_to_disk: `datasets` reads it as it reads a hub dataset (data.streaming streams it)."""
    if isinstance(dataset, list):
        return False
    return Path(dataset).expanduser().is_dir() and saved_folder(dataset) is None


def saved_dataset(folder: Path, field: str) -> PreparedDataset:
    """What `load_from_disk(FOLDER)` will read: its splits, their features and Arrow files."""
    fix = "save it again with save_to_disk, or give data files"
    if (folder / "dataset_dict.json").is_file():
        listing = _json_file(folder / "dataset_dict.json", field, fix)
        names = listing.get("splits") if isinstance(listing, dict) else None
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            raise UserError(field, f"{folder / 'dataset_dict.json'} lists no splits", fix)
        splits = {name: _saved_split(folder / name, name, field) for name in names}
        return PreparedDataset(str(folder), None, folder, splits)
    split = _saved_split(folder, "", field)
    return PreparedDataset(str(folder), None, folder, {"": split}, single=True)


def _saved_split(folder: Path, name: str, field: str) -> PreparedSplit:
    fix = "save it again with save_to_disk, or give data files"
    state = _json_file(folder / "state.json", field, fix)
    info = _json_file(folder / "dataset_info.json", field, fix)
    entries = state.get("_data_files") if isinstance(state, dict) else None
    features = info.get("features") if isinstance(info, dict) else None
    if not isinstance(entries, list) or not isinstance(features, dict):
        raise UserError(
            field, f"{folder} holds no saved dataset (state.json, dataset_info.json)", fix
        )
    files = tuple(
        folder / str(entry.get("filename")) for entry in entries if isinstance(entry, dict)
    )
    missing = [path for path in files if not path.is_file()]
    if missing or not files:
        raise UserError(
            field,
            f"the saved dataset {folder} lacks {missing[0] if missing else 'its Arrow files'}",
            fix,
        )
    return PreparedSplit(name, None, files, features)


def _json_file(path: Path, field: str, fix: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(field, f"cannot read {path} ({exc})", fix) from None


def cached_dataset(
    name: str, config: str | None, field: str = "data.dataset"
) -> PreparedDataset | None:
    """The cached copy `load_dataset(name, config)` reads when the Hub is out of reach; None
    when there is none. Several cached configurations and no data.dataset_config: offline,
    `datasets` refuses to guess, and so does this (a UserError naming them); online the Hub's
    default configuration decides, which the cache cannot tell (None)."""
    root = datasets_cache_dir() / _cache_folder_name(name)
    pattern = os.path.join(glob.escape(str(root)), glob.escape(config) if config else "*", "*", "*")
    # `datasets` skips a folder whose dataset_info.json names another configuration (one
    # prepared with extra arguments) and fails on one without the file
    candidates = {
        Path(path): info
        for path in glob.glob(pattern)
        if (info := _dataset_info(Path(path))) is not None
        and info.get("config_name") == Path(path).parts[-3]
    }
    if not candidates:
        return None
    # the newest, and (with no configuration named) the one configuration at its version/hash
    chosen = max(candidates, key=lambda path: path.stat().st_mtime)
    if config is None:
        siblings = sorted(
            path.parts[-3] for path in candidates if path.parts[-2:] == chosen.parts[-2:]
        )
        if len(siblings) > 1 and not hub_offline():
            return None
        if len(siblings) > 1:
            raise UserError(
                CONFIG_FIELD,
                f"hub dataset {name!r} has several configurations in the datasets cache "
                f"({', '.join(siblings)}) and none is named",
                f"set data.dataset_config to one of them (--set data.dataset_config={siblings[0]})",
            )
    return _read_cached(name, chosen, candidates[chosen], field)


def cached_configurations(name: str) -> list[str]:
    """The configurations of NAME in the datasets cache (for messages)."""
    root = datasets_cache_dir() / _cache_folder_name(name)
    return sorted(
        {
            Path(path).parts[-3]
            for path in glob.glob(os.path.join(glob.escape(str(root)), "*", "*", "*"))
        }
    )


def check_hub_dataset(
    name: str | list[str], config: str | None, field: str = "data.dataset"
) -> PreparedDataset | None:
    """Refuse a hub dataset the ranks cannot load: not in the `datasets` cache and the Hub is
    off (HF_HUB_OFFLINE) or does not have it. Only `datasets`' own cache counts: offline,
    `load_dataset` reads nothing else (a hub-cache snapshot alone fails with ConnectionError).

    Returns the cached copy when there is one (the ranks read it offline, or when the Hub holds
    the same revision), None when the ranks will download the dataset."""
    if isinstance(name, list):
        raise UserError(field, f"{name} names no local file", "a list must name local data files")
    if looks_like_path(name):
        raise UserError(
            field,
            f"{name} does not exist",
            "check the path (relative paths are relative to the run file)",
        )
    cache = datasets_cache_dir()
    cached = cached_dataset(name, config, field)
    if cached is not None:
        return cached
    download = (
        f'load it once where the Hub is reachable (python -c "import datasets; '
        f"datasets.load_dataset('{name}'{f', {config!r}' if config else ''})\") with the same "
        "HF_HOME, or give local files"
    )
    if hub_offline():
        others = cached_configurations(name) if config else []
        if others:
            raise UserError(
                CONFIG_FIELD,
                f"configuration {config!r} of hub dataset {name!r} is not in the datasets cache "
                f"({cache}), which holds {', '.join(others)}, and offline mode is on (HF_HUB_OFFLINE)",
                f"use one of those, or {download}",
            )
        raise UserError(
            field,
            f"hub dataset {name!r} is not in the datasets cache ({cache}) and offline mode is "
            "on (HF_HUB_OFFLINE)",
            download,
        )
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        HfApi().dataset_info(name, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        raise UserError(
            field,
            f"hub dataset {name!r} is gated and this account has no access",
            f"ask for access on https://huggingface.co/datasets/{name} and log in (HF_TOKEN)",
        ) from None
    except RepositoryNotFoundError:
        raise UserError(
            field,
            f"{name!r} is neither a local file nor a dataset on the Hugging Face Hub",
            "check the id (org/name) or the path; a private dataset needs a login (HF_TOKEN)",
        ) from None
    except HfHubHTTPError:
        return None  # the Hub answered something else: the ranks will say what
    except Exception as exc:  # no answer at all: DNS, refused, timed out
        raise UserError(
            field,
            f"hub dataset {name!r} is not in the datasets cache ({cache}) and the Hub cannot "
            f"be reached ({type(exc).__name__})",
            download,
        ) from None
    return None


def datasets_cache_dir() -> Path:
    """Where `datasets` keeps prepared datasets (HF_DATASETS_CACHE, else HF_HOME/datasets)."""
    cache = os.environ.get("HF_DATASETS_CACHE")
    return Path(cache).expanduser() if cache else hf_home() / "datasets"


def _cache_folder_name(name: str) -> str:
    # <namespace>___<snake_name>, the folder `datasets` prepares a hub dataset in
    parts = name.split("/")
    parts[-1] = camelcase_to_snakecase(parts[-1])
    return "___".join(parts)


def _dataset_info(directory: Path) -> dict[str, Any] | None:
    # a cache folder's dataset_info.json, None when it has none or it is no JSON object
    try:
        info = json.loads((directory / "dataset_info.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _read_cached(name: str, directory: Path, info: dict[str, Any], field: str) -> PreparedDataset:
    features = info.get("features") or {}
    split_infos = info.get("splits")
    if not isinstance(features, dict) or not isinstance(split_infos, dict):
        raise UserError(
            field,
            f"the cached copy of hub dataset {name!r} has no features or splits in "
            f"{directory / 'dataset_info.json'}",
            "delete that folder and load the dataset again where the Hub is reachable",
        )
    prefix = camelcase_to_snakecase(name.split("/")[-1])
    splits = {}
    for split, split_info in split_infos.items():
        shards = (split_info or {}).get("shard_lengths") or []
        stem = directory / f"{prefix}-{split}"
        if len(shards) > 1:
            files = tuple(
                Path(f"{stem}-{shard:05d}-of-{len(shards):05d}.arrow")
                for shard in range(len(shards))
            )
        else:
            files = (Path(f"{stem}.arrow"),)
        missing = [path for path in files if not path.is_file()]
        if missing:
            raise UserError(
                field,
                f"the cached copy of hub dataset {name!r} lacks {missing[0]}",
                "delete that folder and load the dataset again where the Hub is reachable",
            )
        rows = (split_info or {}).get("num_examples")
        splits[split] = PreparedSplit(
            split, rows if isinstance(rows, int) else None, files, features
        )
    return PreparedDataset(name, directory.parts[-3], directory, splits)


def camelcase_to_snakecase(name: str) -> str:
    """datasets.naming.camelcase_to_snakecase (not imported: `datasets` takes a second)."""
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    return re.sub(r"([a-z\d])([A-Z])", r"\1_\2", name).lower()
