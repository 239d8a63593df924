"""dplaunch's chat SFT trains the tokens TRL 1.16's SFTTrainer trains: token-level masks compared
with TRL's (assistant_only_loss for conversations, its default completion-only loss for
prompt-completion pairs) on offline BPE tokenizers carrying the real chat templates TRL ships.

Where the two differ, the test names the difference: TRL's training templates also train the
generation prompt's last tokens (gpt-oss's `<|start|>assistant`, DeepSeek's `<｜Assistant｜>`),
which the model is given at inference; and for Qwen3 and GLM-4-MoE TRL trains its own patched
template's text, while dplaunch trains the text the model's own template renders."""

from __future__ import annotations

import itertools
import json
import logging
import tempfile

import pytest

pytest.importorskip("trl")

from dplaunch.config.schema import DataConfig  # noqa: E402
from dplaunch.data.answer_spans import TemplateError  # noqa: E402
from dplaunch.data.example_tokens import pitfalls  # noqa: E402
from dplaunch.train.data import sft_examples_of  # noqa: E402
from tests.chat_tokenizers import bpe_tokenizer, family_tokenizer  # noqa: E402

IGNORE = -100
LLAMA_SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def trl_rows(records: list[dict], tokenizer, **options) -> list[tuple[list[int], list[bool]]]:
    """(input_ids, trained) of each record as TRL's SFTTrainer prepares it."""
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl import SFTConfig, SFTTrainer

    logging.getLogger("trl").setLevel(logging.ERROR)
    tiny = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    args = SFTConfig(
        output_dir=tempfile.mkdtemp(),
        report_to=[],
        max_length=None,
        shuffle_dataset=False,
        use_cpu=True,
        **options,
    )
    trainer = SFTTrainer(
        model=Qwen2ForCausalLM(tiny),
        args=args,
        train_dataset=Dataset.from_list(records),
        processing_class=tokenizer,
    )
    return [
        (row["input_ids"], [label != IGNORE for label in row["labels"]])
        for row in trainer.train_dataset
    ]


def dplaunch_rows(records: list[dict], tokenizer, **data) -> list:
    """Each record's TokenizedExample as the ranks build it (no length limit here)."""
    config = DataConfig(dataset="unused.jsonl", max_length=100_000, **data)
    pipeline = sft_examples_of(tokenizer, config, list(records[0]))
    details: list = []
    pipeline.tokens([pipeline.example(record) for record in records], details)
    return details


def trained_runs(tokenizer, ids: list[int], mask: list[bool]) -> list[str]:
    """The trained stretches of an example, decoded."""
    runs, current = [], []
    for token, trained in zip(ids, mask, strict=True):
        if trained:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


def only_in_trl(tokenizer, ids, trl_mask, ours_mask) -> list[str]:
    """The stretches TRL trains and dplaunch does not, decoded; dplaunch trains nothing TRL does not."""
    assert not any(o and not t for t, o in zip(trl_mask, ours_mask, strict=True))
    return trained_runs(
        tokenizer, ids, [t and not o for t, o in zip(trl_mask, ours_mask, strict=True)]
    )


# 1. an answer's first token that begins in the prompt --------------------------------------


def _reviews() -> list[tuple[str, str]]:
    # 16 pairs; 10 end the prompt with the space, which the answer's first token takes
    pairs = []
    for number, (thing, mood) in enumerate(
        itertools.product(("film", "book", "hotel", "museum"), ("great", "dull", "good", "bad"))
    ):
        spaced = number % 8 < 5
        label = "positive" if mood in ("great", "good") else "negative"
        prompt = f"Review: the {thing} was {mood}. Sentiment:" + (" " if spaced else "")
        pairs.append((prompt, ("" if spaced else " ") + label))
    return pairs


REVIEWS = _reviews()


def test_an_answer_token_that_begins_in_the_prompt_is_trained_as_trl_trains_it():
    """'Sentiment: ' + 'positive' is one token ' positive' whose space lies in the prompt: TRL
    trains it; the old rule (a token is trained when its first character is in the answer) left
    it out, so a one-word answer trained only its end-of-sequence token."""
    tokenizer = bpe_tokenizer(["<s>", "</s>", "<unk>"], LLAMA_SPECIAL)
    records = [{"prompt": prompt, "completion": completion} for prompt, completion in REVIEWS]
    straddling = [prompt.endswith(" ") for prompt, _ in REVIEWS]
    assert sum(straddling) == 10  # the others put the space in the completion
    ours = dplaunch_rows(records, tokenizer)
    for (ids, mask), row, straddles in zip(
        trl_rows(records, tokenizer), ours, straddling, strict=True
    ):
        assert row.input_ids == ids and row.trained == mask
        answer = trained_runs(tokenizer, ids, mask)
        assert answer in ([" positive</s>"], [" negative</s>"])
        assert row.straddling == int(straddles)


VICUNA = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ 'USER: ' + m['content'] + '\\n' }}"
    "{% else %}{{ 'ASSISTANT: ' + m['content'] + eos_token + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT: ' }}{% endif %}"
)
# the same template with TRL's {% generation %} markers around what the model writes
VICUNA_MARKED = VICUNA.replace(
    "{{ 'ASSISTANT: ' + m['content'] + eos_token + '\\n' }}",
    "{{ 'ASSISTANT: ' }}{% generation %}{{ m['content'] + eos_token + '\\n' }}{% endgeneration %}",
)


def test_a_conversation_answer_after_a_generation_prompt_ending_in_a_space_is_trained_whole():
    # the prompt ends with "ASSISTANT: "; the answer's first token " negative" takes that space
    tokenizer = bpe_tokenizer(["<s>", "</s>", "<unk>"], LLAMA_SPECIAL, template=VICUNA)
    records = [
        {"messages": [{"role": "user", "content": f"the {thing} was dull?"},
                      {"role": "assistant", "content": "negative"}]}
        for thing in ("film", "book")
    ]  # fmt: skip
    ours = dplaunch_rows(records, tokenizer)
    tokenizer.chat_template = VICUNA_MARKED
    for (ids, mask), row in zip(
        trl_rows(records, tokenizer, assistant_only_loss=True), ours, strict=True
    ):
        assert row.input_ids == ids and row.trained == mask
        assert trained_runs(tokenizer, ids, mask) == [" negative</s>\n"]
        assert row.straddling == 1


# 2. tools and chat_template_kwargs ---------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_temperature",
            "description": "Get the temperature of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_CHAT = [
    {"role": "user", "content": "weather in paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_temperature", "arguments": {"city": "paris"}},
            }
        ],
    },
    {"role": "tool", "name": "get_temperature", "content": "sunny, 20 degrees"},
    {"role": "assistant", "content": "it is sunny"},
]


def test_tools_reach_the_template_as_trl_gives_them(capsys):
    tokenizer = family_tokenizer("qwen2.5")
    column = [{"messages": TOOL_CHAT, "tools": TOOLS}]
    as_text = [{"messages": TOOL_CHAT, "tools": json.dumps(TOOLS)}]
    ((ids, mask),) = trl_rows(column, tokenizer, assistant_only_loss=True)
    for records, data in (
        (column, {}),
        (as_text, {}),
        ([{"messages": TOOL_CHAT}], {"tools": TOOLS}),
    ):
        (row,) = dplaunch_rows(records, tokenizer, **data)
        assert row.input_ids == ids
        assert only_in_trl(tokenizer, ids, mask, row.trained) == ["\n", "\n"]  # after "assistant"
    without = dplaunch_rows([{"messages": TOOL_CHAT}], tokenizer)[0]
    print(f"tool chat: {len(without.input_ids)} tokens without its tools, {len(ids)} with")
    assert "get_temperature" in tokenizer.decode(
        ids[: ids.index(tokenizer.convert_tokens_to_ids("<|im_start|>"), 1)]
    )
    assert len(without.input_ids) < len(ids) // 2


def test_chat_template_kwargs_reach_the_template():
    tokenizer = family_tokenizer("qwen3")
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    thinking, quiet = (
        {"messages": chat, "chat_template_kwargs": {"enable_thinking": on}} for on in (True, False)
    )
    for record in (thinking, quiet):
        ((ids, mask),) = trl_rows([record], tokenizer, assistant_only_loss=True)
        (row,) = dplaunch_rows([record], tokenizer)
        assert row.input_ids == ids
    # the run-wide key renders as the column does; with thinking off the empty think block is
    # the generation prompt's (given at inference), so not trained
    (run_wide,) = dplaunch_rows(
        [{"messages": chat}], tokenizer, chat_template_kwargs={"enable_thinking": False}
    )
    (column,) = dplaunch_rows([quiet], tokenizer)
    assert run_wide.input_ids == column.input_ids and run_wide.trained == column.trained
    assert trained_runs(tokenizer, column.input_ids, column.trained) == ["hello<|im_end|>\n"]


# 3. ShareGPT, roles beyond the four, content as text parts ---------------------------------


def test_sharegpt_conversations_train_as_the_same_messages():
    tokenizer = family_tokenizer("qwen2.5")
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "the film was dull?"},
        {"role": "assistant", "content": "negative"},
    ]
    speakers = {"user": "human", "assistant": "gpt", "system": "system"}
    sharegpt = [{"from": speakers[m["role"]], "value": m["content"]} for m in messages]
    ((ids, mask),) = trl_rows([{"messages": messages}], tokenizer, assistant_only_loss=True)
    (row,) = dplaunch_rows([{"conversations": sharegpt}], tokenizer)
    assert row.input_ids == ids
    assert only_in_trl(tokenizer, ids, mask, row.trained) == ["\n"]
    assert trained_runs(tokenizer, ids, row.trained) == ["negative<|im_end|>\n"]


def test_content_given_as_text_parts_trains_as_the_joined_text():
    tokenizer = family_tokenizer("phi3")
    as_text = [
        {"role": "user", "content": "the film was dull?"},
        {"role": "assistant", "content": "negative"},
    ]
    as_parts = [
        {"role": "user", "content": [{"type": "text", "text": "the film "}, {"type": "text", "text": "was dull?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "negative"}]},
    ]  # fmt: skip
    ((ids, mask),) = trl_rows([{"messages": as_text}], tokenizer, assistant_only_loss=True)
    (row,) = dplaunch_rows([{"messages": as_parts}], tokenizer)
    assert row.input_ids == ids and row.trained == mask


def test_a_role_the_template_renders_trains_and_one_it_drops_is_refused_by_message():
    chat = [
        {"role": "developer", "content": "answer in one word"},
        {"role": "user", "content": "the film was dull?"},
        {"role": "assistant", "content": "negative"},
    ]
    tokenizer = family_tokenizer("gpt-oss")
    ((ids, mask),) = trl_rows([{"messages": chat}], tokenizer, assistant_only_loss=True)
    (row,) = dplaunch_rows([{"messages": chat}], tokenizer)
    assert row.input_ids == ids
    assert only_in_trl(tokenizer, ids, mask, row.trained) == ["<|start|>assistant"]
    # Qwen3's template has no developer role: it would leave the message out, silently
    with pytest.raises(TemplateError, match=r"message 1 \(role \"developer\"\) is left out"):
        dplaunch_rows([{"messages": chat}], family_tokenizer("qwen3"))


# 4. templates that render earlier turns differently --------------------------------------

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "the film was dull?"},
    {"role": "assistant", "content": "negative"},
    {"role": "user", "content": "what is reviewed?"},
    {"role": "assistant", "content": "the film", "reasoning_content": "the user asks what"},
]
# family → the generation prompt's tokens TRL's training template also trains, per answer
GENERATION_PROMPT_TRAINED_BY_TRL = {
    "phi3": [],
    "phi3.5": [],
    "gpt-oss": ["<|start|>assistant", "<|start|>assistant"],
    "deepseek-v3": ["<｜Assistant｜>", "<｜Assistant｜>"],
    "deepseek-r1-distill": ["<｜Assistant｜>", "<｜Assistant｜>"],
    "nemotron-3-nano": ["<think>", "<think>\n"],
}


@pytest.mark.parametrize("family", sorted(GENERATION_PROMPT_TRAINED_BY_TRL))
def test_multi_turn_chats_train_what_trl_trains_under_the_models_own_template(family):
    tokenizer = family_tokenizer(family)
    ((ids, mask),) = trl_rows([{"messages": CHAT}], tokenizer, assistant_only_loss=True)
    (row,) = dplaunch_rows([{"messages": CHAT}], tokenizer)
    assert row.input_ids == ids
    assert (
        only_in_trl(tokenizer, ids, mask, row.trained) == GENERATION_PROMPT_TRAINED_BY_TRL[family]
    )


def test_qwen3_trains_each_turn_as_its_template_renders_it():
    """Qwen3's template drops the reasoning of turns before the last question; TRL's patched
    template keeps an (empty) think block in every turn. dplaunch trains the text Qwen3's own
    template renders: earlier answers plain, the last one with its reasoning, as TRL does."""
    tokenizer = family_tokenizer("qwen3")
    ((ids, mask),) = trl_rows([{"messages": CHAT}], tokenizer, assistant_only_loss=True)
    (row,) = dplaunch_rows([{"messages": CHAT}], tokenizer)
    theirs = trained_runs(tokenizer, ids, mask)
    ours = trained_runs(tokenizer, row.input_ids, row.trained)
    assert theirs[0] == "<think>\n\n</think>\n\nnegative<|im_end|>\n"
    assert ours[0] == "negative<|im_end|>\n"
    assert ours[1] == theirs[1] == "<think>\nthe user asks what\n</think>\n\nthe film<|im_end|>\n"
    tools = dplaunch_rows([{"messages": TOOL_CHAT, "tools": TOOLS}], tokenizer)[0]
    assert trained_runs(tokenizer, tools.input_ids, tools.trained) == [
        '<tool_call>\n{"name": "get_temperature", "arguments": {"city": "paris"}}\n</tool_call><|im_end|>\n',
        "<think>\n\n</think>\n\nit is sunny<|im_end|>\n",
    ]


def test_a_template_that_drops_tool_calls_is_refused_naming_the_message():
    with pytest.raises(TemplateError, match="the tool calls of message 2 are left out"):
        dplaunch_rows([{"messages": TOOL_CHAT}], family_tokenizer("phi3"))


# 5. a turn closed by the next role's tag ----------------------------------------------------


def test_glm_trains_the_next_roles_tag_as_trl_and_warns_of_the_last_answer_without_one():
    tokenizer = family_tokenizer("glm-4-moe")
    ((ids, mask),) = trl_rows([{"messages": CHAT}], tokenizer, assistant_only_loss=True)
    rows = dplaunch_rows([{"messages": CHAT}], tokenizer)
    theirs = trained_runs(tokenizer, ids, mask)
    ours = trained_runs(tokenizer, rows[0].input_ids, rows[0].trained)
    assert ours[0] == theirs[0] == "\n<think></think>\nnegative<|user|>"
    # TRL's patched template adds a <|user|> after the last answer; GLM's own renders none
    assert theirs[1] == ours[1] + "<|user|>"
    config = DataConfig(dataset="unused.jsonl", max_length=100_000)
    pipeline = sft_examples_of(tokenizer, config, ["messages"])
    encoded = pipeline.tokens([pipeline.example({"messages": CHAT})])
    (warning,) = [
        p
        for p in pitfalls(encoded, 1, "conversations", 100_000, "truncate")
        if p.name == "unclosed"
    ]
    assert warning.count == 1 and "never learns to stop" in warning.text


# 6. BOS of a text prompt ------------------------------------------------------------------


def test_a_text_prompt_starts_with_the_bos_token_the_tokenizer_adds():
    tokenizer = bpe_tokenizer(["<s>", "</s>", "<unk>"], LLAMA_SPECIAL, bos="<s>")
    records = [{"prompt": prompt, "completion": completion} for prompt, completion in REVIEWS[:4]]
    for (ids, mask), row in zip(
        trl_rows(records, tokenizer), dplaunch_rows(records, tokenizer), strict=True
    ):
        assert ids[0] == tokenizer.bos_token_id
        assert row.input_ids == ids and row.trained == mask
    # as at inference: the prompt's tokens are tokenizer(prompt)'s
    prompt = REVIEWS[1][0]
    row = dplaunch_rows([{"prompt": prompt, "completion": " x"}], tokenizer)[0]
    assert row.input_ids[: len(tokenizer(prompt).input_ids)] == tokenizer(prompt).input_ids
