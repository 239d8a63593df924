"""Ranks of the export job of a tensor-parallel checkpoint: `python -m dplaunch.train.export_ranks RUN CHECKPOINT OUT`.

`dplaunch export` starts one per tensor-parallel rank (CPU, gloo, dp 1) in a temporary run
directory rendered for the checkpoint's layout. Each rank builds the engine exactly as training
does, loads its AutoTP shard of the model weights (no optimizer state), and the engine's own
export gathers the shards into one HF model + tokenizer in OUT, as at the end of training.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dplaunch.train.__main__ import report_failure
from dplaunch.train.rank_process import begin_rank, exit_rank


def export_rank(run_dir: Path, checkpoint: Path, out: Path) -> int:
    """Load this rank's shard of the checkpoint's weights and write the consolidated model."""
    from dplaunch.train.export_weights import export_tokenizer, load_module_weights
    from dplaunch.train.loop import build_engine, read_run, start_rank
    from dplaunch.train.modeling import load_model

    config, plan = read_run(run_dir)
    accelerator, _place, say = start_rank(config, plan, run_dir)
    tokenizer = export_tokenizer(config)
    model = load_model(config.model, tokenizer, config.train.seed, config.data.label_names)
    # the engine as training builds it; its optimizer never steps (under ZeRO, DeepSpeed's loader
    # copies the loaded weights into the optimizer's fp32 partitions)
    engine = build_engine(plan, config, accelerator, model, 1, run_dir)
    load_module_weights(engine.model, checkpoint)
    say(f"[dplaunch] loaded the model weights of {checkpoint}")
    engine.export(str(out), tokenizer)
    accelerator.end_training()
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(
            "usage: python -m dplaunch.train.export_ranks RUN_DIR CHECKPOINT OUT", file=sys.stderr
        )
        return 2
    run_dir, checkpoint, out = map(Path, argv)
    try:
        return export_rank(run_dir, checkpoint, out)
    except Exception as error:  # noqa: BLE001 — one line per failing rank, as training ranks do
        return report_failure(run_dir, error)


if __name__ == "__main__":
    begin_rank()
    exit_rank(main(sys.argv[1:]))
