"""Answer accuracy of a chat model on the held-out conversations of configs/sft.yaml.

    python examples/sft_accuracy.py RUN/model                 # the fine-tuned model
    python examples/sft_accuracy.py --initial configs/sft.yaml  # the same model before training

Every assistant turn of dplaunch/resources/data/chat-eval.jsonl is asked for: the conversation
up to it, rendered with the model's chat template and its generation prompt, is answered
greedily; the answer counts when it equals the turn's text exactly. Prints the accuracy of the
sentiment answers, of the "what is reviewed" answers, and of all.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EVAL_DATA = REPO / "dplaunch" / "resources" / "data" / "chat-eval.jsonl"


def load(model_dir: str | None, run_file: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_dir is not None:
        return AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(
            model_dir
        )
    sys.path.insert(0, str(REPO))
    from dplaunch.config.load import load_run_config
    from dplaunch.train.data import attach_chat_template
    from dplaunch.train.modeling import load_model, load_tokenizer

    config = load_run_config(run_file)
    tokenizer = load_tokenizer(config.model)
    attach_chat_template(tokenizer, config.data, config.model.task)
    return load_model(config.model, tokenizer, config.train.seed), tokenizer


def questions(path: Path) -> list[tuple[str, list[dict], str]]:
    """(kind, conversation before the answer, the answer) for every assistant turn."""
    out = []
    for line in path.read_text().splitlines():
        messages = json.loads(line)["messages"]
        for index, message in enumerate(messages):
            if message["role"] == "assistant":
                kind = (
                    "sentiment"
                    if "Positive or negative" in messages[index - 1]["content"]
                    else "subject"
                )
                out.append((kind, messages[:index], message["content"]))
    return out


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", nargs="?")
    parser.add_argument(
        "--initial", metavar="RUN_FILE", help="the run file's model before training"
    )
    parser.add_argument("--data", default=str(EVAL_DATA))
    args = parser.parse_args()
    if (args.model_dir is None) == (args.initial is None):
        parser.error("give a model folder or --initial RUN_FILE")
    model, tokenizer = load(args.model_dir, args.initial)
    model.eval()
    tokenizer.padding_side = "left"
    asked = questions(Path(args.data))
    right: dict[str, list[bool]] = {"sentiment": [], "subject": []}
    for start in range(0, len(asked), 64):
        chunk = asked[start : start + 64]
        texts = [
            tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
            for _, history, _ in chunk
        ]
        batch = tokenizer(texts, add_special_tokens=False, return_tensors="pt", padding=True)
        with torch.no_grad():
            generated = model.generate(
                **batch,
                max_new_tokens=16,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        width = batch["input_ids"].shape[1]
        for (kind, _, answer), row in zip(chunk, generated, strict=True):
            said = tokenizer.decode(row[width:], skip_special_tokens=True)
            right[kind].append(said.strip() == answer)
    every = right["sentiment"] + right["subject"]
    for kind, marks in (*right.items(), ("all", every)):
        print(f"{kind:>9}: {sum(marks)}/{len(marks)} = {sum(marks) / len(marks):.1%}")


if __name__ == "__main__":
    main()
