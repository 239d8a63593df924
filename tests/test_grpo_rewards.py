"""The reward functions of model.task: grpo (dplaunch/tasks/grpo_rewards.py): the run file's
entries, the built-ins on text and conversational completions, user functions imported by module
and by file, the checks before launch and the checks of what a function returns at a step."""

from __future__ import annotations

import ast
import math
import sys
import textwrap
from pathlib import Path

import pytest

from dplaunch.errors import UserError
from dplaunch.tasks import grpo_rewards
from dplaunch.tasks.grpo_rewards import (
    FORMAT_PATTERN,
    LENGTH_TARGET,
    RewardError,
    RewardSpec,
    check_rewards,
    combine,
    exact_match_reward,
    final_answer,
    format_reward,
    length_reward,
    load_reward,
    parse_reward_entry,
    score,
)


def said(message: str) -> list[dict[str, str]]:
    """A conversational completion (TRL's format): one assistant message."""
    return [{"role": "assistant", "content": message}]


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """A folder for user modules, on sys.path for the test alone; the modules imported from it
    (by name or by file) are forgotten afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, source: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
        return path

    yield write
    for name in set(sys.modules) - before:
        del sys.modules[name]


# --- the module stays light: the command line imports it before launch -----------------------


def test_imports_neither_torch_nor_pydantic():
    tree = ast.parse(Path(grpo_rewards.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported <= set(sys.stdlib_module_names) | {"dplaunch", "__future__"}, imported


# --- parsing the entries ------------------------------------------------------------------------


def test_entries_parse_with_defaults_and_options():
    assert parse_reward_entry("exact_match") == RewardSpec("builtin", "exact_match", "answer")
    assert parse_reward_entry({"exact_match": "solution"}).option == "solution"
    assert parse_reward_entry("format") == RewardSpec("builtin", "format", FORMAT_PATTERN)
    assert parse_reward_entry({"format": "^ok$"}).option == "^ok$"
    assert parse_reward_entry("length").option == LENGTH_TARGET
    assert parse_reward_entry({"length": 64}) == RewardSpec("builtin", "length", 64)
    user = parse_reward_entry("my_pkg.rewards:score")
    assert (user.kind, user.module, user.attribute, user.from_file) == (
        "user",
        "my_pkg.rewards",
        "score",
        False,
    )
    assert parse_reward_entry("lib/rewards.py:score").from_file


@pytest.mark.parametrize(
    ("entry", "said_"),
    [
        (3, "entry 2 is a int (3)"),
        ("exact", "entry 2 'exact' is no built-in reward nor module:function"),
        ({"exact_match": "a", "format": "b"}, "entry 2 is a mapping with 2 keys"),
        ({"bleu": 1}, "entry 2: 'bleu' is no built-in reward"),
        ({"m:f": 1}, "entry 2: the user function m:f takes no option"),
        ({"exact_match": 3}, "exact_match's option is the answer's column, not 3"),
        ({"format": "(unclosed"}, "format's regular expression '(unclosed' does not compile"),
        ({"length": 0}, "length's option is the target length in characters, not 0"),
        ({"length": True}, "not True"),
        ({"length": "64"}, "not '64'"),
        ("my_mod:", "'my_mod:' names no function after its colon"),
        ("my mod:f", "'my mod' is no module name nor .py file"),
    ],
)
def test_malformed_entries_are_one_line(entry, said_):
    with pytest.raises(UserError) as raised:
        parse_reward_entry(entry, index=2)
    assert raised.value.field == "train.grpo.rewards"
    assert said_ in raised.value.problem
    assert raised.value.fix and "\n" not in raised.value.line()


# --- the built-ins ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        (r"so \boxed{\frac{1}{2}}, or \boxed{7}", "7"),
        (r"\boxed{\frac{1}{2}} and #### 9", r"\frac{1}{2}"),
        ("steps\n#### 1,234\nthen chatter 5", "1,234"),
        ("<think>2+2</think> <answer> 4 </answer>", " 4 "),
        ("It costs 3 apples and -12.5 dollars.", "-12.5"),
        ("a total of 1,000,000.", "1,000,000"),
        ("no answer here", None),
    ],
)
def test_final_answer_in_order(text, answer):
    assert final_answer(text) == answer


def test_exact_match_on_strings():
    exact_match = exact_match_reward()
    completions = [
        r"The result is \boxed{3.0}",  # 3.0 is 3
        "work\n#### 1,000.",  # commas and a trailing period
        "<answer>Paris</answer>",
        "so the answer is 41",  # the last number, wrong
        "no number at all",
        r"\boxed{3}",  # a row with no answer: not scored
    ]
    answers = ["3", "1000", "Paris", "42", "7", None]
    assert exact_match([""] * 6, completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, 0.0, None]


def test_exact_match_on_conversations_and_an_other_column():
    exact_match = exact_match_reward("solution")
    completions = [said(r"\boxed{12}"), said("I think it is 13"), [], said(None)]
    # GSM8K's answer column is the worked solution ending "#### 12"; numbers may be numbers
    solutions = ["6 + 6 = 12\n#### 12", 12, "0", "0"]
    rewards = exact_match([[]] * 4, completions, solution=solutions, other=[1] * 4)
    assert rewards == [1.0, 0.0, 0.0, 0.0]


def test_exact_match_without_its_column_says_so():
    with pytest.raises(ValueError, match=r"no column 'answer' \(its columns: solution\)"):
        exact_match_reward()([""], ["1"], solution=["1"])


def test_format_default_is_trl_reasoning_format():
    format_ = format_reward()
    good = "<think>\nlet me see\n</think>\n<answer>\n4\n</answer>"
    assert format_([""] * 4, [good, said(good), "<answer>4</answer>", good + " extra"]) == [
        1.0,
        1.0,
        0.0,
        0.0,
    ]
    assert format_reward(r"\d+")(["", ""], ["42", "42 apples"]) == [1.0, 0.0]


def test_length_is_distance_from_the_target():
    length = length_reward(10)
    completions = ["x" * 10, "x" * 5, said("x" * 20), ""]
    assert length([""] * 4, completions) == [0.0, -0.5, -1.0, -1.0]


# --- loading user functions ---------------------------------------------------------------------

GOOD = """
    CALLS = []

    def score(prompts, completions, **kwargs):
        CALLS.append(sorted(kwargs))
        return [float(len(c)) for c in completions]
"""


def test_user_function_by_module(user_modules, tmp_path):
    user_modules("grpo_user_rewards.py", GOOD)
    function = load_reward(parse_reward_entry("grpo_user_rewards:score"), tmp_path / "elsewhere")
    assert (function.name, function.__name__, function.source) == (
        "score",
        "score",
        "grpo_user_rewards:score",
    )
    assert function(["p"], ["abc"], answer=["x"]) == [3.0]


def test_user_function_by_file_relative_to_the_run_file(user_modules, tmp_path):
    user_modules("runs/lib/grpo_helper_words.py", "WORD = 'yes'\n")
    user_modules(
        "runs/lib/grpo_file_rewards.py",
        """
        import grpo_helper_words  # beside it: its folder is on sys.path

        LOADS = globals().setdefault("LOADS", 0) + 1

        def says_yes(completions, **kwargs):
            return [1.0 if grpo_helper_words.WORD in c else 0.0 for c in completions]
        """,
    )
    spec = parse_reward_entry("lib/grpo_file_rewards.py:says_yes")
    first = load_reward(spec, tmp_path / "runs")
    second = load_reward(spec, tmp_path / "runs")
    assert first(["p", "p"], ["yes", "no"]) == [1.0, 0.0]
    # one module a process, its folder once on sys.path
    assert first.function is second.function
    assert sys.path.count(str((tmp_path / "runs/lib").resolve())) == 1


def test_a_dotted_module_not_on_sys_path_is_found_beside_the_run_file(user_modules, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "grpo_beside_rewards.py").write_text(textwrap.dedent(GOOD))
    function = load_reward(parse_reward_entry("grpo_beside_rewards:score"), run_dir)
    assert function(["p"], ["ab"]) == [2.0]


@pytest.mark.parametrize(
    ("source", "entry", "said_"),
    [
        (
            "x = 1 / 0\n",
            "grpo_broken:f",
            "reward function grpo_broken:f does not import: ZeroDivisionError: division by zero",
        ),
        (
            "import grpo_no_such_dependency\n",
            "grpo_broken:f",
            "does not import: ModuleNotFoundError: No module named 'grpo_no_such_dependency'",
        ),
        ("def f(:\n", "grpo_broken.py:f", "does not import: SyntaxError: "),
        ("", "grpo_nowhere:f", "does not import: no module 'grpo_nowhere' on sys.path nor file"),
        ("", "missing/grpo_nowhere.py:f", "does not import: no file "),
        ("g = 1\n", "grpo_broken:f", "reward function grpo_broken:f: grpo_broken has no 'f'"),
        ("f = 3\n", "grpo_broken:f", "reward function grpo_broken:f is not callable (a int)"),
        (
            "def f(x):\n    return [0.0]\n",
            "grpo_broken:f",
            "has the wrong signature (x): it does not take prompts, completions, **kwargs",
        ),
        (
            "def f(prompts, completions):\n    return [0.0]\n",
            "grpo_broken:f",
            "it does not take **kwargs (the data's other columns)",
        ),
        (
            "def f(prompts, completions, /, **kw):\n    return [0.0]\n",
            "grpo_broken:f",
            "it does not take prompts as a keyword, completions as a keyword",
        ),
        (
            "async def f(prompts, completions, **kw):\n    return [0.0]\n",
            "grpo_broken:f",
            "reward function grpo_broken:f is async",
        ),
    ],
)
def test_user_functions_that_cannot_be_used_are_one_line(
    user_modules, tmp_path, source, entry, said_
):
    user_modules("grpo_broken.py", source)
    with pytest.raises(UserError) as raised:
        load_reward(parse_reward_entry(entry), tmp_path)
    line = raised.value.line()
    assert line.startswith("train.grpo.rewards: ") and "\n" not in line
    assert said_ in raised.value.problem
    assert raised.value.fix


# --- the checks before launch -------------------------------------------------------------------


def test_check_rewards_loads_them_all(user_modules, tmp_path):
    user_modules("grpo_checked.py", GOOD)
    functions = check_rewards(
        [{"exact_match": "solution"}, "format", "grpo_checked:score"],
        [1.0, -0.5, 0.1],
        {"prompt", "solution"},
        tmp_path,
    )
    assert [f.name for f in functions] == ["exact_match", "format", "score"]


@pytest.mark.parametrize(
    ("entries", "weights", "line"),
    [
        ([], None, "train.grpo.rewards: is empty: GRPO needs at least one reward function"),
        ("format", None, "train.grpo.rewards: is one entry, not a list"),
        (
            ["format", "length"],
            [1.0, 1.0, 2.0],
            "train.grpo.reward_weights: has 3 weights for 2 reward functions — give one weight "
            "per entry of train.grpo.rewards, in its order, or leave it out (every weight 1.0)",
        ),
        (["format"], [math.nan], "train.grpo.reward_weights: weight 1 is nan"),
        (["format", "length"], [1.0, math.inf], "train.grpo.reward_weights: weight 2 is inf"),
        (["format"], ["1"], "train.grpo.reward_weights: weight 1 is '1', not a number"),
        (
            ["exact_match"],
            None,
            "train.grpo.rewards: exact_match compares with the column 'answer', which the "
            "training data does not have (its columns: prompt, solution)",
        ),
        (
            ["format", {"format": "x"}],
            None,
            "train.grpo.rewards: two reward functions are named 'format' (format and format): "
            "their metrics (rewards/format/mean) would collide",
        ),
    ],
)
def test_check_rewards_refusals(tmp_path, entries, weights, line):
    with pytest.raises(UserError) as raised:
        check_rewards(entries, weights, {"prompt", "solution"}, tmp_path)
    assert raised.value.line().startswith(line)
    assert "\n" not in raised.value.line()


def test_two_user_functions_of_one_name_collide(user_modules, tmp_path):
    user_modules("grpo_first.py", GOOD)
    user_modules("grpo_second.py", GOOD)
    with pytest.raises(UserError, match=r"named 'score' \(grpo_first:score and grpo_second:score"):
        check_rewards(["grpo_first:score", "grpo_second:score"], None, None, tmp_path)


def test_a_column_a_user_function_needs_must_exist(user_modules, tmp_path):
    user_modules("grpo_needs.py", "def f(prompts, completions, label, **kw):\n    return []\n")
    with pytest.raises(
        UserError, match=r"grpo_needs:f needs label, which it is not given: .* \(answer, prompt\)"
    ):
        check_rewards(["grpo_needs:f"], None, {"prompt", "answer"}, tmp_path)
    # unknown columns (not checked yet) or present: accepted
    assert check_rewards(["grpo_needs:f"], None, None, tmp_path)
    assert check_rewards(["grpo_needs:f"], None, {"prompt", "label"}, tmp_path)
    # the prompt comes as prompts=, never as a column of its own (TRL's call)
    user_modules("grpo_prompt.py", "def f(prompt, completions, **kw):\n    return []\n")
    with pytest.raises(UserError, match=r"grpo_prompt:f needs prompt, which it is not given"):
        check_rewards(["grpo_prompt:f"], None, {"prompt", "answer"}, tmp_path)


# --- scoring at a step --------------------------------------------------------------------------


def loaded(user_modules, tmp_path, body: str):
    """The user function my_mod:score whose body (after its def line) is BODY."""
    source = "def score(prompts, completions, **kwargs):\n" + textwrap.indent(body, "    ")
    user_modules("my_mod.py", source)
    sys.modules.pop("my_mod", None)
    return load_reward(parse_reward_entry("my_mod:score"), tmp_path)


def test_score_per_function_per_completion(user_modules, tmp_path):
    user = loaded(user_modules, tmp_path, "return [len(kwargs['completion_ids'][0]), None]\n")
    exact = load_reward(parse_reward_entry("exact_match"), tmp_path)
    rewards = score(
        [exact, user],
        [1.0, 0.5],
        ["p", "p"],
        [r"\boxed{2}", "3"],
        {"answer": ["2", None]},
        step=3,
        completion_ids=[[1, 2, 3, 4], [5]],
    )
    assert rewards[0][0] == 1.0 and math.isnan(rewards[0][1])
    assert rewards[1][0] == 4.0 and math.isnan(rewards[1][1])
    assert combine(rewards, [1.0, 0.5]) == [3.0, 0.0]
    assert combine(rewards, None) == [5.0, 0.0]


def test_completion_ids_only_when_given(user_modules, tmp_path):
    user = loaded(user_modules, tmp_path, "return [float('completion_ids' in kwargs)]\n")
    assert score([user], None, ["p"], ["c"], {}, step=0) == [[0.0]]


@pytest.mark.parametrize(
    ("body", "line"),
    [
        (
            "return [1.0, 2.0, 3.0]\n",
            "train.grpo.rewards: reward function my_mod:score returned 3 values for 8 completions "
            "at step 12 — return a list of 8 floats (None for a completion it does not score)",
        ),
        ("return [1.0] * 7 + [float('nan')]\n", "my_mod:score returned nan for completion 7 at"),
        ("return [1.0] * 7 + ['1']\n", "returned a str ('1') for completion 7, not a number at"),
        ("return 1.0\n", "reward function my_mod:score returned a float at step 12"),
        ("return {'a': 1}\n", "reward function my_mod:score returned a dict at step 12"),
        (
            "raise KeyError('solution')\n",
            "reward function my_mod:score raised KeyError: 'solution' at step 12 — fix the "
            "function and resume the run",
        ),
    ],
)
def test_what_a_function_returns_is_checked(user_modules, tmp_path, body, line):
    user = loaded(user_modules, tmp_path, body)
    with pytest.raises(RewardError) as raised:
        score([user], None, ["p"] * 8, ["c"] * 8, {"answer": ["a"] * 8}, step=12)
    error = raised.value
    assert isinstance(error, UserError)
    assert (error.function, error.step) == ("my_mod:score", 12)
    assert line in error.line() and "\n" not in error.line()
