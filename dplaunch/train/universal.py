"""The universal form of a training state: one engine-neutral checkpoint that every layout loads.

A checkpoint of any layout (DDP, ZeRO-1/2/3, offload, FSDP2, HSDP, AutoTP, FSDP × TP, pipeline,
sequence parallel, LoRA) converts into this form once (dplaunch/train/convert.py), and any layout
resumes from it (dplaunch/train/universal_load.py). It is keyed by the model's own parameter names
(Hugging Face's, or peft's for a LoRA run's adapters), whole tensors, never a layout's shards:

    CHECKPOINT/               a complete checkpoint folder (checkpoint.json, run.yaml, plan.json, hf/)
      universal.json          format and version, the scheduler's state, every parameter's shape
      model/                  the fp32 master weights, an HF weights folder (model-0000K-of-0000N
                              .safetensors + model.safetensors.index.json)
      optimizer/              Adam's state of each parameter: NAME.exp_avg, NAME.exp_avg_sq and
                              NAME.step (its step counter), same sharding
      rng-rank-N.pt           every source rank's RNG (train/checkpoint.py's format)

Written and read tensor by tensor: a shard file is written once it holds its byte budget, and a
reader opens the safetensors files lazily (one tensor, or one rank's slice of it, at a time), so a
state larger than a host's memory never has to be held whole.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dplaunch.run_directory.layout import (
    UNIVERSAL_FILE,
    UNIVERSAL_MODEL_DIR,
    UNIVERSAL_OPTIMIZER_DIR,
)

FORMAT = "dplaunch-universal"
VERSION = 1
# Adam's per-parameter moments; the step counter is stored beside them as NAME.step
MOMENTS = ("exp_avg", "exp_avg_sq")
STEP = "step"
# the file stems of each part's shards (model-00001-of-00003.safetensors: Hugging Face's names)
PARTS = {UNIVERSAL_MODEL_DIR: "model", UNIVERSAL_OPTIMIZER_DIR: "optimizer"}


def state_key(name: str, key: str) -> str:
    """The optimizer file's key of parameter NAME's state KEY (exp_avg, exp_avg_sq, step)."""
    return f"{name}.{key}"


def is_universal(directory: Path) -> bool:
    """Whether DIRECTORY (a checkpoint folder) holds the universal form."""
    return (directory / UNIVERSAL_FILE).is_file()


class ShardedWriter:
    """One part's safetensors shards, written in order: a file is written as soon as the tensors
    buffered for it reach ``shard_bytes`` (so at most that much is held), then named
    STEM-0000K-of-0000N.safetensors when the last one is written, with Hugging Face's index."""

    def __init__(self, directory: Path, stem: str, shard_bytes: int):
        self.directory = directory
        self.stem = stem
        self.shard_bytes = max(1, shard_bytes)
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffered = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total = 0
        directory.mkdir(parents=True, exist_ok=True)

    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Buffer one tensor (a contiguous CPU copy); write the shard when it is full."""
        # a copy of its own: a view (a shared step counter) or a memory-mapped source tensor
        tensor = tensor.detach().to("cpu", copy=True).contiguous()
        size = tensor.numel() * tensor.element_size()
        if self.buffer and self.buffered + size > self.shard_bytes:
            self.flush()
        self.buffer[key] = tensor
        self.buffered += size
        self.total += size

    def flush(self) -> None:
        """Write the buffered tensors as the next shard file."""
        from safetensors.torch import save_file

        if not self.buffer:
            return
        path = self.directory / f"{self.stem}-{len(self.files) + 1:05d}.safetensors"
        save_file(self.buffer, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.buffer)))
        self.buffer, self.buffered = {}, 0

    def close(self) -> list[Path]:
        """Write the last shard, give every shard its final name and write the index."""
        self.flush()
        count = len(self.files)
        weight_map, paths = {}, []
        for index, (path, keys) in enumerate(self.files, start=1):
            final = path.with_name(f"{self.stem}-{index:05d}-of-{count:05d}.safetensors")
            path.rename(final)
            paths.append(final)
            weight_map.update(dict.fromkeys(keys, final.name))
        index_file = self.directory / f"{self.stem}.safetensors.index.json"
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        index_file.write_text(json.dumps(index, indent=2) + "\n")
        return [*paths, index_file]


class UniversalWriter:
    """Writes the universal form into DIRECTORY, one parameter at a time."""

    def __init__(self, directory: Path, shard_bytes: int):
        self.directory = directory
        self.parts = {
            part: ShardedWriter(directory / part, stem, shard_bytes) for part, stem in PARTS.items()
        }
        self.shapes: dict[str, list[int]] = {}

    def add(self, name: str, weight: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Parameter NAME: its fp32 weight and its optimizer state (MOMENTS and STEP; empty when
        the source never stepped it)."""
        self.shapes[name] = list(weight.shape)
        self.parts[UNIVERSAL_MODEL_DIR].add(name, weight.float())
        optimizer = self.parts[UNIVERSAL_OPTIMIZER_DIR]
        for key in (*MOMENTS, STEP):
            if key in state:
                value = state[key]
                value = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
                optimizer.add(
                    state_key(name, key), value.float().reshape(weight.shape if key != STEP else ())
                )

    def close(self, scheduler: dict[str, Any] | None, source: dict[str, Any]) -> list[Path]:
        """Write the last shards and universal.json; return every file written."""
        written = [path for writer in self.parts.values() for path in writer.close()]
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "scheduler": scheduler,
            "source": source,
            "parameters": self.shapes,
        }
        (self.directory / UNIVERSAL_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        return [*written, self.directory / UNIVERSAL_FILE]


class UniversalReader:
    """Reads the universal form lazily: a tensor (or a slice of it) at a time."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.meta = json.loads((directory / UNIVERSAL_FILE).read_text())
        if self.meta.get("format") != FORMAT or int(self.meta.get("version", 0)) > VERSION:
            raise ValueError(
                f"{directory / UNIVERSAL_FILE} is not a dplaunch universal checkpoint of version "
                f"{VERSION} or older"
            )
        self.shapes: dict[str, list[int]] = self.meta["parameters"]
        self._where: dict[tuple[str, str], Path] = {}
        for part, stem in PARTS.items():
            index = json.loads((directory / part / f"{stem}.safetensors.index.json").read_text())
            for key, file in index["weight_map"].items():
                self._where[(part, key)] = directory / part / file
        self._open: dict[str, tuple[Path, Any]] = {}

    def names(self) -> list[str]:
        """Every parameter, in the order the source held them."""
        return list(self.shapes)

    def has_state(self, name: str) -> bool:
        """Whether parameter NAME has optimizer state (it was stepped at least once)."""
        return (UNIVERSAL_OPTIMIZER_DIR, state_key(name, MOMENTS[0])) in self._where

    def _file(self, part: str, key: str) -> Any:
        from safetensors import safe_open

        # one file of each part open at a time: an open file is memory-mapped, and the pages
        # read stay resident until it is closed (reads follow the files' order)
        path = self._where[(part, key)]
        held = self._open.get(part)
        if held is None or held[0] != path:
            self._open[part] = (path, safe_open(str(path), framework="pt"))
        return self._open[part][1]

    def weight(self, name: str) -> torch.Tensor:
        """The fp32 weight of parameter NAME, whole."""
        return self._file(UNIVERSAL_MODEL_DIR, name).get_tensor(name)

    def state(self, name: str, key: str) -> torch.Tensor:
        """Parameter NAME's optimizer state KEY (exp_avg, exp_avg_sq: whole; step: a scalar)."""
        stored = state_key(name, key)
        return self._file(UNIVERSAL_OPTIMIZER_DIR, stored).get_tensor(stored)

    def entries(self) -> Iterator[tuple[str, torch.Tensor, dict[str, torch.Tensor]]]:
        """(name, weight, optimizer state) of every parameter, one at a time."""
        for name in self.names():
            state = (
                {key: self.state(name, key) for key in (*MOMENTS, STEP)}
                if self.has_state(name)
                else {}
            )
            yield name, self.weight(name), state

    def scheduler_state(self) -> dict[str, Any] | None:
        """The learning-rate scheduler's state_dict, as the source saved it."""
        return self.meta.get("scheduler")

    def close(self) -> None:
        """Let go of the open files."""
        self._open.clear()
