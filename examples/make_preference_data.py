"""Generate the preference pairs configs/dpo.yaml tunes on (deterministic).

    python examples/make_preference_data.py dplaunch/resources/data/pairs-train.jsonl \
        dplaunch/resources/data/pairs-eval.jsonl

TRL's conversational preference format with an explicit prompt (`prompt`, `chosen` and
`rejected`: lists of messages) about one-sentence reviews built from the words of
make_sentiment_data.py ("The hotel felt awful."): the user asks whether the review is positive or
negative (chosen: the right word, rejected: the other), or what was reviewed (chosen: the
subject the review names, rejected: another subject). Short and without negations, so that a
model of 0.1 M parameters learns them in minutes. The evaluation file is held out: other pairs,
another seed.
"""

import random
import sys

from make_chat_data import write_held_out
from make_sentiment_data import NEGATIVE, POSITIVE, SUBJECTS


def pair(rng: random.Random) -> dict:
    positive = rng.random() < 0.5
    subject = rng.choice(SUBJECTS)
    word = rng.choice(POSITIVE if positive else NEGATIVE)
    text = f"{subject} {rng.choice(['was', 'felt', 'seemed'])} {word}."
    text = text[0].upper() + text[1:]
    if rng.random() < 0.75:
        question = f"{text} Positive or negative?"
        words = ["negative", "positive"]
        chosen, rejected = words[positive], words[not positive]
    else:
        question = f"{text} What is reviewed?"
        chosen = subject
        rejected = rng.choice([s for s in SUBJECTS if s != subject])
    return {
        "prompt": [{"role": "user", "content": question}],
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


def main(train_path: str, eval_path: str, train_rows: int = 1200, eval_rows: int = 200) -> None:
    write_held_out(pair, (train_path, train_rows, 3), (eval_path, eval_rows, 4))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
