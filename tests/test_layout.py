"""The package's shape, read from its source: functions a reader takes in at once, and the run
directory's names and DPLAUNCH_* variables written in one place (dplaunch/run_directory/)."""

from __future__ import annotations

import ast
import re

from dplaunch.run_directory import layout
from tests.helpers import REPO

PACKAGE = REPO / "dplaunch"
MOST_LINES = 80
MOST_PARAMETERS = 8
# functions still over a limit; the list only shrinks
KNOWN_LONG: set[str] = set()


def _modules() -> list[tuple[str, ast.Module]]:
    return [
        (path.relative_to(REPO).as_posix(), ast.parse(path.read_text(encoding="utf-8")))
        for path in sorted(PACKAGE.rglob("*.py"))
    ]


def _is_typer_command(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A command's typer function (commands/options.py's @command): typer reads its options from
    its signature, so its length is its options'."""
    return any(ast.unparse(d).startswith("command(") for d in function.decorator_list)


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    arguments = function.args
    named = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
    count = sum(1 for a in named if a.arg not in ("self", "cls"))
    return count + (arguments.vararg is not None) + (arguments.kwarg is not None)


def over_the_limits(modules: list[tuple[str, ast.Module]]) -> dict[str, str]:
    """`path:function` → what is over: more than 80 lines or more than 8 parameters."""
    found = {}
    for path, tree in modules:
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if _is_typer_command(node):
                continue
            lines = node.end_lineno - node.lineno + 1
            parameters = _parameters(node)
            if lines > MOST_LINES or parameters > MOST_PARAMETERS:
                found[f"{path}:{node.name}"] = f"{lines} lines, {parameters} parameters"
    return found


def test_no_function_is_over_80_lines_or_8_parameters():
    found = over_the_limits(_modules())
    new = {name: size for name, size in found.items() if name not in KNOWN_LONG}
    assert not new, f"split these into named steps, or group their parameters: {new}"
    fixed = KNOWN_LONG - set(found)
    assert not fixed, f"within the limits now, remove from KNOWN_LONG: {sorted(fixed)}"


def test_the_checker_sees_a_long_function_and_a_long_signature():
    body = "\n".join(f"    x{i} = {i}" for i in range(MOST_LINES))
    source = f"def long():\n{body}\n\ndef wide(a, b, c, d, e, f, g, h, i):\n    pass\n"
    typer = "@command()\ndef wide_command(a, b, c, d, e, f, g, h, i):\n    pass\n"
    found = over_the_limits([("m.py", ast.parse(source + typer))])
    assert set(found) == {"m.py:long", "m.py:wide"}


def _docstrings(tree: ast.Module) -> set[int]:
    owners = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, owners)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def _run_directory_names() -> set[str]:
    """The run directory's file names and name prefixes: those no other word is spelt like."""
    return {
        value
        for key, value in vars(layout).items()
        if key.isupper() and isinstance(value, str) and ("." in value or value.endswith("-"))
    }


def names_outside_run_directory(modules: list[tuple[str, ast.Module]]) -> list[str]:
    """String literals (docstrings aside) outside run_directory/ that are a run-directory file
    name or prefix, name a DPLAUNCH_ variable, or hold a file name (run.yaml) in their words:
    each is a constant of run_directory/, and a message or help text names it with {RUN_FILE}."""
    names = _run_directory_names()
    files = sorted((n for n in names if "." in n.strip(".")), key=len, reverse=True)
    in_words = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, files)) + r")(?![\w-])")
    found = []
    for path, tree in modules:
        if path.startswith("dplaunch/run_directory/"):
            continue
        docstrings = _docstrings(tree)
        for node in sorted(ast.walk(tree), key=lambda n: getattr(n, "lineno", 0)):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and (
                    node.value in names or "DPLAUNCH_" in node.value or in_words.search(node.value)
                )
            ):
                found.append(f"{path}:{node.lineno}: {node.value!r}")
    return found


def test_run_directory_names_and_variables_are_written_only_in_run_directory():
    assert not names_outside_run_directory(_modules())


def test_the_name_check_sees_a_literal_file_name_and_variable():
    source = (
        'path = run_dir / "metrics.jsonl"\nvariable = "DPLAUNCH_X"\nhelp = "see metrics.jsonl."\n'
        'word = "metrics.jsonl_old"\n'
    )
    found = names_outside_run_directory([("dplaunch/m.py", ast.parse(source))])
    assert [line.split(": ", 1)[1] for line in found] == [
        "'metrics.jsonl'",
        "'DPLAUNCH_X'",
        "'see metrics.jsonl.'",
    ]


# docs/development.md's import order: a part of the package imports only the parts before it
# (imports inside functions too), and the ranks (train/) never import launching/: what runs in
# a rank is no launcher's code
IMPORT_ORDER = (
    "errors",
    "tasks",
    "requirements",
    "stop_signals",
    "run_directory",
    "config",
    "hub",
    "data",
    "planning",
    "report",
    "cluster",
    "rendering",
    "launching",
    "environment_report",
    "train",
    "commands",
    "cli",
    "__main__",
)
NEVER_IMPORTS = {"train": {"launching", "environment_report"}}


def wrong_imports(modules: list[tuple[str, ast.Module]]) -> list[str]:
    """`path:line imports dplaunch.X` for every import (at the top or inside a function) of a
    part that IMPORT_ORDER puts after the importing one, or that NEVER_IMPORTS forbids it."""
    found = []
    for path, tree in modules:
        parts = path.split("/")[1:]  # dplaunch/train/loop.py → train
        importer = parts[0].removesuffix(".py")
        if importer == "__init__":
            continue
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                dotted = name.split(".")
                if dotted[0] != "dplaunch" or len(dotted) < 2 or dotted[1] == importer:
                    continue
                imported = dotted[1]
                later = IMPORT_ORDER.index(imported) > IMPORT_ORDER.index(importer)
                if later or imported in NEVER_IMPORTS.get(importer, ()):
                    found.append(f"{path}:{node.lineno} imports {name}")
    return found


def test_each_part_imports_only_the_parts_before_it():
    parts = {path.split("/")[1].removesuffix(".py") for path, _ in _modules()}
    assert parts - {"__init__", "resources"} <= set(IMPORT_ORDER), "add new parts to IMPORT_ORDER"
    assert not wrong_imports(_modules()), "see docs/development.md's import order"


def test_the_import_check_sees_a_rank_importing_the_launcher_inside_a_function():
    rank = ast.parse("def f():\n    from dplaunch.launching.frameworks import x\n")
    upward = ast.parse("import dplaunch.commands.plan\n")
    found = wrong_imports([("dplaunch/train/x.py", rank), ("dplaunch/planning/y.py", upward)])
    assert found == [
        "dplaunch/train/x.py:2 imports dplaunch.launching.frameworks",
        "dplaunch/planning/y.py:1 imports dplaunch.commands.plan",
    ]


def task_name_comparisons(modules: list[tuple[str, ast.Module]]) -> list[str]:
    """`path:line [names]` for each comparison with a task's name (==, !=, in a tuple of them)
    and each mapping keyed by one, outside dplaunch/tasks/: code asks a task's facts
    (dplaunch/tasks/base.py) instead of comparing its name."""
    from dplaunch.tasks import TASK_NAMES

    def constants(node: ast.AST) -> list[object]:
        if isinstance(node, ast.Constant):
            return [node.value]
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return [item.value for item in node.elts if isinstance(item, ast.Constant)]
        return []

    found = []
    for path, tree in modules:
        if path.startswith("dplaunch/tasks/"):
            continue
        for node in ast.walk(tree):
            seen: list[object] = []
            if isinstance(node, ast.Compare):
                for side in (node.left, *node.comparators):
                    seen += constants(side)
            elif isinstance(node, ast.Dict):
                seen += [key.value for key in node.keys if isinstance(key, ast.Constant)]
            hits = [value for value in seen if value in TASK_NAMES]
            if hits:
                found.append(f"{path}:{node.lineno} {hits}")
    return found


def test_no_code_compares_a_task_name_outside_the_task_registry():
    assert task_name_comparisons(_modules()) == [], "ask the task's facts (dplaunch/tasks/)"


def test_the_task_check_sees_a_comparison_a_membership_and_a_mapping():
    code = ast.parse(
        'if task == "dpo":\n    pass\nx = task in ("sft", "causal-lm")\ny = {"sft": 1}\n'
    )
    assert task_name_comparisons([("dplaunch/train/x.py", code)]) == [
        "dplaunch/train/x.py:1 ['dpo']",
        "dplaunch/train/x.py:3 ['sft', 'causal-lm']",
        "dplaunch/train/x.py:4 ['sft']",
    ]
    assert task_name_comparisons([("dplaunch/tasks/sft.py", code)]) == []
