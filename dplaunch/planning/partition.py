"""Pipeline stage partition, balanced by parameters, computed without building the model.

The pipeline engine cuts a causal LM into layers [embeddings, block 0 … block N-1, final norm + head]
and partitions them with DeepSpeed's "parameters" method: contiguous stages whose parameter sums
differ as little as possible (smallest max − min). This module applies the same rule to counts
derived from config.json, so `--dry-run` can show the split before launch; the run's first log
line shows the split the engine really made.
"""

from __future__ import annotations

from dplaunch.planning.model_facts import ModelFacts


def layer_parameter_counts(model: ModelFacts) -> list[int]:
    """Parameters of each pipeline layer: embeddings, each block, then final norm + head."""
    h, vocab = model.hidden_size, model.vocab_size
    if model.model_type == "gpt2":
        inner = model.intermediate_size or 4 * h
        positions = model.max_positions or 1024
        block = (
            2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * inner + inner) + (inner * h + h)
        )
        return [vocab * h + positions * h, *([block] * model.num_layers), 2 * h + vocab * h]
    head_dim = int(model.raw.get("head_dim") or h // model.num_heads)
    q = model.num_heads * head_dim
    kv = model.num_kv_heads * head_dim
    bias = bool(model.raw.get("attention_bias")) or model.model_type == "qwen2"
    attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if bias else 0)
    inner = model.intermediate_size or 4 * h
    block = attention + 3 * h * inner + 2 * h
    return [vocab * h, *([block] * model.num_layers), h + vocab * h]


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
    """One description per stage, e.g. 'embeddings, blocks 0-1' — what each stage holds."""
    counts = layer_parameter_counts(model)
    cuts = balanced_boundaries(counts, stages)
    names = ["embeddings", *[f"block {i}" for i in range(model.num_layers)], "norm + lm_head"]
    described = []
    for start, end in zip(cuts[:-1], cuts[1:], strict=True):
        held = names[start:end]
        blocks = [n for n in held if n.startswith("block")]
        parts = [n for n in held if not n.startswith("block")]
        if blocks:
            first, last = blocks[0].split()[1], blocks[-1].split()[1]
            span = f"block {first}" if first == last else f"blocks {first}-{last}"
            parts.insert(1 if held[0] == "embeddings" else 0, span)
        params = sum(counts[start:end])
        described.append(f"{', '.join(parts) or '(empty)'} ({params / 1e6:.2f}M params)")
    return described
