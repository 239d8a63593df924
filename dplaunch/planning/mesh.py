"""The device mesh: world = dp × sp × tp × pp, and which global ranks form each group.

Rank layout (the one DeepSpeed's pipeline grid and AutoTP use): tp varies fastest, then dp,
then pp — so a TP group is consecutive ranks (inside one node: planning/rules.py makes tp divide
the GPUs per node), and the pipeline stage of rank r is r // (dp × tp). Sequence parallelism
(sp, which composes with dp only: planning/rules.py) takes tp's place: an sp group is consecutive
ranks, as DeepSpeed's Ulysses groups are, and data-parallel rank r // sp.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mesh:
    """Degrees of data, tensor and pipeline parallelism over ``world_size`` ranks."""

    data_parallel_size: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # ranks that share each sequence (DeepSpeed Ulysses); they read the same samples
    sequence_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return (
            self.data_parallel_size
            * self.sequence_parallel_size
            * self.tensor_parallel_size
            * self.pipeline_parallel_size
        )

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pipeline stage, data-parallel rank, tensor-parallel rank) of a global rank."""
        inner, dp = self.tensor_parallel_size * self.sequence_parallel_size, self.data_parallel_size
        return rank // (dp * inner), (rank // inner) % dp, rank % self.tensor_parallel_size

    def sequence_parallel_rank(self, rank: int) -> int:
        """Which slice of each sequence a global rank holds (0 without sequence parallelism)."""
        return (rank // self.tensor_parallel_size) % self.sequence_parallel_size

    def sequence_parallel_groups(self) -> list[list[int]]:
        """Ranks that share each sequence: consecutive ranks, one group per data-parallel rank."""
        sp = self.sequence_parallel_size
        return [list(range(start, start + sp)) for start in range(0, self.world_size, sp)]

    def rank_of(self, stage: int, dp_rank: int, tp_rank: int, sp_rank: int = 0) -> int:
        """Global rank at the given coordinates."""
        group = (stage * self.data_parallel_size + dp_rank) * self.sequence_parallel_size + sp_rank
        return group * self.tensor_parallel_size + tp_rank

    def tensor_parallel_groups(self) -> list[list[int]]:
        """Ranks that hold shards of the same layers and must see the same batch."""
        return [
            [self.rank_of(s, d, t) for t in range(self.tensor_parallel_size)]
            for s in range(self.pipeline_parallel_size)
            for d in range(self.data_parallel_size)
        ]

    def data_parallel_groups(self) -> list[list[int]]:
        """Ranks that hold the same shard and average their gradients."""
        return [
            [self.rank_of(s, d, t) for d in range(self.data_parallel_size)]
            for s in range(self.pipeline_parallel_size)
            for t in range(self.tensor_parallel_size)
        ]

    def pipelines(self) -> list[list[int]]:
        """Ranks that form one pipeline, stage 0 first."""
        return [
            [self.rank_of(s, d, t) for s in range(self.pipeline_parallel_size)]
            for d in range(self.data_parallel_size)
            for t in range(self.tensor_parallel_size)
        ]

    def describe(self, stage_layers: list[str] | None = None) -> list[str]:
        """Human-readable lines: the degrees, then each group of ranks."""
        sp = self.sequence_parallel_size
        lines = [
            f"mesh: dp {self.data_parallel_size} × "
            + (f"sp {sp} × " if sp > 1 else "")
            + f"tp {self.tensor_parallel_size} × pp {self.pipeline_parallel_size} = "
            f"{self.world_size} ranks"
        ]
        if sp > 1:
            lines.append(f"  sequence-parallel groups: {self.sequence_parallel_groups()}")
        if self.tensor_parallel_size > 1:
            lines.append(f"  tensor-parallel groups: {self.tensor_parallel_groups()}")
        if self.pipeline_parallel_size > 1:
            lines.append(f"  pipelines (stage 0 first): {self.pipelines()}")
            for stage, layers in enumerate(stage_layers or []):
                lines.append(f"  stage {stage}: {layers}")
        if self.data_parallel_size > 1 and (
            self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1
        ):
            lines.append(f"  data-parallel groups: {self.data_parallel_groups()}")
        return lines


def fsdp_groups(world_size: int, shard_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """FSDP's (shard groups, replicate groups): ranks that split the parameters between them, and
    ranks that hold the same shard. ``shard_size`` is the world (full) or a node's ranks (hybrid)."""
    replicas = world_size // shard_size
    shard = [list(range(r * shard_size, (r + 1) * shard_size)) for r in range(replicas)]
    replicate = [list(range(s, world_size, shard_size)) for s in range(shard_size)]
    return shard, replicate
