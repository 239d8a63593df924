"""Every layout's native checkpoint read as whole parameters, one at a time: what converts into the
universal form (dplaunch/train/universal.py).

Each engine keeps writing its own format; these read them back by the model's own parameter names:

- DDP (Accelerate's save_state): model.safetensors and the torch optimizer's state, whose
  parameters are numbered in the order of train/engines.py's two groups.
- DeepSpeed ZeRO-1/2/3, offload, ZeRO + AutoTP, a pipeline under ZeRO-1, bf16: DeepSpeed's own
  `ds_to_universal` joins the data-parallel partitions and the AutoTP slices into one folder per
  parameter; read from there (also what `dplaunch convert --to deepspeed` writes).
- DeepSpeed without a ZeRO optimizer (AutoTP at stage 0): each tp rank's weights and torch
  optimizer state, joined with the affine maps AutoTP records in the checkpoint
  (deepspeed.checkpoint.affine).
- A pipeline at stage 0: DeepSpeed's per-layer files and each stage's optimizer state, mapped back
  to the HF names through the layers train/pipeline.py cuts the model into.
- FSDP2, HSDP, FSDP × TP (torch.distributed.checkpoint): the whole tensor of each key, whatever
  the shards (DCP joins DTensor shards on read).
- The universal form itself.

Memory: one parameter (and its optimizer state) at a time from the DDP weights, FSDP and universal
checkpoints; DeepSpeed's converter holds one rank's partition file at a time.
"""

from __future__ import annotations

import math
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dplaunch.run_directory.layout import (
    DEEPSPEED_TAG,
    FSDP_TAG,
    FSDP_TRAINER_FILE,
    PIPELINE_TAG,
    rank_of,
    rng_state_file,
)
from dplaunch.train.universal import MOMENTS, STEP, UniversalReader, is_universal

# (name, fp32 weight, optimizer state: exp_avg, exp_avg_sq, step; empty when never stepped)
Entry = tuple[str, torch.Tensor, dict[str, torch.Tensor]]

# Accelerate's save_state file names (accelerate.utils.constants), and its registered scheduler
ACCELERATE_WEIGHTS = "model.safetensors"
ACCELERATE_OPTIMIZER = "optimizer.bin"
ACCELERATE_SCHEDULER = "custom_checkpoint_0.pkl"
ACCELERATE_RNG = "random_states_{rank}.pkl"
# DeepSpeed's universal checkpoint folder of one parameter, and what it holds
DEEPSPEED_UNIVERSAL_DIR = "zero"
DEEPSPEED_UNIVERSAL_FILES = {
    "fp32": "fp32.pt",
    "exp_avg": "exp_avg.pt",
    "exp_avg_sq": "exp_avg_sq.pt",
}


class CheckpointSource:
    """A checkpoint of one layout read as whole parameters."""

    # what the progress line calls it
    kind = "checkpoint"

    def __init__(self, directory: Path, meta: dict[str, Any]):
        self.directory = directory
        self.meta = meta

    def names(self) -> list[str]:
        """Every parameter the checkpoint holds, in the order entries() gives them."""
        raise NotImplementedError

    def entries(self) -> Iterator[Entry]:
        """(name, fp32 weight, optimizer state) of every parameter, one at a time."""
        raise NotImplementedError

    def scheduler_state(self) -> dict[str, Any] | None:
        """The learning-rate scheduler's state_dict."""
        return None

    def rng_states(self) -> dict[int, dict[str, Any]]:
        """Each source rank's RNG, in train/checkpoint.py's form."""
        states = {}
        for path in self.directory.iterdir():
            rank = rank_of(path.name, rng_state_file)
            if rank is not None:
                states[rank] = torch.load(path, weights_only=False)
        return states

    def close(self) -> None:
        """Remove what reading needed (DeepSpeed's intermediate conversion)."""


# ---------------------------------------------------------------------------------------------
# the universal form and DeepSpeed's universal checkpoint


class UniversalSource(CheckpointSource):
    """A checkpoint already in the universal form."""

    kind = "universal"

    def __init__(self, directory: Path, meta: dict[str, Any]):
        super().__init__(directory, meta)
        self.reader = UniversalReader(directory)

    def names(self) -> list[str]:
        return self.reader.names()

    def entries(self) -> Iterator[Entry]:
        return self.reader.entries()

    def scheduler_state(self) -> dict[str, Any] | None:
        return self.reader.scheduler_state()


def _step_of(value: Any) -> torch.Tensor:
    return (
        value.detach().float().reshape(())
        if isinstance(value, torch.Tensor)
        else torch.tensor(float(value))
    )


class DeepSpeedUniversalFolder:
    """DeepSpeed's universal checkpoint (ds_to_universal's output): zero/NAME/{fp32,exp_avg,
    exp_avg_sq,step}.pt, every tensor whole."""

    def __init__(self, folder: Path, shapes: dict[str, Any], rename: Any = None):
        self.root = folder / DEEPSPEED_UNIVERSAL_DIR
        # the folder's names (the DeepSpeed engine's module's) → the model's
        self.rename = rename or (lambda name: name)
        # ZeRO-3's conversion holds flat tensors: the model's shapes, by its names
        self.shapes = shapes
        self._shared_step: torch.Tensor | None = None

    def shared_step(self) -> torch.Tensor:
        """ZeRO-3's conversion keeps no step per parameter: its optimizer's (every group's is
        the same), from the common optimizer state."""
        if self._shared_step is None:
            common = torch.load(
                self.root / "optimizer_state.pt", map_location="cpu", mmap=True, weights_only=False
            )
            states = common["optimizer_state_dict"]["state"]
            self._shared_step = _step_of(next(iter(states.values()))["step"])
        return self._shared_step

    def folder_names(self) -> list[str]:
        """The parameters' folders, in the model's order."""
        order = {name: index for index, name in enumerate(self.shapes)}
        names = [path.name for path in self.root.iterdir() if (path / "fp32.pt").is_file()]
        return sorted(names, key=lambda name: order.get(self.rename(name), len(order)))

    def entry(self, folder_name: str) -> Entry:
        where = self.root / folder_name

        def load(file: str) -> torch.Tensor:
            value = torch.load(where / file, map_location="cpu", weights_only=False)
            return value["param"] if isinstance(value, dict) else value

        name = self.rename(folder_name)
        weight = load("fp32.pt").float().reshape(self.shapes[name])
        state: dict[str, torch.Tensor] = {}
        if (where / DEEPSPEED_UNIVERSAL_FILES["exp_avg"]).is_file():
            for key in MOMENTS:
                state[key] = load(DEEPSPEED_UNIVERSAL_FILES[key]).float().reshape(weight.shape)
            step = where / "step.pt"
            state[STEP] = _step_of(load("step.pt")) if step.is_file() else self.shared_step()
        return name, weight, state


# ---------------------------------------------------------------------------------------------
# DDP (Accelerate)


def _accelerate_rng_states(directory: Path, ranks_per_node: int) -> dict[int, dict[str, Any]]:
    """Accelerate's random_states_N.pkl as train/checkpoint.py's per-rank form (a rank's own GPU
    generator: the one of its local index among every GPU it saw)."""
    states = {}
    for path in sorted(directory.glob(ACCELERATE_RNG.format(rank="*"))):
        rank = int(re.findall(r"\d+", path.name)[-1])
        saved = torch.load(path, weights_only=False)
        cuda = saved.get("torch_cuda_manual_seed")
        if cuda:
            index = rank % max(1, ranks_per_node)
            cuda = {"device": 0, "state": cuda[index if index < len(cuda) else 0]}
        states[rank] = {
            "python": saved["random_state"],
            "numpy": saved["numpy_random_seed"],
            "torch": saved["torch_manual_seed"],
            "cuda": cuda or None,
        }
    return states


def _ranks_per_node(meta: dict[str, Any]) -> int:
    return int(meta.get("world_size", 1)) // max(1, int(meta.get("num_nodes", 1)))


class AccelerateFilesMixin:
    """The scheduler and RNG files Accelerate's save_state writes beside any engine's state."""

    directory: Path
    meta: dict[str, Any]

    def scheduler_state(self) -> dict[str, Any] | None:
        path = self.directory / ACCELERATE_SCHEDULER
        return torch.load(path, weights_only=False) if path.is_file() else None

    def rng_states(self) -> dict[int, dict[str, Any]]:
        states = _accelerate_rng_states(self.directory, _ranks_per_node(self.meta))
        # a converted checkpoint keeps them in train/checkpoint.py's form
        return states or CheckpointSource.rng_states(self)  # type: ignore[arg-type]


def _optimizer_names(skeleton: Any) -> list[str]:
    """The parameter names in the order a train/engines.py optimizer numbers its state."""
    from dplaunch.train.engines import parameter_groups

    return [name for group in parameter_groups(skeleton) for name, _ in group]


def _numbered_state(optimizer: dict[str, Any], names: list[str], where: Path) -> dict[str, dict]:
    """A torch optimizer state_dict's per-parameter state by name (NAMES: in its numbering)."""
    numbered = [index for group in optimizer["param_groups"] for index in group["params"]]
    if len(numbered) != len(names):
        raise ValueError(
            f"{where}: the optimizer holds {len(numbered)} parameters, the model trains "
            f"{len(names)}: the checkpoint does not fit its own run file"
        )
    return {
        name: optimizer["state"].get(index, {}) for name, index in zip(names, numbered, strict=True)
    }


class DdpSource(AccelerateFilesMixin, CheckpointSource):
    """Accelerate's DDP checkpoint: the unwrapped model's weights (what trains, under LoRA) and the
    torch optimizer's state."""

    kind = "DDP"

    def __init__(self, directory: Path, meta: dict[str, Any], skeleton: Any):
        from safetensors import safe_open

        super().__init__(directory, meta)
        self.weights = safe_open(str(directory / ACCELERATE_WEIGHTS), framework="pt")
        # a memory map: the pages of each tensor are read as it is converted
        optimizer = torch.load(
            directory / ACCELERATE_OPTIMIZER, map_location="cpu", mmap=True, weights_only=False
        )
        self.optimizer = _numbered_state(optimizer, _optimizer_names(skeleton), directory)
        stored = set(self.weights.keys())
        self._names = [name for name in self.optimizer if name in stored]
        missing = sorted(set(self.optimizer) - stored)
        if missing:
            raise ValueError(
                f"{directory / ACCELERATE_WEIGHTS} lacks trained parameters {missing[:3]}"
            )

    def names(self) -> list[str]:
        return self._names

    def entries(self) -> Iterator[Entry]:
        for name in self._names:
            # checkpoints hold the unwrapped model; a DDP prefix in older ones is dropped
            weight = self.weights.get_tensor(name).float()
            state = {k: v for k, v in self.optimizer[name].items() if k in (*MOMENTS, STEP)}
            yield name.removeprefix("module."), weight, state


# ---------------------------------------------------------------------------------------------
# DeepSpeed (Accelerate's engine: ZeRO, AutoTP) and the pipeline engine


def deepspeed_to_universal(tag_dir: Path, output: Path) -> None:
    """DeepSpeed's ds_to_universal of a checkpoint with ZeRO (or bf16) optimizer files, in this
    process: every parameter's fp32 weight and Adam state, whole, in OUTPUT/zero/NAME/."""
    import argparse
    import contextlib
    import io

    from deepspeed.checkpoint.ds_to_universal import main

    args = argparse.Namespace(
        input_folder=str(tag_dir),
        output_folder=str(output),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    # its step-by-step report and tqdm bars: the conversion's own progress line says enough
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        main(args)
    # it also points a `latest_universal` file in OUTPUT's parent at OUTPUT: not ours to keep
    (output.parent / "latest_universal").unlink(missing_ok=True)


def has_zero_optimizer(tag_dir: Path) -> bool:
    """Whether a DeepSpeed checkpoint holds ZeRO (or bf16) optimizer partition files."""
    return any(tag_dir.glob("*optim_states.pt"))


class DeepSpeedUniversalSource(AccelerateFilesMixin, CheckpointSource):
    """A DeepSpeed checkpoint through DeepSpeed's universal form: ZeRO-1/2/3 (offload and AutoTP
    included), converted by ds_to_universal into WORK first, or a DeepSpeed universal folder."""

    kind = "DeepSpeed"

    def __init__(
        self,
        directory: Path,
        meta: dict[str, Any],
        folder: Path,
        shapes: dict[str, Any],
        *,
        work: Path | None = None,
        rename: Any = None,
        files: Any = None,
    ):
        super().__init__(directory, meta)
        self.work = work
        self.folder = DeepSpeedUniversalFolder(folder, shapes, rename)
        self._folder_names = self.folder.folder_names()
        # the pipeline keeps its scheduler in its own files
        self.files = files

    def names(self) -> list[str]:
        return [self.folder.rename(name) for name in self._folder_names]

    def entries(self) -> Iterator[Entry]:
        for name in self._folder_names:
            yield self.folder.entry(name)

    def scheduler_state(self) -> dict[str, Any] | None:
        return self.files.scheduler_state() if self.files else super().scheduler_state()

    def rng_states(self) -> dict[int, dict[str, Any]]:
        return self.files.rng_states() if self.files else super().rng_states()

    def close(self) -> None:
        if self.work is not None:
            shutil.rmtree(self.work, ignore_errors=True)


def _model_states(tag_dir: Path, rank: int) -> dict[str, Any]:
    return torch.load(
        tag_dir / f"mp_rank_{rank:02d}_model_states.pt",
        map_location="cpu",
        mmap=True,
        weights_only=False,
    )


class TensorParallelSource(AccelerateFilesMixin, CheckpointSource):
    """DeepSpeed AutoTP without a ZeRO optimizer: each tp rank's slices of the weights and of their
    torch optimizer state, joined as the affine maps the checkpoint records say."""

    kind = "AutoTP"

    def __init__(self, directory: Path, meta: dict[str, Any], skeleton: Any):
        super().__init__(directory, meta)
        tag_dir = directory / DEEPSPEED_TAG
        self.tp = int(meta.get("tensor_parallel_size", 1))
        self.ranks = [_model_states(tag_dir, rank) for rank in range(self.tp)]
        names = _optimizer_names(skeleton)
        self.states = [_numbered_state(sd["optimizer"], names, tag_dir) for sd in self.ranks]
        info = self.ranks[0].get("universal_checkpoint_info") or {}
        self.maps = (info.get("affine_map") or {}).get("params", {})
        self._names = list(self.ranks[0]["module"])
        trained = set(names)
        self._names = [name for name in self._names if name in trained]

    def names(self) -> list[str]:
        return self._names

    def _join(self, name: str, shards: list[torch.Tensor], key: str) -> torch.Tensor:
        if self.tp == 1:
            return shards[0]
        from deepspeed.checkpoint.affine import SCALE_POWER_BY_STATE, ParamAffineMap

        entry = self.maps.get(f"^{re.escape(name)}$")
        if entry is None:
            raise ValueError(f"the tensor-parallel checkpoint records no affine map for {name}")
        affine = ParamAffineMap.from_dict(entry)
        return affine.rebuild(dict(enumerate(shards)), SCALE_POWER_BY_STATE[key])

    def entries(self) -> Iterator[Entry]:
        for name in self._names:
            weight = self._join(name, [sd["module"][name].float() for sd in self.ranks], "fp32")
            state: dict[str, torch.Tensor] = {}
            own = self.states[0][name]
            if own:
                for key in MOMENTS:
                    state[key] = self._join(name, [s[name][key].float() for s in self.states], key)
                state[STEP] = _step_of(own[STEP])
            yield name, weight, state


def pipeline_stage_names(skeleton: Any, num_stages: int) -> tuple[dict[str, str], list[list[str]]]:
    """How the pipeline engine names the model's parameters: (the stage module's name → the HF
    name, and each stage's names in its module's order). The stages are cut as
    train/pipeline.py's PipelineModule cuts them (partition by parameter count)."""
    from deepspeed.pipe import TiedLayerSpec
    from deepspeed.runtime.utils import partition_balanced

    from dplaunch.train.pipeline import pipeline_layers

    hf_names = {id(p): n for n, p in skeleton.named_parameters()}
    layers = pipeline_layers(skeleton)
    modules = [layer if isinstance(layer, torch.nn.Module) else layer.build() for layer in layers]
    counts = [sum(p.numel() for p in m.parameters() if p.requires_grad) for m in modules]
    parts = partition_balanced(weights=counts, num_parts=num_stages)
    renames: dict[str, str] = {}
    stages: list[list[str]] = []
    for stage in range(num_stages):
        tied, numbered = [], []
        for index in range(parts[stage], parts[stage + 1]):
            layer, module = layers[index], modules[index]
            for local, parameter in module.named_parameters():
                if isinstance(layer, TiedLayerSpec):
                    name = f"tied_modules.{layer.key}.{local}"
                    if name not in tied:
                        tied.append(name)
                else:
                    name = f"{index}.{local}"
                    numbered.append(name)
                renames[name] = hf_names[id(parameter)]
        # PipelineModule registers its tied modules before its numbered layers
        stages.append(tied + numbered)
    return renames, stages


class PipelineFiles:
    """The pipeline engine's scheduler (in stage 0's model-states file) and the Checkpointer's RNG."""

    def __init__(self, source: CheckpointSource, tag_dir: Path):
        self.source = source
        self.tag_dir = tag_dir

    def scheduler_state(self) -> dict[str, Any] | None:
        return _model_states(self.tag_dir, 0).get("lr_scheduler")

    def rng_states(self) -> dict[int, dict[str, Any]]:
        return CheckpointSource.rng_states(self.source)


class PipelineSource(CheckpointSource):
    """The pipeline engine without ZeRO: its per-layer weight files and each stage's optimizer
    state, by the HF names of the layers' parameters."""

    kind = "pipeline"

    def __init__(self, directory: Path, meta: dict[str, Any], skeleton: Any):
        super().__init__(directory, meta)
        self.tag_dir = directory / PIPELINE_TAG
        stages = int(meta.get("pipeline_parallel_size", 1))
        self.renames, stage_names = pipeline_stage_names(skeleton, stages)
        self.files = PipelineFiles(self, self.tag_dir)
        # each stage's optimizer numbers its parameters by its module's two groups
        from dplaunch.train.engines import parameter_groups

        no_decay = {name for name, _ in parameter_groups(skeleton)[1]}
        self.owner: dict[str, dict[str, Any]] = {}
        for stage, names in enumerate(stage_names):
            optimizer = _model_states(self.tag_dir, stage)["optimizer"]
            ordered = [n for n in names if self.renames[n] not in no_decay]
            ordered += [n for n in names if self.renames[n] in no_decay]
            self.owner.update(_numbered_state(optimizer, ordered, self.tag_dir))
        self._order = [name for names in stage_names for name in names]

    def names(self) -> list[str]:
        return [self.renames[name] for name in self._order]

    def entries(self) -> Iterator[Entry]:
        for name in self._order:
            index, _, local = name.partition(".")
            if index == "tied_modules":
                key, _, local = local.partition(".")
                files = self._tied_layer_files(key)
            else:
                files = sorted(self.tag_dir.glob(f"layer_{int(index):02d}-*model_states.pt"))
            if not files:
                raise ValueError(f"{self.tag_dir} has no file for pipeline parameter {name}")
            layer = torch.load(files[0], map_location="cpu", mmap=True, weights_only=False)
            weight = layer[local].float()
            state = {k: v for k, v in self.owner[name].items() if k in (*MOMENTS, STEP)}
            yield self.renames[name], weight, state

    def _tied_layer_files(self, key: str) -> list[Path]:
        # the tied module is saved as the layer file of its first (owning) layer
        from dplaunch.train.pipeline import TIED_EMBEDDING_KEY

        assert key == TIED_EMBEDDING_KEY
        return sorted(self.tag_dir.glob("layer_00-*model_states.pt"))

    def scheduler_state(self) -> dict[str, Any] | None:
        return self.files.scheduler_state()


# ---------------------------------------------------------------------------------------------
# FSDP2 (torch.distributed.checkpoint)


class FsdpSource(CheckpointSource):
    """An FSDP2 / HSDP / FSDP × TP checkpoint: torch.distributed.checkpoint's keys model.NAME and
    optimizer.state.NAME.KEY, each read whole (DCP joins the shards), one parameter at a time."""

    kind = "FSDP2"

    def __init__(self, directory: Path, meta: dict[str, Any], batch_bytes: int = 64 << 20):
        from torch.distributed.checkpoint import FileSystemReader

        super().__init__(directory, meta)
        # parameters read together, up to this many bytes (each read goes through DCP's planning)
        self.batch_bytes = batch_bytes
        self.dcp_dir = directory / FSDP_TAG
        self.metadata = FileSystemReader(str(self.dcp_dir)).read_metadata().state_dict_metadata
        self._names = [key[len("model.") :] for key in self.metadata if key.startswith("model.")]

    def names(self) -> list[str]:
        return self._names

    def _read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        import warnings

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        state = {
            key: torch.empty(self.metadata[key].size, dtype=self.metadata[key].properties.dtype)
            for key in keys
        }
        with warnings.catch_warnings():
            # "no process group: loading into this process" is what is wanted here
            warnings.simplefilter("ignore")
            dcp.load(
                state,
                checkpoint_id=str(self.dcp_dir),
                planner=DefaultLoadPlanner(allow_partial_load=True),
                no_dist=True,
            )
        return state

    def _keys(self, name: str) -> dict[str, str]:
        keys = {"fp32": f"model.{name}"}
        for key in (*MOMENTS, STEP):
            if f"optimizer.state.{name}.{key}" in self.metadata:
                keys[key] = f"optimizer.state.{name}.{key}"
        return keys

    def _size(self, name: str) -> int:
        sizes = (self.metadata[key].size for key in self._keys(name).values())
        return 4 * sum(math.prod(size) for size in sizes)

    def entries(self) -> Iterator[Entry]:
        batch: list[str] = []
        for index, name in enumerate(self._names):
            batch.append(name)
            following = self._names[index + 1] if index + 1 < len(self._names) else None
            held = sum(self._size(n) for n in batch)
            if following is not None and held + self._size(following) <= self.batch_bytes:
                continue
            read = self._read([key for n in batch for key in self._keys(n).values()])
            for done in batch:
                keys = self._keys(done)
                state = {key: read.pop(stored) for key, stored in keys.items() if key != "fp32"}
                if STEP in state:
                    state[STEP] = _step_of(state[STEP])
                yield done, read.pop(keys["fp32"]).float(), state
            batch = []

    def scheduler_state(self) -> dict[str, Any] | None:
        trainer = torch.load(self.directory / FSDP_TRAINER_FILE, weights_only=False)
        return trainer.get("scheduler")


# ---------------------------------------------------------------------------------------------


def open_source(
    directory: Path, meta: dict[str, Any], config: Any, work: Path, batch_bytes: int = 64 << 20
) -> CheckpointSource:
    """The reader of the checkpoint in DIRECTORY (META: its checkpoint.json, CONFIG: its run file);
    WORK: a folder for DeepSpeed's intermediate conversion (removed by close()); BATCH_BYTES: what
    a reader may read at once."""
    from dplaunch.train.modeling import model_skeleton

    if is_universal(directory):
        return UniversalSource(directory, meta)
    if (directory / FSDP_TAG).is_dir():
        return FsdpSource(directory, meta, batch_bytes)
    for tag in (DEEPSPEED_TAG, PIPELINE_TAG):
        tag_dir = directory / tag
        if not tag_dir.is_dir():
            continue
        pipeline = tag == PIPELINE_TAG
        skeleton = model_skeleton(directory, config)
        shapes = {name: tuple(p.shape) for name, p in skeleton.named_parameters()}
        rename, files = None, None
        if pipeline:
            renames, _ = pipeline_stage_names(skeleton, int(meta.get("pipeline_parallel_size", 1)))
            rename = renames.__getitem__
        if (tag_dir / DEEPSPEED_UNIVERSAL_DIR).is_dir():
            # already DeepSpeed's universal form (`dplaunch convert --to deepspeed`)
            return DeepSpeedUniversalSource(directory, meta, tag_dir, shapes, rename=rename)
        if has_zero_optimizer(tag_dir):
            converted = work / tag
            deepspeed_to_universal(tag_dir, converted)
            if pipeline:
                files = PipelineFiles(CheckpointSource(directory, meta), tag_dir)
            return DeepSpeedUniversalSource(
                directory, meta, converted, shapes, work=work, rename=rename, files=files
            )
        if pipeline:
            return PipelineSource(directory, meta, skeleton)
        return TensorParallelSource(directory, meta, skeleton)
    if (directory / ACCELERATE_WEIGHTS).is_file():
        return DdpSource(directory, meta, model_skeleton(directory, config))
    raise ValueError(f"{directory} holds no checkpoint dplaunch knows how to read")
