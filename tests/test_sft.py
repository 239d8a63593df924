"""Supervised fine-tuning: the loss is on the answers only, packed examples never see each other,
and the step's loss is the mean over the trained tokens of the global batch on any rank count."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dplaunch.config.schema import DataConfig  # noqa: E402
from dplaunch.train.data import (  # noqa: E402
    IGNORE_INDEX,
    Batcher,
    Sharding,
    batch_tokens,
    tokenize,
)
from dplaunch.train.tokenizer import byte_level_tokenizer  # noqa: E402

# each turn is "<s>ROLE\nCONTENT</s>"; the generation prompt is "<s>assistant\n"
TEMPLATE = (
    "{% for m in messages %}{{ bos_token + m['role'] + '\\n' + m['content'] + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ bos_token + 'assistant\\n' }}{% endif %}"
)
BOS, EOS = 1, 2


def _ids(text: str) -> list[int]:
    # the byte-level tokenizer: byte b is token 3 + its place in the byte alphabet; ASCII letters,
    # digits and "\n" are in byte order there, so they are counted by hand as below
    return byte_level_tokenizer()(text, add_special_tokens=False)["input_ids"]


def _tokenized(records: list[dict], **data) -> list[dict]:
    from datasets import Dataset

    config = DataConfig(dataset="unused.jsonl", chat_template=TEMPLATE, max_length=128, **data)
    return list(tokenize(Dataset.from_list(records), byte_level_tokenizer(), config, "sft"))


def test_a_conversation_trains_on_the_assistant_turns_with_their_end_of_turn_token_only():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+3"},
        {"role": "assistant", "content": "6"},
    ]
    (row,) = _tokenized([{"messages": messages}])
    # by hand: five turns "<s>role\ncontent</s>"; trained are "4</s>" and "6</s>"
    turns = [
        ([BOS], _ids("system\nbe brief"), [EOS], False),
        ([BOS], _ids("user\n2+2"), [EOS], False),
        ([BOS], _ids("assistant\n"), [], False),
        ([], _ids("4"), [EOS], True),
        ([BOS], _ids("user\n3+3"), [EOS], False),
        ([BOS], _ids("assistant\n"), [], False),
        ([], _ids("6"), [EOS], True),
    ]
    expected_ids, expected_labels = [], []
    for bos, body, eos, trained in turns:
        tokens = bos + body + eos
        expected_ids += tokens
        expected_labels += tokens if trained else [IGNORE_INDEX] * len(tokens)
    assert row["input_ids"] == expected_ids
    assert row["labels"] == expected_labels
    assert sum(label != IGNORE_INDEX for label in row["labels"]) == 4


def test_prompt_completion_trains_on_the_completion_and_the_end_of_sequence_token():
    rows = _tokenized(
        [
            {"prompt": "Q: 1+1? A:", "completion": " 2"},
            {"prompt": "Q: 2+2? A:", "completion": " 4"},
        ]
    )
    prompt = _ids("Q: 1+1? A:")
    assert rows[0]["input_ids"] == prompt + _ids(" 2") + [EOS]
    assert rows[0]["labels"] == [IGNORE_INDEX] * len(prompt) + _ids(" 2") + [EOS]


def test_prompt_completion_as_messages_trains_on_the_completion_turn():
    (row,) = _tokenized(
        [
            {
                "prompt": [{"role": "user", "content": "hi"}],
                "completion": [{"role": "assistant", "content": "yo"}],
            }
        ]
    )
    prompt = [BOS] + _ids("user\nhi") + [EOS] + [BOS] + _ids("assistant\n")
    answer = _ids("yo") + [EOS]
    assert row["input_ids"] == prompt + answer
    assert row["labels"] == [IGNORE_INDEX] * len(prompt) + answer


def test_a_text_completion_ending_with_the_eos_token_is_closed_and_one_without_eos_is_not():
    from dplaunch.data.answer_spans import Renderer

    closing = Renderer(None, {}, "</s>", ("</s>",))
    pair = {"prompt": "2+2=", "completion": "4</s>"}
    assert closing.example(pair, "prompt-completion").unclosed == 0
    assert closing.example(pair, "prompt-completion").text == "2+2=4</s>"
    no_eos = Renderer(None, {}, None, ())
    assert no_eos.example({"prompt": "2+2=", "completion": "4"}, "prompt-completion").unclosed == 1


def test_loss_on_all_trains_every_token_but_the_first():
    (row,) = _tokenized([{"prompt": "ab", "completion": "c"}], loss_on="all")
    assert row["labels"] == [IGNORE_INDEX, *row["input_ids"][1:]]


def test_truncation_cuts_or_drops_and_an_example_without_answer_left_is_dropped():
    long_answer = {"prompt": "p", "completion": "x" * 40}
    long_prompt = {"prompt": "q" * 40, "completion": "y"}
    short = {"prompt": "a", "completion": "b"}
    from datasets import Dataset

    records = Dataset.from_list([long_answer, long_prompt, short])
    config = DataConfig(dataset="unused.jsonl", max_length=16)
    cut = list(tokenize(records, byte_level_tokenizer(), config, "sft"))
    # the long answer is cut to 16 tokens; the long prompt leaves no answer token: dropped
    assert [len(row["input_ids"]) for row in cut] == [16, 3]
    dropped = list(
        tokenize(
            records,
            byte_level_tokenizer(),
            config.model_copy(update={"truncation": "drop"}),
            "sft",
        )
    )
    assert [len(row["input_ids"]) for row in dropped] == [3]


CONVERSATIONS = [
    {
        "messages": [
            {"role": "user", "content": "add 3 and " + "4" * (1 + n % 5)},
            {"role": "assistant", "content": f"the sum is {n}"},
            *(
                [
                    {"role": "user", "content": "and twice that?"},
                    {"role": "assistant", "content": str(2 * n)},
                ]
                if n % 3 == 0
                else []
            ),
        ]
    }
    for n in range(12)
]


def _tiny_llama(attention: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=259,
        max_position_embeddings=256,
        attn_implementation=attention,
    )
    return LlamaForCausalLM(config).eval()


def _per_token_losses(model, batch) -> torch.Tensor:
    labels = batch["labels"]
    with torch.no_grad():
        # no KV cache, as the engine runs it: with one transformers does not look for packing
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs, use_cache=False).logits.float()
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)),
        labels[:, 1:].reshape(-1),
        reduction="none",
        ignore_index=IGNORE_INDEX,
    )
    return losses.view(labels[:, 1:].shape)


def _example_losses_packed(model, batcher: Batcher) -> dict[tuple[int, ...], float]:
    """Each example's summed answer loss, keyed by its token ids, from packed micro-batches."""
    found = {}
    indices = list(range(len(batcher.dataset)))
    for start in range(0, len(indices), 2):
        chunk = indices[start : start + 2]
        batch = batcher.collate(chunk)
        # the tokens counted for tokens/s are the blocks' own, not their padding
        assert batch_tokens(batch) == sum(len(batcher.dataset[i]["input_ids"]) for i in chunk)
        losses = _per_token_losses(model, batch)
        for r in range(batch["input_ids"].shape[0]):
            positions = batch["position_ids"][r].tolist()
            starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
            for a, b in zip(starts, starts[1:], strict=False):
                if b - a < 2:
                    continue  # padding: one-token segments
                ids = tuple(batch["input_ids"][r, a:b].tolist())
                found[ids] = float(losses[r, a : b - 1].sum())
    return found


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("flatten", [False, True])
def test_packed_examples_have_the_losses_they_have_alone(attention, flatten):
    from datasets import Dataset

    config = DataConfig(dataset="unused.jsonl", chat_template=TEMPLATE, max_length=96, packing=True)
    records = Dataset.from_list(CONVERSATIONS)
    packed = tokenize(records, byte_level_tokenizer(), config, "sft")
    assert len(packed) < len(CONVERSATIONS)  # several examples share a block
    sharding = Sharding(0, 1, 2, 1)
    batcher = Batcher(packed, sharding, pad_id=0, task="sft", seed=0)
    batcher.flatten_packed = flatten
    model = _tiny_llama(attention)
    together = _example_losses_packed(model, batcher)

    alone = tokenize(
        records, byte_level_tokenizer(), config.model_copy(update={"packing": False}), "sft"
    )
    assert len(together) == len(alone)
    for row in alone:
        batch = {
            "input_ids": torch.tensor([row["input_ids"]]),
            "attention_mask": torch.ones(1, len(row["input_ids"]), dtype=torch.long),
            "labels": torch.tensor([row["labels"]]),
        }
        own = float(_per_token_losses(model, batch).sum())
        assert together[tuple(row["input_ids"])] == pytest.approx(own, abs=1e-5, rel=0)


def test_packed_blocks_are_evaluated_one_row_a_forward_where_flash_attention_needs_it():
    """Flash-attention (GPU) reads packed segments from the position ids only in a batch of one
    row: training flattens a micro-batch into one; evaluation, which sums per row, then runs a row
    per forward. SDPA/eager (the block-diagonal mask) and unpacked rows keep the micro-batch."""
    from datasets import Dataset

    config = DataConfig(dataset="unused.jsonl", chat_template=TEMPLATE, max_length=96, packing=True)
    records = Dataset.from_list(CONVERSATIONS)
    rows = {}
    for packing in (True, False):
        data = tokenize(
            records, byte_level_tokenizer(), config.model_copy(update={"packing": packing}), "sft"
        )
        for flash in (True, False):
            batcher = Batcher(data, Sharding(0, 1, 4, 1), pad_id=0, task="sft", seed=0)
            batcher.flatten_packed = flash
            rows[packing, flash] = batcher.eval_rows(4)
    assert rows == {(True, True): 1, (True, False): 4, (False, True): 4, (False, False): 4}


def test_packing_without_isolation_would_differ():
    """The check above has teeth: the same packed row with a plain causal mask gives other losses."""
    from datasets import Dataset

    config = DataConfig(dataset="unused.jsonl", chat_template=TEMPLATE, max_length=96, packing=True)
    packed = tokenize(Dataset.from_list(CONVERSATIONS), byte_level_tokenizer(), config, "sft")
    batcher = Batcher(packed, Sharding(0, 1, 1, 1), pad_id=0, task="sft", seed=0)
    shared = next(i for i, row in enumerate(packed) if row["position_ids"].count(0) > 1)
    batch = batcher.collate([shared])
    model = _tiny_llama("sdpa")
    isolated = _per_token_losses(model, batch)
    leaky = dict(batch)
    leaky["attention_mask"] = torch.ones_like(batch["input_ids"])
    assert (isolated - _per_token_losses(model, leaky)).abs().max() > 1e-3


def test_micro_batches_are_weighted_by_their_answer_tokens():
    from datasets import Dataset

    config = DataConfig(dataset="unused.jsonl", chat_template=TEMPLATE, max_length=96)
    rows = tokenize(Dataset.from_list(CONVERSATIONS), byte_level_tokenizer(), config, "sft")
    # 2 ranks × 2 micro-batches of 2: every micro-batch's share n·4/N of the step's N answer tokens
    order = torch.arange(len(rows)).numpy()
    answers = [sum(label != IGNORE_INDEX for label in row["labels"]) for row in rows]
    total = sum(answers[:8])
    for rank in (0, 1):
        batcher = Batcher(rows, Sharding(rank, 2, 2, 2), pad_id=0, task="sft", seed=0)
        for m, batch in enumerate(batcher.step_micro_batches(order, 0)):
            first = rank * 4 + m * 2
            share = (answers[first] + answers[first + 1]) * 4 / total
            assert float(batch["loss_scale"]) == pytest.approx(share)
            assert int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()) == (
                answers[first] + answers[first + 1]
            )


def test_sft_on_two_ranks_matches_one_rank_on_the_same_global_batch(tmp_path):
    # packed chat examples: blocks of unequal length and unequal answer tokens. A global batch of
    # 12 is micro 4 × accumulation 3 on 1 rank and micro 3 × 2 on 2, so the micro-batches hold
    # other blocks; the step's loss is the mean over the answer tokens of all 12 either way
    from safetensors.torch import load_file

    from tests.helpers import (
        REPO,
        SFT_CONFIG,
        max_relative_gap,
        read_metrics,
        train,
        train_losses,
    )

    config = write_sft_config(tmp_path / "sft.yaml", SFT_CONFIG)
    flags = ("--max-steps", "3", "--global-batch", "12", "--set", "train.log_every=1")
    runs = {(1, 4): tmp_path / "dp1", (2, 3): tmp_path / "dp2"}
    # the 2-rank run also evaluates and answers the sample prompts at the end (rank 0 alone
    # generates): neither may change the training
    samples = ("--set", f"train.sample_prompts={REPO / 'examples' / 'sft-prompts.jsonl'}")
    samples += ("--set", f"data.eval_dataset={REPO / 'dplaunch/resources/data/chat-eval.jsonl'}")
    printed = {}
    for (gpus, micro), run in runs.items():
        # the 1-rank run keeps its last step's checkpoint, for `dplaunch export`
        extra = samples if gpus == 2 else ("--set", "train.checkpoint_every=3")
        printed[gpus] = train(
            run,
            "--cpu",
            "--gpus",
            str(gpus),
            "--micro-batch",
            str(micro),
            *flags,
            *extra,
            config=config,
        )
    shapes = [
        (h["micro_batch_size"], h["gradient_accumulation_steps"])
        for h in (read_metrics(run)[0] for run in runs.values())
    ]
    assert shapes == [(4, 3), (3, 2)]
    one, two = (train_losses(run) for run in runs.values())
    assert len(one) == 3 and max_relative_gap(two, one) < 1e-5, (one, two)
    # FSDP2 on the same packed examples, with activation checkpointing: the same losses
    fsdp = tmp_path / "fsdp2"
    checkpointing = ("--set", "model.gradient_checkpointing=true")
    train(fsdp, "--cpu", "--gpus", "2", "--micro-batch", "3", "--fsdp", "full", *checkpointing,
          *flags, config=config)  # fmt: skip
    assert read_metrics(fsdp)[0]["fsdp"] == "full"
    assert max_relative_gap(train_losses(fsdp), one) < 1e-5, (train_losses(fsdp), one)
    weights_1, weights_2 = (
        load_file(str(run / "model" / "model.safetensors")) for run in runs.values()
    )
    for name in weights_1:
        torch.testing.assert_close(weights_2[name], weights_1[name], rtol=1e-4, atol=1e-5, msg=name)
    (sampled,) = [r for r in read_metrics(runs[2, 3]) if r["type"] == "samples"]
    assert sampled["step"] == 3 and len(sampled["samples"]) == 3
    assert all(isinstance(s["answer"], str) for s in sampled["samples"])
    # `dplaunch export` of a checkpoint writes the tokenizer files of the run's own export, chat
    # template included (before: dropped, and examples/sft_accuracy.py failed on the export)
    from dplaunch.commands.export import run_export

    exported, own = tmp_path / "exported", runs[1, 4] / "model"
    assert run_export(runs[1, 4] / "checkpoints" / "step-3", exported) == 0

    def tokenizer_files(folder):
        return {
            path.name: path.read_text()
            for path in folder.iterdir()
            if path.suffix in (".json", ".jinja")
            and "config" not in path.name
            or path.name == "tokenizer_config.json"
        }

    assert tokenizer_files(exported) == tokenizer_files(own)
    assert "{% for message in messages %}" in "".join(tokenizer_files(own).values())
    # the log shows each prompt's question, not the repr of its message list
    assert "sample  'What is reviewed?' → '" in printed[2].stdout, printed[2].stdout[-2000:]
    assert "{'role'" not in printed[2].stdout
    assert any(runs[2, 3].glob("tensorboard/events.*"))


def write_sft_config(path, base):
    """configs/sft.yaml with the tiny test model (hidden 64) and no evaluation or samples."""
    import yaml

    from tests.helpers import TINY_LLAMA, write_config

    tiny = yaml.safe_load(TINY_LLAMA.read_text())["model"]["config"]
    return write_config(
        path,
        base,
        model={"config": tiny},
        data={"eval_dataset": None},
        train={"sample_prompts": None, "eval_every": None},
    )


def test_sft_stopped_at_step_2_resumes_with_bit_identical_losses(tmp_path):
    from tests.helpers import SFT_CONFIG, train, train_losses

    config = write_sft_config(tmp_path / "sft.yaml", SFT_CONFIG)
    flags = ("--cpu", "--gpus", "1", "--max-steps", "4", "--global-batch", "6")
    flags += ("--set", "train.log_every=1")
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    train(straight, *flags, config=config)
    result = train(stopped, *flags, "--set", "train.stop_after_steps=2", config=config)
    assert "stopped at step 2 (train.stop_after_steps)" in result.stderr
    train(stopped, *flags, "--resume", "auto", config=config)
    assert train_losses(stopped) == train_losses(straight)
    assert len(train_losses(straight)) == 4


def test_run_yaml_of_a_causal_lm_run_reads_back_in_the_ranks():
    # run.yaml lists every key with its default: the sft keys' defaults are no sft setting
    import yaml

    from dplaunch.config.load import dump_run_config, load_run_config
    from dplaunch.config.schema import RunConfig
    from tests.helpers import SFT_CONFIG, TINY_LLAMA

    for run_file in (TINY_LLAMA, SFT_CONFIG):
        config = load_run_config(run_file)
        assert RunConfig.model_validate(yaml.safe_load(dump_run_config(config))) == config


def test_examples_cut_or_left_out_are_counted_before_launch(tmp_path):
    import json

    from tests.helpers import SFT_CONFIG, run_dplaunch

    def notes(*args):
        result = run_dplaunch("train", SFT_CONFIG, "--dry-run", "-o", tmp_path / "r", *args)
        assert result.returncode == 0, result.stderr
        return [line for line in result.stdout.splitlines() if line.startswith("note: ")]

    def said(line: str, notes: list[str]) -> int:
        # the note's place among the plan's notes (each names an example: "(e.g. line 6 of …)")
        return next(i for i, note in enumerate(notes) if note.startswith(f"note: {line} (e.g. "))

    assert not any("exceed" in line for line in notes())
    cut = notes("--set", "data.max_length=200")
    # the answers cut come first, loudly; then how many the limit truncates
    answers_cut = said(
        "ANSWERS CUT: 136 of 2,000 conversations lose answer tokens to data.max_length 200 "
        "(1,128 answer tokens never trained) — raise data.max_length, or set data.truncation: drop",
        cut,
    )
    truncated = said(
        "136 of 2,000 conversations exceed 200 tokens (data.max_length): truncated", cut
    )
    assert answers_cut < truncated
    # a prompt longer than max_length leaves no answer token: never trained on silently
    data = tmp_path / "pairs.jsonl"
    rows = [{"prompt": "p" * (60 if n < 3 else 5), "completion": "c"} for n in range(20)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    pairs = ("--set", f"data.dataset={data}", "--set", "data.max_length=40")
    pairs += ("--set", "data.eval_dataset=null", "--set", "train.sample_prompts=null")
    pairs += ("--global-batch", "4")
    noted = notes(*pairs)
    said("3 of 20 examples exceed 40 tokens (data.max_length): truncated", noted)
    said(
        "3 of 20 examples have no answer token left after truncation: dropped (raise "
        "data.max_length to keep them)",
        noted,
    )
