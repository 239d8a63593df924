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


def main(train_path: str, eval_path: str, train_rows: int = 2000, eval_rows: int = 200) -> None:
    seen: set[str] = set()
    for path, rows, seed in ((train_path, train_rows, 1), (eval_path, eval_rows, 2)):
        rng = random.Random(seed)
        lines: list[str] = []
        while len(lines) < rows:
            line = json.dumps(conversation(rng))
            # held out: no evaluation conversation is also a training one
            if path == train_path or line not in seen:
                lines.append(line)
        seen.update(lines)
        with open(path, "w") as out:
            out.writelines(line + "\n" for line in lines)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
