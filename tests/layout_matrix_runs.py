"""The layout matrix's machinery (tests/test_layout_matrix*.py): any checkpoint resumes under
another layout, on real gloo ranks, with the straight run's numbers.

A matrix module declares trees of shared runs. A tree is one straight run under its root layout
that saves a checkpoint every step (its step-2 checkpoint is the root's source checkpoint), and
the resumes it feeds: source → targets. A target that is a source in turn trains one step and
stops with a checkpoint, which feeds its own targets. A leaf either trains to the last step and
exports its model (the first leaf of each layout in a module: its export is checked once), or
trains one step and stops with a checkpoint, like a source. Each launch proves one edge, each
resume under another engine converting its checkpoint once through the universal form in the
launcher. Checked for every edge: the losses of the steps it trained equal the straight run's
(fp32, 1e-5); a run that stopped with a checkpoint holds, in that checkpoint's universal form
(converted in the test's process), the straight run's weights, Adam moments, step counters and
schedule at that step, tensor by tensor; a run that trained to the end exported the straight
run's final weights.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers import (
    TINY_LLAMA,
    losses_by_step,
    read_metrics,
    run_dplaunch,
    run_loopback_nodes,
    write_config,
)

STEPS = 6
# the straight run's checkpoint the root's targets resume from
FIRST_CHECKPOINT = 2
# launch.timeout_minutes: neither torch's default group timeout (30 min gloo, 10 NCCL) nor
# DeepSpeed's (10 min), so a process group an engine builds without it shows in the header
TIMEOUT_MINUTES = 7
RUN = (
    "--max-steps", str(STEPS), "--global-batch", "8", "--micro-batch", "2",
    "--set", f"launch.timeout_minutes={TIMEOUT_MINUTES}",
)  # fmt: skip
LOSS_TOLERANCE = 1e-5
# the universal form of a resumed run's checkpoint against the straight run's at the same step
WEIGHT_TOLERANCE = 1e-5
# Adam's moments, as a fraction of the tensor's largest element
MOMENT_TOLERANCE = 1e-3
# a LoRA tree's adapters: on every linear layer
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}


@dataclass(frozen=True)
class Layout:
    """The CPU ranks and flags of a layout; NODES > 1: loopback "nodes" of RANKS / NODES each."""

    ranks: int
    flags: tuple[str, ...] = ()
    nodes: int = 1


# a "-1" suffix: the same layout on 1 rank (its export is the 2-rank layout's)
LAYOUTS: dict[str, Layout] = {
    "ddp": Layout(2),
    "ddp-1": Layout(1),
    "zero1": Layout(2, ("--zero", "1")),
    "zero1-1": Layout(1, ("--zero", "1")),
    "zero2": Layout(2, ("--zero", "2")),
    "zero2-1": Layout(1, ("--zero", "2")),
    "zero3": Layout(2, ("--zero", "3")),
    "zero3-1": Layout(1, ("--zero", "3")),
    "zero2-offload": Layout(2, ("--zero", "2", "--offload", "optimizer")),
    "zero2-offload-1": Layout(1, ("--zero", "2", "--offload", "optimizer")),
    "fsdp": Layout(2, ("--fsdp", "full")),
    "fsdp-1": Layout(1, ("--fsdp", "full")),
    # 2 loopback nodes of 2 ranks: shard inside a node, replicate across
    "hsdp": Layout(4, ("--fsdp", "hybrid"), nodes=2),
    "fsdp-tp2": Layout(2, ("--fsdp", "full", "--tp", "2")),
    "tp2": Layout(2, ("--tp", "2")),
    "pp2": Layout(2, ("--pp", "2")),
    "sp2": Layout(2, ("--sp", "2")),
}

SOURCE, STOP, EXPORT = "source", "stop", "export"


@dataclass(frozen=True)
class Tree:
    """A straight run under ROOT's layout and the resumes it feeds (source → targets); LORA: the
    tiny Llama's LoRA adapters train (the tree's test ids start with `lora-`), with LORA_KEYS
    beside LORA's (a VARIANT such as DoRA: its ids start with `VARIANT-`)."""

    root: str
    targets: dict[str, tuple[str, ...]]
    lora: bool = False
    lora_keys: tuple[tuple[str, Any], ...] = ()
    variant: str = ""

    @property
    def prefix(self) -> str:
        return f"{self.variant}-" if self.variant else "lora-" if self.lora else ""


@dataclass(frozen=True)
class EdgePlan:
    """One resume: SOURCE's checkpoint at STEP continued under TARGET; KIND: a SOURCE (stops
    after one step with a checkpoint for its own targets), a STOP leaf (the same, nothing
    resumes from it) or an EXPORT leaf (trains to the last step)."""

    prefix: str
    source: str
    target: str
    step: int
    kind: str

    @property
    def last(self) -> int:
        """The last step the resumed run trains."""
        return STEPS if self.kind == EXPORT else self.step + 1

    @property
    def name(self) -> str:
        return f"{self.prefix}{self.source}-to-{self.target}"


def matrix_edges(trees: tuple[Tree, ...]) -> list[EdgePlan]:
    """Every tree's edges in the order they can run (a source's checkpoint first). A target is
    a source in turn the first time it appears in its tree; a leaf exports when it is the first
    leaf of its layout (any rank count) in its kind of tree, else it stops after one step."""
    found: list[EdgePlan] = []
    exported: set[tuple[str, str]] = set()
    for tree in trees:
        queue, expanded = [(tree.root, FIRST_CHECKPOINT)], {tree.root}
        while queue:
            source, step = queue.pop(0)
            for target in tree.targets[source]:
                if target in tree.targets and target not in expanded:
                    kind = SOURCE
                    expanded.add(target)
                    queue.append((target, step + 1))
                else:
                    layout = (tree.prefix, target.removesuffix("-1"))
                    kind = STOP if layout in exported and step + 1 < STEPS else EXPORT
                    exported.add(layout)
                found.append(EdgePlan(tree.prefix, source, target, step, kind))
    return found


@dataclass
class Edge:
    """What one resume did."""

    plan: EdgePlan
    run_dir: Path
    seconds: float = 0.0
    error: str | None = None
    losses: dict[int, float] = field(default_factory=dict)

    @property
    def checkpoint(self) -> Path:
        """The checkpoint it stopped with (a SOURCE or STOP edge)."""
        return self.run_dir / "checkpoints" / f"step-{self.plan.step + 1}"


@dataclass
class Matrix:
    """Every run: the straight references (by tree prefix), the resumes, the references'
    universal forms by (prefix, step)."""

    references: dict[str, Path]
    edges: dict[EdgePlan, Edge]
    universal: dict[tuple[str, int], Path]


def launch(run_dir: Path, layout: str, config: Path, *flags: str) -> tuple[float, str | None]:
    """`dplaunch train CONFIG` under LAYOUT with FLAGS: its seconds, and its output's tail when
    it failed."""
    spec = LAYOUTS[layout]
    started = time.perf_counter()
    error = None
    if spec.nodes > 1:
        try:
            run_loopback_nodes(config, run_dir, *RUN, *spec.flags, *flags, gpus=spec.ranks)
        except AssertionError as failure:
            error = str(failure)
    else:
        result = run_dplaunch(
            "train", config, "-o", run_dir, "--cpu", "--gpus", spec.ranks, *RUN, *spec.flags,
            *flags, timeout=600,
        )  # fmt: skip
        if result.returncode != 0:
            error = (result.stdout[-2000:] + result.stderr[-3000:]).strip()
    return time.perf_counter() - started, error


def universal_form(checkpoint: Path, out: Path) -> Path:
    """The universal form of CHECKPOINT, converted in this process (what the launcher runs)."""
    from dplaunch.train.convert import write_universal

    shutil.rmtree(out, ignore_errors=True)
    write_universal(checkpoint, out, memory_bytes=64 << 20, say=lambda _line: None, progress=False)
    return out


def run_matrix(root: Path, trees: tuple[Tree, ...], title: str) -> Matrix:
    """Every tree's straight run, then its edges in order (a source's checkpoint before its
    targets); prints how long each launch took."""
    started = time.perf_counter()
    plans = matrix_edges(trees)
    references: dict[str, Path] = {}
    edges: dict[EdgePlan, Edge] = {}
    seconds: dict[str, float] = {}
    for tree in trees:
        config = TINY_LLAMA
        if tree.lora:  # the tiny Llama with LoRA adapters on every linear layer
            lora = {**LORA, **dict(tree.lora_keys)}
            config = write_config(root / f"tiny-llama-{tree.prefix}.yaml", model={"lora": lora})
        straight = root / f"{tree.prefix}straight-{tree.root}"
        keep = ("--set", "train.checkpoint_every=1", "--set", f"train.keep_last={STEPS}")
        seconds[f"{tree.prefix}straight {tree.root}"], error = launch(
            straight, tree.root, config, *keep
        )
        assert error is None, error
        references[tree.prefix] = straight
        checkpoints = {tree.root: straight / "checkpoints" / f"step-{FIRST_CHECKPOINT}"}
        for plan in (p for p in plans if p.prefix == tree.prefix):
            edge = edges[plan] = Edge(plan, root / plan.name)
            if plan.source not in checkpoints:
                edge.error = f"its source {plan.source} has no checkpoint"
                continue
            stop = () if plan.kind == EXPORT else ("--set", f"train.stop_after_steps={plan.last}")
            resume = ("--resume", str(checkpoints[plan.source]))
            edge.seconds, edge.error = launch(edge.run_dir, plan.target, config, *resume, *stop)
            seconds[plan.name] = edge.seconds
            if edge.error is None:
                edge.losses = losses_by_step(edge.run_dir)
                if plan.kind == SOURCE:
                    checkpoints[plan.target] = edge.checkpoint
    universal = {
        (prefix, step): universal_form(
            references[prefix] / "checkpoints" / f"step-{step}",
            root / f"{prefix}straight-universal-{step}",
        )
        for prefix, step in {(p.prefix, p.last) for p in plans if p.kind != EXPORT}
    }
    summary = {
        "launches": len(seconds),
        "seconds": round(time.perf_counter() - started, 1),
        "runs": {name: round(value, 1) for name, value in seconds.items()},
    }
    print(f"{title}:", json.dumps(summary))
    return Matrix(references, edges, universal)


def check_edge(matrix: Matrix, plan: EdgePlan) -> None:
    """The resume PLAN trained the straight run's losses and ended with its state."""
    edge = matrix.edges[plan]
    assert edge.error is None, edge.error
    reference = matrix.references[plan.prefix]
    assert_group_timeouts(reference)
    assert_group_timeouts(edge.run_dir)
    straight = losses_by_step(reference)
    assert sorted(edge.losses) == list(range(plan.step + 1, plan.last + 1)), edge.losses
    gaps = {at: abs(loss - straight[at]) for at, loss in edge.losses.items()}
    print(
        f"{plan.prefix}{plan.source}→{plan.target}: largest per-step loss gap "
        f"{max(gaps.values()):.2e} (steps {plan.step + 1}–{plan.last})"
    )
    assert max(gaps.values()) <= LOSS_TOLERANCE, (gaps, edge.losses, straight)
    if plan.kind == EXPORT:
        assert_same_model(edge.run_dir / "model", reference / "model")
    else:
        converted = universal_form(edge.checkpoint, edge.run_dir / "universal-check")
        assert_same_state(converted, matrix.universal[(plan.prefix, plan.last)])


def assert_group_timeouts(run_dir: Path) -> None:
    """Every process group rank 0 was in (the world, the engine's: DeepSpeed's, FSDP2's mesh, the
    TP, PP and SP groups, the control channel) held launch.timeout_minutes, at every launch."""
    for header in (r for r in read_metrics(run_dir) if r["type"] == "header"):
        timeouts = header["process_group_timeouts_s"]
        # one rank without DeepSpeed or FSDP has no process group at all
        alone = header["world_size"] == 1 and timeouts == []
        assert timeouts == [TIMEOUT_MINUTES * 60.0] or alone, (run_dir.name, timeouts)


def assert_same_state(got: Path, expected: Path) -> None:
    """Two universal forms hold the same training state, tensor by tensor."""
    from dplaunch.train.universal import MOMENTS, STEP, UniversalReader

    left, right = UniversalReader(got), UniversalReader(expected)
    # each source lists the parameters in its own order (DDP: its optimizer's groups)
    assert sorted(left.names()) == sorted(right.names())
    for name, weight, state in right.entries():
        assert (left.weight(name) - weight).abs().max() <= WEIGHT_TOLERANCE, name
        for key in MOMENTS:
            scale = state[key].abs().max().clamp_min(1e-30)
            gap = (left.state(name, key) - state[key]).abs().max() / scale
            assert gap <= MOMENT_TOLERANCE, (name, key, float(gap))
        assert left.state(name, STEP) == state[STEP], name
    ours, theirs = left.scheduler_state(), right.scheduler_state()
    assert ours["last_epoch"] == theirs["last_epoch"], (ours, theirs)


def assert_same_model(got: Path, expected: Path) -> None:
    """Two exported models hold the same weights."""
    from safetensors.torch import load_file

    def weights(folder: Path) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for path in sorted(folder.glob("*.safetensors")):
            found.update(load_file(str(path)))
        return found

    left, right = weights(got), weights(expected)
    assert left.keys() == right.keys()
    for name, tensor in right.items():
        assert (left[name].float() - tensor.float()).abs().max() <= WEIGHT_TOLERANCE, name
