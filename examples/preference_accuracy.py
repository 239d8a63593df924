"""How often a model prefers the chosen response of the held-out pairs of configs/dpo.yaml.

    python examples/preference_accuracy.py --initial configs/dpo.yaml   # before training
    python examples/preference_accuracy.py RUN/model --reference configs/dpo.yaml

Every pair of dplaunch/resources/data/pairs-eval.jsonl is tokenised as the ranks train on it
(the run file's chat template and max_length; the loss's tokens of each response), and scored:

- "prefers chosen": the model's log-probability of the chosen response is the higher (a
  model's own preference, before or after training);
- with --reference RUN_FILE (the run file's model before training, DPO's reference):
  "reward accuracy", the pairs whose chosen response gained more log-probability than the
  rejected one (TRL's rewards/accuracies; 0% before training, every reward being 0).

Prints both per kind of question (sentiment, subject) and for all.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EVAL_DATA = REPO / "dplaunch" / "resources" / "data" / "pairs-eval.jsonl"


def scores(model, tokenizer, config, path: Path):
    """(kind, chosen log-probability, rejected log-probability) of every pair of PATH."""
    import torch
    from datasets import load_dataset

    from dplaunch.train.data import Batcher, Sharding, tokenize
    from dplaunch.train.preference import response_logps

    raw = load_dataset("json", data_files=str(path), split="train")
    kinds = [
        "sentiment" if "Positive or negative" in record["prompt"][-1]["content"] else "subject"
        for record in raw
    ]
    pairs = tokenize(raw, tokenizer, config.data, "dpo")
    assert len(pairs) == len(kinds), "a pair was left out: raise data.max_length"
    batcher = Batcher(
        pairs, Sharding(0, 1, 32, 1), pad_id=tokenizer.pad_token_id, task="dpo", seed=0
    )
    out = []
    model.eval()
    for start in range(0, len(pairs), 32):
        indices = list(range(start, min(start + 32, len(pairs))))
        with torch.no_grad():
            logps = response_logps(model, batcher.collate(indices))[0].view(2, -1)
        out += zip((kinds[i] for i in indices), logps[0].tolist(), logps[1].tolist(), strict=True)
    return out


def load_initial(run_file: str):
    """The run file's model before training (the reference), its tokenizer and config."""
    sys.path.insert(0, str(REPO))
    from dplaunch.config.load import load_run_config
    from dplaunch.train.data import attach_chat_template
    from dplaunch.train.modeling import load_model, load_tokenizer

    config = load_run_config(run_file)
    tokenizer = load_tokenizer(config.model)
    attach_chat_template(tokenizer, config.data, config.model.task)
    return load_model(config.model, tokenizer, config.train.seed), tokenizer, config


def report(title: str, marks: dict[str, list[bool]]) -> None:
    every = marks["sentiment"] + marks["subject"]
    cells = [f"{kind} {sum(m)}/{len(m)} = {sum(m) / len(m):.1%}" for kind, m in marks.items()]
    print(f"{title}: {sum(every) / len(every):.1%} of {len(every)} ({', '.join(cells)})")


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", nargs="?")
    parser.add_argument(
        "--initial", metavar="RUN_FILE", help="the run file's model before training"
    )
    parser.add_argument(
        "--reference",
        metavar="RUN_FILE",
        help="score rewards against this run file's initial model",
    )
    parser.add_argument("--data", default=str(EVAL_DATA))
    args = parser.parse_args()
    if (args.model_dir is None) == (args.initial is None):
        parser.error("give a model folder or --initial RUN_FILE")
    run_file = args.initial or args.reference
    if run_file is None:
        parser.error("--reference RUN_FILE names the data settings of a trained model")
    initial, tokenizer, config = load_initial(run_file)
    model = initial
    if args.model_dir is not None:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir)
        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    policy = scores(model, tokenizer, config, Path(args.data))
    prefers = {"sentiment": [], "subject": []}
    for kind, chosen, rejected in policy:
        prefers[kind].append(chosen > rejected)
    report("prefers chosen", prefers)
    if args.reference and args.model_dir is not None:
        rewards = {"sentiment": [], "subject": []}
        reference = scores(initial, tokenizer, config, Path(args.data))
        for (kind, chosen, rejected), (_, chosen0, rejected0) in zip(
            policy, reference, strict=True
        ):
            rewards[kind].append(chosen - chosen0 > rejected - rejected0)
        report("reward accuracy", rewards)


if __name__ == "__main__":
    main()
