"""Pipeline stage partition, balanced by parameters, computed without building the model.

The pipeline engine cuts a causal LM into layers [embeddings, block 0 … block N-1, final norm, head]
and partitions them with DeepSpeed's "parameters" method: contiguous stages whose parameter sums
differ as little as possible (smallest max − min). This module applies the same rule to counts
derived from config.json, so `--dry-run` can show the split before launch; the run's first log
line shows the split the engine really made.
"""

from __future__ import annotations

from dplaunch.planning.estimate import count_parameters
from dplaunch.planning.model_facts import ModelFacts


def pipeline_layers(model: ModelFacts) -> list[tuple[str, int]]:
    """(name, parameters) of each pipeline layer, in the order dplaunch/train/pipeline.py builds them:
    token embedding, [GPT-2 position embedding], blocks, final norm, lm_head."""
    count = count_parameters(model)
    token = count.vocab_size * count.hidden_size
    norm = (2 if model.model_type == "gpt2" else 1) * count.hidden_size
    # a tied head is a TiedLayerSpec on the last stage: DeepSpeed counts the shared matrix there too
    head = count.tied_params if count.tied_head else count.head - norm
    layers = [("embeddings", token)]
    if count.embedding > token:
        layers.append(("embeddings", count.embedding - token))
    layers += [(f"block {i}", count.per_layer) for i in range(count.num_layers)]
    return [*layers, ("norm", norm), ("lm_head", head)]


def balanced_boundaries(weights: list[int], parts: int) -> list[int]:
    """Stage boundaries [0, b1, …, len(weights)] minimising the spread of contiguous stage sums."""
    n = len(weights)
    if n <= parts:
        return [min(p, n) for p in range(parts + 1)]
    prefix = [0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    inf = float("inf")
    # best[i][j] = (spread, largest, smallest, cut) for the first i layers in j stages
    best: list[list[tuple[float, float, float, int]]] = [
        [(inf, inf, inf, 0)] * (parts + 1) for _ in range(n + 1)
    ]
    best[0][0] = (0, 0, inf, 0)
    for i in range(1, n + 1):
        for j in range(1, min(i, parts) + 1):
            for k in range(i):
                spread_k, largest_k, smallest_k, _ = best[k][j - 1]
                if spread_k == inf:
                    continue
                stage = prefix[i] - prefix[k]
                largest, smallest = max(largest_k, stage), min(smallest_k, stage)
                # ties go to the later cut, as DeepSpeed's solver does
                if largest - smallest <= best[i][j][0]:
                    best[i][j] = (largest - smallest, largest, smallest, k)
    cuts = [n]
    for j in range(parts, 0, -1):
        cuts.append(best[cuts[-1]][j][3])
    return cuts[::-1]


def partition_layers(model: ModelFacts, stages: int) -> list[str]:
    """One description per stage, e.g. 'embeddings, blocks 0-1 (0.09M params)' — what each stage holds."""
    layers = pipeline_layers(model)
    cuts = balanced_boundaries([params for _, params in layers], stages)
    described = []
    for start, end in zip(cuts[:-1], cuts[1:], strict=True):
        held = layers[start:end]
        names: list[str] = []
        blocks = [name.split()[1] for name, _ in held if name.startswith("block ")]
        for name, _ in held:
            if name.startswith("block "):
                if name.split()[1] == blocks[0]:
                    names.append(
                        f"block {blocks[0]}"
                        if len(blocks) == 1
                        else f"blocks {blocks[0]}-{blocks[-1]}"
                    )
            elif name not in names:
                names.append(name)
        params = sum(p for _, p in held)
        described.append(f"{', '.join(names) or '(empty)'} ({params / 1e6:.2f}M params)")
    return described
