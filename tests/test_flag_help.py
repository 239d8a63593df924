"""A flag's --help line (config/flags.py, which stays free of pydantic for a fast `--help`) and its
run-file key's schema (config/schema.py) say the same: the choices a help line lists are the
key's, a default it states is the key's, and the bounds the command line checks are the schema's."""

from __future__ import annotations

import re
import typing

import pytest

from dplaunch.config.flags import RUN_FLAGS, RunFlag
from dplaunch.config.schema import RunConfig


def schema_field(key: str):
    """The pydantic field of a dotted run-file key (`parallel` is the section's own auto)."""
    model, field = RunConfig, None
    for part in key.split("."):
        field = model.model_fields[part]
        inner = [a for a in typing.get_args(field.annotation) if a is not type(None)]
        model = field.annotation if isinstance(field.annotation, type) else (inner or [None])[0]
    return field


def choices(annotation) -> set[str]:
    """The string values a field's Literal (or a union holding one) allows."""
    if typing.get_origin(annotation) is typing.Literal:
        return {value for value in typing.get_args(annotation) if isinstance(value, str)}
    return {value for arg in typing.get_args(annotation) for value in choices(arg)}


def contradictions(flags: dict[str, RunFlag]) -> list[str]:
    """What a flag's help line says that its key's schema does not."""
    found = []
    for name, flag in flags.items():
        field = schema_field(flag.key)
        allowed = choices(field.annotation)
        named = {c for c in allowed if re.search(rf"(?<![\w-]){re.escape(c)}(?![\w-])", flag.help)}
        if named and named != allowed:  # a help line that lists choices lists them all
            found.append(f"--{name}: names {sorted(named)} of {flag.key}'s {sorted(allowed)}")
        for said in re.findall(r"\(default (-?\d+(?:\.\d+)?)\)", flag.help):
            if float(said) != field.default:
                found.append(f"--{name}: default {said}, {flag.key}'s is {field.default}")
        if flag.bounds is not None:
            low = next((m.ge for m in field.metadata if hasattr(m, "ge")), None)
            high = next((m.le for m in field.metadata if hasattr(m, "le")), None)
            if (low, high) != flag.bounds:
                found.append(f"--{name}: bounds {flag.bounds}, {flag.key}'s ({low}, {high})")
    return found


def test_every_flag_help_agrees_with_its_run_file_key():
    assert contradictions(RUN_FLAGS) == []


@pytest.mark.parametrize(
    "flag, words",
    [
        (RunFlag("train.mixed_precision", "no or bf16."), "names ['bf16', 'no'] of"),
        (
            RunFlag("launch.max_restarts", "Restarts (default 3)."),
            "default 3, launch.max_restarts's is 0",
        ),  # fmt: skip
        (
            RunFlag("parallel.zero_stage", "ZeRO.", bounds=(0, 4)),
            "bounds (0, 4), parallel.zero_stage's (0, 3)",
        ),  # fmt: skip
    ],
    ids=["choices", "default", "bounds"],
)
def test_the_check_sees_a_missing_choice_a_wrong_default_and_other_bounds(flag, words):
    [found] = contradictions({"x": flag})
    assert words in found, found
