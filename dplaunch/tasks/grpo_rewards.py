"""The reward functions of `model.task: grpo` (train.grpo.rewards), as TRL's GRPOTrainer calls them.

A run file lists its rewards in train.grpo.rewards, each entry one of:

- a built-in's name, which needs no code: ``exact_match`` (the completion's final answer against
  a column of the data), ``format`` (the completion matches a regular expression) and ``length``
  (how far the completion is from a target length in characters);
- a one-key mapping giving a built-in its option: ``{exact_match: solution}`` (the answer's
  column; default ``answer``), ``{format: '<regex>'}`` (default: TRL's reasoning format,
  ``<think>…</think> <answer>…</answer>``), ``{length: 64}`` (the target; default 256);
- a user function, ``module:function`` (a module on sys.path, else a ``.py`` file of that dotted
  path in the run file's folder) or ``path/to/file.py:function`` (relative to the run file's
  folder), with TRL's signature ``f(prompts, completions, **kwargs)``: the data's other columns
  come as keywords, and it returns one float (or None: not scored) per completion.

``parse_reward_entry`` reads one entry, ``load_reward`` turns it into a ``RewardFunction``,
``check_rewards`` is everything the command line checks before launch (entries, weights, the
answer's column, metric names), ``score`` calls the functions at a training step and checks what
they return (a ``RewardError`` otherwise, which stops the run with its checkpoint kept), and
``combine`` weighs them into each completion's reward as TRL does.

Torch- and pydantic-free: the command line imports it to check the run file before launch, and
every rank imports it to score its completions.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Literal

from dplaunch.errors import UserError

FIELD = "train.grpo.rewards"
WEIGHTS_FIELD = "train.grpo.reward_weights"

# the built-ins' default options
ANSWER_COLUMN = "answer"
# TRL's reasoning format (the system prompt of its GRPO examples asks the model for it)
FORMAT_PATTERN = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
LENGTH_TARGET = 256

BUILTINS = ("exact_match", "format", "length")
# what a reward function is called with beyond the data's columns (prompts and completions always;
# completion_ids when the trainer gives them)
CALL_KEYWORDS = frozenset({"prompts", "completions", "completion_ids"})

_ENTRY_FIX = (
    "write a built-in's name (exact_match, format, length), a mapping giving one its option "
    "({exact_match: solution}, {format: '<regex>'}, {length: 64}) or module:function"
)
_SIGNATURE_FIX = (
    "define it as def f(prompts, completions, **kwargs), returning one float (or None) per "
    "completion (TRL's reward signature)"
)

RewardCallable = Callable[..., Any]


class RewardError(UserError):
    """A reward function that failed at a training step: it raised, or returned what is not one
    number (or None) per completion. The training loop stops on it with its checkpoint kept."""

    def __init__(self, function: str, step: int, problem: str, fix: str):
        self.function = function
        self.step = step
        super().__init__(FIELD, f"reward function {function} {problem} at step {step}", fix)


@dataclass(frozen=True)
class RewardSpec:
    """One entry of train.grpo.rewards: a built-in with its option (defaults filled in), or a
    user function (name: the entry as written, "module:function" or "file.py:function")."""

    kind: Literal["builtin", "user"]
    name: str
    option: str | int | None = None

    @property
    def module(self) -> str:
        """A user function's module or file (the text before its last colon)."""
        return self.name.rpartition(":")[0]

    @property
    def attribute(self) -> str:
        """A user function's name in its module (the text after its last colon)."""
        return self.name.rpartition(":")[2]

    @property
    def from_file(self) -> bool:
        """Whether a user function is given by a file's path rather than a dotted module."""
        return self.module.endswith(".py") or "/" in self.module or "\\" in self.module


class RewardFunction:
    """A loaded reward function: ``name`` is its metric's name in TRL's logs (rewards/NAME/mean):
    a built-in's name, a user function's ``__name__``; ``source`` is the entry that gave it, as
    the errors name it. Called as TRL calls it: ``f(prompts=..., completions=..., **columns)``."""

    def __init__(self, spec: RewardSpec, name: str, function: RewardCallable):
        self.spec = spec
        self.name = name
        # TRL names a reward function's metrics by its __name__: this object can be given to it
        self.__name__ = name
        self.function = function

    @property
    def source(self) -> str:
        """The entry as the run file wrote it ("exact_match", "my_mod:score")."""
        return self.spec.name

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> Any:
        return self.function(prompts=prompts, completions=completions, **columns)

    def __repr__(self) -> str:
        return f"RewardFunction({self.source!r}, name={self.name!r})"


# ---------------------------------------------------------------------------------------------
# the run file's entries


def parse_reward_entry(entry: object, index: int | None = None) -> RewardSpec:
    """The reward ENTRY of train.grpo.rewards (its INDEX, from 1, only for the messages); a
    UserError for a malformed one."""
    where = f"entry {index}" if index is not None else "entry"
    if isinstance(entry, str):
        text = entry.strip()
        if text in BUILTINS:
            return _builtin(text, None, where)
        if ":" in text:
            return _user(text, where)
        raise UserError(
            FIELD, f"{where} {entry!r} is no built-in reward nor module:function", _ENTRY_FIX
        )
    if isinstance(entry, Mapping):
        if len(entry) != 1:
            keys = ", ".join(str(key) for key in entry) or "none"
            raise UserError(
                FIELD, f"{where} is a mapping with {len(entry)} keys ({keys}), not one", _ENTRY_FIX
            )
        ((key, option),) = entry.items()
        if key in BUILTINS:
            return _builtin(key, option, where)
        if isinstance(key, str) and ":" in key:
            raise UserError(
                FIELD,
                f"{where}: the user function {key} takes no option",
                f"write it as a plain string ('{key}') and read options in the function",
            )
        raise UserError(FIELD, f"{where}: {key!r} is no built-in reward", _ENTRY_FIX)
    raise UserError(FIELD, f"{where} is a {type(entry).__name__} ({entry!r})", _ENTRY_FIX)


def _builtin(name: str, option: object, where: str) -> RewardSpec:
    """A built-in's spec with its OPTION checked (None: the default)."""
    if name == "exact_match":
        if option is None:
            option = ANSWER_COLUMN
        if not isinstance(option, str) or not option.strip():
            raise UserError(
                FIELD,
                f"{where}: exact_match's option is the answer's column, not {option!r}",
                "name the column: {exact_match: solution}",
            )
        return RewardSpec("builtin", name, option.strip())
    if name == "format":
        if option is None:
            option = FORMAT_PATTERN
        if not isinstance(option, str) or not option:
            raise UserError(
                FIELD,
                f"{where}: format's option is a regular expression, not {option!r}",
                "quote it: {format: '^<answer>.*</answer>$'}",
            )
        try:
            re.compile(option, re.DOTALL)
        except re.error as error:
            raise UserError(
                FIELD,
                f"{where}: format's regular expression {option!r} does not compile ({error})",
                "fix the pattern (Python's re syntax)",
            ) from None
        return RewardSpec("builtin", name, option)
    if option is None:
        option = LENGTH_TARGET
    # bool is an int: `{length: true}` is no length
    if isinstance(option, bool) or not isinstance(option, int) or option <= 0:
        raise UserError(
            FIELD,
            f"{where}: length's option is the target length in characters, not {option!r}",
            "give a positive integer: {length: 64}",
        )
    return RewardSpec("builtin", name, option)


def _user(text: str, where: str) -> RewardSpec:
    """A user function's spec, "module:function" or "path/file.py:function", its form checked."""
    module, _, attribute = text.rpartition(":")
    spec = RewardSpec("user", text)
    if not module or not attribute.isidentifier():
        raise UserError(
            FIELD,
            f"{where} {text!r} names no function after its colon",
            "write module:function or path/to/file.py:function",
        )
    if not spec.from_file and not all(part.isidentifier() for part in module.split(".")):
        raise UserError(
            FIELD,
            f"{where} {text!r}: {module!r} is no module name nor .py file",
            "write a dotted module (my_pkg.rewards:score) or a file (rewards.py:score)",
        )
    return spec


# ---------------------------------------------------------------------------------------------
# the built-ins


def completion_text(completion: object) -> str:
    """A completion's text: the string, or a conversation's last message's content (TRL's
    conversational format, [{"role": "assistant", "content": ...}])."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return _content_text(completion.get("content"))
    if isinstance(completion, Sequence):
        if not completion:
            return ""
        last = completion[-1]
        if isinstance(last, Mapping):
            return _content_text(last.get("content"))
        if isinstance(last, str):
            return last
    raise TypeError(
        f"a completion is a string or a list of messages, not a {type(completion).__name__}"
    )


def _content_text(content: object) -> str:
    """A message's content as text: a string, or the text parts of a multimodal content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(
            part.get("text") or ""
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        )
    return str(content)


_BOXED = re.compile(r"\\boxed\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# a number as answers write it: thousands with commas (1,234.5), plain (1234), a bare fraction (.5)
_NUMBER_IN_TEXT = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
_GROUPED = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def _last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} whose braces close (inner braces kept: \\frac{1}{2})."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth = 1
        for position in range(match.end(), len(text)):
            if text[position] == "{":
                depth += 1
            elif text[position] == "}":
                depth -= 1
                if depth == 0:
                    return text[match.end() : position]
    return None


def _marked_answer(text: str) -> str | None:
    """The answer a text marks: the last \\boxed{}, the line after the last ####, the last
    <answer>…</answer>; None when it marks none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        after = text.rpartition("####")[2].strip()
        # GSM8K's answers end with "#### 72"; a model may go on writing on later lines
        return after.splitlines()[0] if after else ""
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1]
    return None


def final_answer(text: str) -> str | None:
    """A completion's final answer: the content of its last \\boxed{...}, else the text after its
    last ####, else the content of <answer>…</answer>, else its last number; None if none."""
    marked = _marked_answer(text)
    if marked is not None:
        return marked
    numbers_found = _NUMBER_IN_TEXT.findall(text)
    return numbers_found[-1] if numbers_found else None


def _normalized(answer: str) -> str | Decimal:
    """An answer as compared: stripped, a trailing period dropped, a number as its value (commas
    of thousands dropped, so "1,000" is 1000 and "3.0" is 3)."""
    text = answer.strip()
    if text.endswith("."):
        text = text[:-1].rstrip()
    if _GROUPED.fullmatch(text):
        text = text.replace(",", "")
    if _NUMBER.fullmatch(text):
        try:
            return Decimal(text)
        except InvalidOperation:  # the pattern admits only what Decimal reads; kept as text
            return text
    return text


def answers_equal(answer: str, expected: str) -> bool:
    """Whether ANSWER is EXPECTED once both are normalized (numbers compared by value)."""
    given, wanted = _normalized(answer), _normalized(expected)
    if isinstance(given, Decimal) and isinstance(wanted, Decimal):
        return given == wanted
    return str(given) == str(wanted)


def _expected_answer(value: object) -> str:
    """A row's answer: its marked answer when it has one (GSM8K's "answer" is the worked solution
    ending "#### 72"), else the whole value."""
    text = value if isinstance(value, str) else str(value)
    marked = _marked_answer(text)
    return marked if marked is not None else text


def exact_match_reward(column: str = ANSWER_COLUMN) -> RewardCallable:
    """The built-in exact_match on COLUMN: 1.0 when a completion's final answer is the row's
    answer, else 0.0; None (not scored) for a row whose answer is None."""

    def exact_match(
        prompts: Sequence[Any], completions: Sequence[Any], **columns: Any
    ) -> list[float | None]:
        if column not in columns:
            known = ", ".join(sorted(columns)) or "none"
            raise ValueError(f"the data has no column {column!r} (its columns: {known})")
        rewards: list[float | None] = []
        for completion, expected in zip(completions, columns[column], strict=True):
            if expected is None:
                rewards.append(None)
                continue
            answer = final_answer(completion_text(completion))
            matched = answer is not None and answers_equal(answer, _expected_answer(expected))
            rewards.append(1.0 if matched else 0.0)
        return rewards

    return exact_match


def format_reward(pattern: str = FORMAT_PATTERN) -> RewardCallable:
    """The built-in format: 1.0 when PATTERN (re.DOTALL: "." spans lines) matches a completion's
    whole text, else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)

    def format(prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float]:
        return [1.0 if compiled.fullmatch(completion_text(c)) else 0.0 for c in completions]

    return format


def length_reward(target: int = LENGTH_TARGET) -> RewardCallable:
    """The built-in length: -|len - TARGET| / TARGET of a completion's text in characters (0.0
    at the target, -1.0 at twice it or empty)."""

    def length(prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float]:
        return [-abs(len(completion_text(c)) - target) / target for c in completions]

    return length


_BUILTIN_FACTORIES: dict[str, Callable[[Any], RewardCallable]] = {
    "exact_match": exact_match_reward,
    "format": format_reward,
    "length": length_reward,
}


# ---------------------------------------------------------------------------------------------
# loading


def load_reward(spec: RewardSpec, base_dir: Path) -> RewardFunction:
    """The reward function of SPEC: a built-in from the table, or a user function imported (a
    file's path relative to BASE_DIR, the run file's folder) with TRL's signature checked."""
    if spec.kind == "builtin":
        return RewardFunction(spec, spec.name, _BUILTIN_FACTORIES[spec.name](spec.option))
    module = _import_file(spec, base_dir) if spec.from_file else _import_module(spec, base_dir)
    if not hasattr(module, spec.attribute):
        raise UserError(
            FIELD,
            f"reward function {spec.name}: {spec.module} has no {spec.attribute!r}",
            "check the function's name after the colon",
        )
    function = getattr(module, spec.attribute)
    if not callable(function):
        raise UserError(
            FIELD,
            f"reward function {spec.name} is not callable (a {type(function).__name__})",
            _SIGNATURE_FIX,
        )
    # an async function returns a coroutine, not rewards: the ranks call reward functions plainly
    if inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
        type(function).__call__
    ):
        raise UserError(
            FIELD,
            f"reward function {spec.name} is async",
            "make it a plain def (dplaunch calls it synchronously)",
        )
    problem = _signature_problem(function)
    if problem:
        raise UserError(FIELD, f"reward function {spec.name} {problem}", _SIGNATURE_FIX)
    name = getattr(function, "__name__", type(function).__name__)
    return RewardFunction(spec, name, function)


def _import_failure(spec: RewardSpec, error: BaseException) -> UserError:
    """The one-line error of a user module that raised while it was imported."""
    lines = str(error).strip().splitlines()
    what = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return UserError(
        FIELD,
        f"reward function {spec.name} does not import: {what}",
        "fix the module (import it with python to see the traceback)",
    )


def _import_module(spec: RewardSpec, base_dir: Path):
    """A dotted module from sys.path; else the .py file of that dotted path in BASE_DIR (the ranks
    and the command line need not start where the run file is)."""
    dotted = spec.module
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError as error:
        # only the module itself (or a package above it) missing; a module that imports a missing
        # dependency does not import
        missing = error.name or ""
        if not (dotted == missing or dotted.startswith(missing + ".")):
            raise _import_failure(spec, error) from error
    except Exception as error:
        raise _import_failure(spec, error) from error
    path = base_dir / (dotted.replace(".", "/") + ".py")
    if path.is_file():
        return _load_path(spec, path)
    raise UserError(
        FIELD,
        f"reward function {spec.name} does not import: no module {dotted!r} on sys.path nor "
        f"file {path}",
        "install the module, or give its file's path relative to the run file (rewards.py:f)",
    )


def _import_file(spec: RewardSpec, base_dir: Path):
    """A .py file's module by its path (relative to BASE_DIR)."""
    path = Path(spec.module).expanduser()
    if not path.is_absolute():
        path = base_dir / path
    if not path.is_file():
        raise UserError(
            FIELD,
            f"reward function {spec.name} does not import: no file {path}",
            "give the file's path relative to the run file's folder",
        )
    return _load_path(spec, path)


def _load_path(spec: RewardSpec, path: Path):
    """The module of the file PATH, imported once a process under a name of its own (its path's
    hash: two rewards.py of different folders stay apart). Its folder goes on sys.path, once, so
    that it imports the modules beside it, now and when its functions run."""
    path = path.resolve()
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", path.stem)
    name = f"_dplaunch_reward_{stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.append(folder)
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise UserError(
            FIELD, f"reward function {spec.name} does not import: {path} is no Python module", ""
        )
    module = importlib.util.module_from_spec(module_spec)
    # registered before it runs, as an import does (dataclasses and pickling look it up)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as error:
        del sys.modules[name]
        if not isinstance(error, Exception):
            raise
        raise _import_failure(spec, error) from error
    return module


def _signature_problem(function: RewardCallable) -> str | None:
    """What keeps FUNCTION from being called as TRL calls it, f(prompts=, completions=,
    **columns); None when nothing does (or its signature cannot be read: a C function)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    parameters = signature.parameters
    extra = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    missing = []
    for keyword in ("prompts", "completions"):
        parameter = parameters.get(keyword)
        if parameter is None and not extra:
            missing.append(keyword)
        elif parameter is not None and parameter.kind is inspect.Parameter.POSITIONAL_ONLY:
            missing.append(f"{keyword} as a keyword")
    if not extra:
        missing.append("**kwargs (the data's other columns)")
    # a required positional-only parameter is never given: TRL passes keywords alone
    for parameter in parameters.values():
        if (
            parameter.kind is inspect.Parameter.POSITIONAL_ONLY
            and parameter.default is inspect.Parameter.empty
            and parameter.name not in ("prompts", "completions")
        ):
            missing.append(f"{parameter.name} as a keyword")
    if missing:
        return f"has the wrong signature {signature}: it does not take {', '.join(missing)}"
    return None


def _required_keywords(function: RewardCallable) -> list[str]:
    """The parameters FUNCTION needs beyond prompts and completions (columns it reads by name)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return []
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [
        p.name
        for p in parameters
        if p.kind in named
        and p.default is inspect.Parameter.empty
        and p.name not in ("prompts", "completions")
    ]


# ---------------------------------------------------------------------------------------------
# the checks before launch


def check_rewards(
    entries: Sequence[object] | None,
    weights: Sequence[float] | None,
    columns: set[str] | None,
    base_dir: Path,
) -> list[RewardFunction]:
    """The reward functions of train.grpo.rewards ENTRIES, loaded and checked before launch:
    WEIGHTS (train.grpo.reward_weights; None: all 1.0) one finite number per function, the
    columns they read among COLUMNS (the training data's; None: not known yet), no two of them
    logging under one metric name. Each failure is a UserError."""
    if isinstance(entries, (str, Mapping)):
        raise UserError(FIELD, "is one entry, not a list", f"write it as a list: [{entries}]")
    if not entries:
        raise UserError(
            FIELD,
            "is empty: GRPO needs at least one reward function",
            "list them, e.g. [exact_match, format]",
        )
    specs = [parse_reward_entry(entry, index) for index, entry in enumerate(entries, start=1)]
    if weights is not None:
        if len(weights) != len(specs):
            raise UserError(
                WEIGHTS_FIELD,
                f"has {len(weights)} weight{'s' if len(weights) != 1 else ''} for {len(specs)} "
                f"reward function{'s' if len(specs) != 1 else ''}",
                "give one weight per entry of train.grpo.rewards, in its order, or leave it out "
                "(every weight 1.0)",
            )
        for index, weight in enumerate(weights, start=1):
            # TRL takes any float (a negative weight penalises); NaN or inf would make every
            # advantage NaN
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
                raise UserError(WEIGHTS_FIELD, f"weight {index} is {weight!r}, not a number", "")
            if not math.isfinite(weight):
                raise UserError(
                    WEIGHTS_FIELD,
                    f"weight {index} is {weight}",
                    "give finite numbers (a negative weight penalises)",
                )
    functions = [load_reward(spec, base_dir) for spec in specs]
    if columns is not None:
        known = ", ".join(sorted(columns)) or "none"
        for function in functions:
            if function.spec.kind == "builtin" and function.spec.name == "exact_match":
                column = function.spec.option
                if column not in columns:
                    raise UserError(
                        FIELD,
                        f"exact_match compares with the column {column!r}, which the training "
                        f"data does not have (its columns: {known})",
                        "name the answer's column: {exact_match: <column>}",
                    )
            elif function.spec.kind == "user":
                # TRL gives the columns but the prompt and completion (passed as prompts=,
                # completions=)
                given = CALL_KEYWORDS | (columns - {"prompt", "completion"})
                absent = [p for p in _required_keywords(function.function) if p not in given]
                if absent:
                    raise UserError(
                        FIELD,
                        f"reward function {function.source} needs {', '.join(absent)}, which it "
                        f"is not given: it gets prompts, completions, completion_ids and the "
                        f"data's columns but prompt and completion ({known})",
                        "give those parameters defaults, or read the columns the data has",
                    )
    seen: dict[str, RewardFunction] = {}
    for function in functions:
        earlier = seen.setdefault(function.name, function)
        if earlier is not function:
            raise UserError(
                FIELD,
                f"two reward functions are named {function.name!r} ({earlier.source} and "
                f"{function.source}): their metrics (rewards/{function.name}/mean) would collide",
                "list each built-in once and give user functions different names",
            )
    return functions


# ---------------------------------------------------------------------------------------------
# scoring, at each training step


def score(
    functions: Sequence[RewardFunction],
    weights: Sequence[float] | None,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    columns: Mapping[str, Sequence[Any]],
    step: int,
    completion_ids: Sequence[Sequence[int]] | None = None,
) -> list[list[float]]:
    """Each function's rewards of COMPLETIONS (per function, per completion; None, not scored,
    as NaN: TRL's rewards_per_func), unweighted as TRL logs them (``combine`` weighs them by
    WEIGHTS, checked here against the functions). Called as TRL calls them: prompts=,
    completions=, completion_ids= (when given) and the data's COLUMNS as keywords. A RewardError
    naming the function and STEP for one that raises or returns what is not one number (or None)
    per completion."""
    if weights is not None and len(weights) != len(functions):
        raise ValueError(f"{len(weights)} weights for {len(functions)} reward functions")
    keywords: dict[str, Any] = dict(columns)
    keywords["prompts"] = prompts
    keywords["completions"] = completions
    if completion_ids is not None:
        keywords["completion_ids"] = completion_ids
    count = len(completions)
    rewards = []
    for function in functions:
        try:
            returned = function.function(**keywords)
        except Exception as error:
            lines = str(error).strip().splitlines()
            what = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
            raise RewardError(
                function.source, step, f"raised {what}", "fix the function and resume the run"
            ) from error
        rewards.append(_checked(function, returned, count, step))
    return rewards


def _checked(function: RewardFunction, returned: object, count: int, step: int) -> list[float]:
    """RETURNED as COUNT floats (None: NaN); a RewardError unless one number per completion."""
    fix = f"return a list of {count} floats (None for a completion it does not score)"
    if isinstance(returned, (str, bytes, Mapping)) or not (
        hasattr(returned, "__len__") and hasattr(returned, "__iter__")
    ):
        raise RewardError(function.source, step, f"returned a {type(returned).__name__}", fix)
    if len(returned) != count:
        raise RewardError(
            function.source, step, f"returned {len(returned)} values for {count} completions", fix
        )
    values = []
    for index, value in enumerate(returned):
        if value is None:
            values.append(math.nan)
            continue
        # numbers, numpy's scalars, a 0-d tensor (float() reads each); never a string
        if isinstance(value, (str, bytes)) or not (
            isinstance(value, numbers.Real) or hasattr(value, "__float__")
        ):
            raise RewardError(
                function.source,
                step,
                f"returned a {type(value).__name__} ({value!r}) for completion {index}, "
                "not a number",
                fix,
            )
        number = float(value)
        if not math.isfinite(number):
            raise RewardError(
                function.source, step, f"returned {number} for completion {index}", fix
            )
        values.append(number)
    return values


def combine(rewards: Sequence[Sequence[float]], weights: Sequence[float] | None) -> list[float]:
    """Each completion's reward from the functions' REWARDS (score's): the sum weighted by WEIGHTS
    (None: all 1.0) of those that scored it, NaN left out (TRL's nansum: 0.0 if none did)."""
    if not rewards:
        return []
    weights = [1.0] * len(rewards) if weights is None else list(weights)
    totals = [0.0] * len(rewards[0])
    for weight, per_completion in zip(weights, rewards, strict=True):
        for index, value in enumerate(per_completion):
            if not math.isnan(value):
                totals[index] += weight * value
    return totals
