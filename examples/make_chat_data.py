"""Generate the small chat dataset configs/sft.yaml fine-tunes on (deterministic).

    python examples/make_chat_data.py dplaunch/resources/data/chat-train.jsonl \
        dplaunch/resources/data/chat-eval.jsonl

Conversations (a `messages` column, TRL's conversational format) about the short reviews of
make_sentiment_data.py: the user asks whether a review is positive or negative, and in half of
them then asks what was reviewed (the assistant names it as the review does). Some start with a
system turn. Reviews with a negation are left out: a model this small (0.7 M parameters, one
byte per token) needs far longer to learn them. The evaluation file is held out: other
conversations, another seed.
"""

import json
import random
import sys
from collections.abc import Callable

from make_sentiment_data import SUBJECTS, review

SYSTEM = "You judge reviews. Answer in a word or two."


def conversation(rng: random.Random) -> dict:
    item = review(rng)
    while " not " in item["text"]:
        item = review(rng)
    text = item["text"]
    subject = next(s for s in SUBJECTS if s in text.lower())
    messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
    messages += [
        {"role": "user", "content": f"Review: {text}\nPositive or negative?"},
        {"role": "assistant", "content": "positive" if item["label"] else "negative"},
    ]
    if rng.random() < 0.5:
        messages += [
            {"role": "user", "content": "What is reviewed?"},
            {"role": "assistant", "content": subject},
        ]
    return {"messages": messages}


def write_held_out(
    make: Callable[[random.Random], dict],
    train: tuple[str, int, int],
    evaluation: tuple[str, int, int],
) -> None:
    """JSON lines of MAKE(rng) into the training and evaluation files, each (path, rows, seed);
    no evaluation record is also a training one."""
    seen: set[str] = set()
    for path, rows, seed in (train, evaluation):
        rng = random.Random(seed)
        lines: list[str] = []
        while len(lines) < rows:
            line = json.dumps(make(rng))
            if path == train[0] or line not in seen:
                lines.append(line)
        seen.update(lines)
        with open(path, "w") as out:
            out.writelines(line + "\n" for line in lines)


def main(train_path: str, eval_path: str, train_rows: int = 2000, eval_rows: int = 200) -> None:
    write_held_out(conversation, (train_path, train_rows, 1), (eval_path, eval_rows, 2))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
