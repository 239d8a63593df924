"""Generate the small labelled review dataset the embedded default fine-tunes on (deterministic).

    python examples/make_sentiment_data.py dplaunch/resources/data/reviews.jsonl

Labels: 1 = positive, 0 = negative. Negations ("was not great") flip the label, so a bag of
words is not enough and the pretrained encoder has something to learn.
"""

import json
import random
import sys

SUBJECTS = [
    "the film",
    "this phone",
    "the hotel",
    "our dinner",
    "the concert",
    "that book",
    "the service",
    "the new album",
    "this laptop",
    "the museum",
    "the coffee",
    "the game",
    "the tour",
    "the class",
]
POSITIVE = [
    "great",
    "wonderful",
    "excellent",
    "delightful",
    "superb",
    "charming",
    "brilliant",
    "pleasant",
    "fantastic",
    "lovely",
    "impressive",
    "enjoyable",
]
NEGATIVE = [
    "terrible",
    "awful",
    "boring",
    "disappointing",
    "dreadful",
    "mediocre",
    "poor",
    "annoying",
    "horrible",
    "dull",
    "frustrating",
    "unpleasant",
]
OPENERS = ["", "honestly, ", "to be fair, ", "overall ", "in my opinion ", "sadly ", "frankly, "]
ENDINGS = [".", "!", " and I would say so again.", ", as my friends agreed.", " this time.", "."]


def review(rng: random.Random) -> dict:
    positive = rng.random() < 0.5
    negated = rng.random() < 0.3
    word = rng.choice(POSITIVE if positive != negated else NEGATIVE)
    verb = "was not" if negated else rng.choice(["was", "felt", "seemed"])
    text = f"{rng.choice(OPENERS)}{rng.choice(SUBJECTS)} {verb} {word}{rng.choice(ENDINGS)}"
    return {"text": text[0].upper() + text[1:], "label": int(positive)}


def main(path: str, rows: int = 3000, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as out:
        for _ in range(rows):
            out.write(json.dumps(review(rng)) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
