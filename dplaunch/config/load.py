"""Load a run file (YAML), apply flag and --set overrides, validate: every mistake is one UserError."""

from __future__ import annotations

import copy
import difflib
import glob
import re
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from dplaunch.config.schema import DATASET_FIX, FieldProblem, RunConfig, ScriptRunConfig
from dplaunch.errors import UserError

DEFAULT_CONFIG_NAME = "default.yaml"
# keys of a Hugging Face config.json: a file with them and no model: section is a model, not a run
_HF_CONFIG_KEYS = ("model_type", "architectures")
# fixes for keys whose generic "fix the value" says too little
_FIXES = {
    "data.dataset": DATASET_FIX,
    "data.eval_dataset": "give local file(s) (.json/.jsonl/.csv/.txt/.parquet/.arrow), or a list of them",
    "model.num_labels": "give the number of classes, 2 or more (regression is not supported)",
}
# the branch pydantic appends to the location of an error in a union (str | list[str]): not a key
_UNION_BRANCH = re.compile(r"(str|int|float|bool|dict|list|none)(\[.*\])?")


class DuplicateKeyError(yaml.YAMLError):
    """A mapping that names the same key twice (YAML keeps the last one silently)."""

    def __init__(self, path: str, first_line: int, line: int):
        super().__init__(f"{path} appears twice (lines {first_line} and {line})")
        self.path, self.first_line, self.line = path, first_line, line


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key repeated in one mapping instead of keeping the last one."""

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        _check_unique_keys(node, [])
        return self.construct_document(node)


def _check_unique_keys(node: yaml.Node, path: list[str]) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden
                _check_unique_keys(value_node, path)
                continue
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else id(key_node)
            line = key_node.start_mark.line + 1
            where = [*path, str(key)]
            if key in seen:
                raise DuplicateKeyError(".".join(where), seen[key], line)
            seen[key] = line
            _check_unique_keys(value_node, where)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _check_unique_keys(item, [*path, str(index)])


def load_yaml(text: str) -> Any:
    """yaml.safe_load, but a key repeated in one mapping is an error (DuplicateKeyError)."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # a SafeLoader: builds plain data only


def default_config_text() -> str:
    """The embedded default run file (configs/default.yaml, shipped inside the package)."""
    return resources.files("dplaunch.resources").joinpath(DEFAULT_CONFIG_NAME).read_text()


def read_yaml_file(path: str | Path) -> dict[str, Any]:
    """Parse a run file into a dict, turning every I/O or YAML problem into one line."""
    path = Path(path)
    if not path.exists():
        raise UserError("CONFIG", f"{path} does not exist", "check the path of the run file")
    if path.is_dir():
        raise UserError("CONFIG", f"{path} is a directory", "give the path of a YAML run file")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UserError(
            "CONFIG", f"cannot read {path}: {exc.strerror}", "check its permissions"
        ) from None
    try:
        text = raw.decode("utf-8-sig")  # YAML files are UTF-8; a byte-order mark is allowed
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise UserError(
            "CONFIG",
            f"{path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at line {line}, column "
            f"{column})",
            "save the run file as UTF-8",
        ) from None
    return parse_yaml_text(text, str(path))


def parse_yaml_text(text: str, source: str) -> dict[str, Any]:
    """Parse YAML text, reporting the line of a syntax error."""
    try:
        data = load_yaml(text)
    except DuplicateKeyError as exc:
        raise UserError(
            exc.path,
            f"appears twice in {source} (lines {exc.first_line} and {exc.line}); YAML would "
            "silently keep only the last one",
            "merge the two into one",
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(
            "CONFIG", f"{source} is not valid YAML{where}: {problem}", "fix the syntax"
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(
            "CONFIG",
            f"{source} must hold a mapping of sections (model:, data:, …)",
            "see configs/default.yaml",
        )
    return data


def parse_override(assignment: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into a key path and a YAML-typed value."""
    if "=" not in assignment:
        raise UserError(
            "--set", f"{assignment!r} is not key.path=value", "write e.g. --set train.lr=1e-4"
        )
    key, _, raw = assignment.partition("=")
    keys = [part for part in key.strip().split(".") if part]
    if not keys:
        raise UserError(
            "--set", f"{assignment!r} has an empty key", "write e.g. --set train.lr=1e-4"
        )
    try:
        value = load_yaml(raw) if raw.strip() else None
    except DuplicateKeyError as exc:
        raise UserError(
            "--set", f"{key.strip()}: {exc.path} appears twice in the value", "give it once"
        ) from None
    except yaml.YAMLError:
        value = raw
    return keys, value


def apply_override(data: dict[str, Any], keys: list[str], value: Any) -> None:
    """Set data[k1][k2]… = value, creating sections as needed."""
    node = data
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if child == "auto":
            # `parallel: auto` is {auto: true}: a key set inside it keeps auto (--parallel auto --fsdp full)
            child = node[key] = {"auto": True}
        if not isinstance(child, dict):
            raise UserError(
                "--set", f"{'.'.join(keys)}: {key} is not a section", "check the key path"
            )
        node = child
    node[keys[-1]] = value


def build_run_config(
    data: dict[str, Any],
    *,
    overrides: dict[str, Any] | None = None,
    assignments: list[str] | None = None,
    base_dir: Path | None = None,
    schema: type[RunConfig] | type[ScriptRunConfig] = RunConfig,
) -> Any:
    """Validate a run-file dict after applying flag overrides (dotted keys) then --set assignments."""
    data = copy.deepcopy(data)
    for dotted, value in (overrides or {}).items():
        if value is not None:
            apply_override(data, dotted.split("."), value)
    for assignment in assignments or []:
        keys, value = parse_override(assignment)
        apply_override(data, keys, value)
    try:
        config = schema.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    if isinstance(config, RunConfig):
        _resolve_relative_paths(config, base_dir)
    return config


def load_run_config(
    path: str | Path | None,
    *,
    overrides: dict[str, Any] | None = None,
    assignments: list[str] | None = None,
    schema: type[RunConfig] | type[ScriptRunConfig] = RunConfig,
) -> Any:
    """The run file at ``path`` (the embedded default when None) with overrides applied."""
    if path is None:
        text = default_config_text() if schema is RunConfig else "{}"
        data = parse_yaml_text(text, "the embedded default run file")
        base_dir = None
    else:
        data = read_yaml_file(path)
        base_dir = Path(path).resolve().parent
        if schema is RunConfig and "model" not in data and any(k in data for k in _HF_CONFIG_KEYS):
            raise UserError(
                "CONFIG",
                f"{path} looks like a Hugging Face model config (it has "
                f"{' and '.join(k for k in _HF_CONFIG_KEYS if k in data)}), not a dplaunch run file",
                "name the model's folder in a run file (model.name_or_path), e.g. "
                f"dplaunch train --set model.name_or_path={Path(path).parent}; "
                f"dplaunch plan takes it as --model {path}",
            )
    return build_run_config(
        data, overrides=overrides, assignments=assignments, base_dir=base_dir, schema=schema
    )


def resolve_package_path(value: str) -> str:
    """`pkg:module/sub/path` → the path inside an installed Python package (found without importing it)."""
    import importlib.util

    module, _, rest = value[len("pkg:") :].partition("/")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            value,
            f"Python package {module!r} is not installed",
            f"pip install {module.replace('_', '-')}",
        )
    return str(Path(list(spec.submodule_search_locations)[0]) / rest)


def _resolve_relative_paths(config: RunConfig, base_dir: Path | None) -> None:
    # relative dataset/model paths in a run file are relative to the file, like a Makefile's includes;
    # a path that exists relative to the working directory wins (that is what users type on the CLI).
    # Either is made absolute: the run directory's run.yaml (checkpoints, export, resume) must name
    # the same files from any working directory
    def resolve(value: str) -> str:
        if value.startswith("pkg:"):
            return resolve_package_path(value)
        if value.startswith(("/", "~")):
            return value
        if _exists(Path(value)):
            return str(Path(value).absolute())
        if base_dir is None:
            return value
        candidate = base_dir / value
        return str(candidate) if _exists(candidate) else value

    def resolve_source(source: Any) -> None:  # data.dataset, or a mixture's or eval set's source
        if isinstance(source.dataset, list):
            source.dataset = [resolve(item) for item in source.dataset]
        elif source.dataset is not None:
            source.dataset = resolve(source.dataset)
        template = source.chat_template
        if template and "{{" not in template and "{%" not in template:
            source.chat_template = resolve(template)

    data = config.data
    for source in [data, *(data.mixture or []), *(data.eval_datasets or {}).values()]:
        resolve_source(source)
    if data.eval_dataset is not None:
        data.eval_dataset = (
            [resolve(item) for item in data.eval_dataset]
            if isinstance(data.eval_dataset, list)
            else resolve(data.eval_dataset)
        )
    if config.model.name_or_path:
        config.model.name_or_path = resolve(config.model.name_or_path)
    if config.model.tokenizer:
        config.model.tokenizer = resolve(config.model.tokenizer)
    # a chat template given as a file (its text has {{ or {%: resolve_source), and the sample
    # prompts' file
    if config.train.sample_prompts:
        config.train.sample_prompts = resolve(config.train.sample_prompts)
    # grpo's reward functions given as a file (file.py:function), relative to the run file too
    grpo = config.train.grpo
    if grpo is not None:
        entries = list(grpo.rewards)
        for index, entry in enumerate(entries):
            module, _, name = entry.rpartition(":") if isinstance(entry, str) else ("", "", "")
            if module.endswith(".py"):
                entries[index] = f"{resolve(module)}:{name}"
        grpo.rewards = entries


def _exists(path: Path) -> bool:
    # a data pattern (data/part-*.jsonl.gz) exists when it matches a file
    if glob.has_magic(str(path)):
        return any(Path(match).is_file() for match in glob.iglob(str(path)))
    return path.exists()


def _validation_error(exc: ValidationError) -> UserError:
    error = exc.errors()[0]
    kind = error["type"]
    parts = [str(part) for part in error["loc"]]
    if kind != "extra_forbidden":  # an unknown key is named as written, even "str"
        parts = [part for part in parts if not _UNION_BRANCH.fullmatch(part)]
    location = ".".join(parts)
    value = error.get("input")
    if kind == "extra_forbidden":
        section = ".".join(parts[:-1])
        known = _known_keys(section)
        hint = f"known keys here: {', '.join(known)}" if known else "remove it"
        typed = parts[-1]
        close = difflib.get_close_matches(typed, known, n=1, cutoff=0.6)
        close = close or [key for key in known if key.startswith(typed) and len(typed) >= 3]
        if len(close) == 1:  # a misspelling or a shortening: name the key that was meant first
            hint = f"did you mean {'.'.join([*parts[:-1], close[0]])}? {hint}"
        return UserError(location, "unknown key", hint)
    if kind == "missing":
        return UserError(
            location, "is required", f"add {location} to the run file or pass it with --set"
        )
    problem = (error.get("ctx") or {}).get("error")
    if isinstance(problem, FieldProblem):
        field = ".".join(part for part in (location, problem.key) if part)
        return UserError(field or "config", problem.problem, problem.fix)
    message = error["msg"].removeprefix("Value error, ")
    if kind in ("value_error", "assertion_error"):
        return UserError(location or "config", message, "")
    if value is None:
        field = _field(location)
        default = field is not None and not field.is_required()
        fix = "give a value, or remove the key for its default" if default else "give a value"
        return UserError(location, "is empty", _FIXES.get(location, fix))
    shown = repr(value) if not isinstance(value, dict) else "a mapping"
    return UserError(
        location, f"{shown} is invalid: {message}", _FIXES.get(location, "fix the value")
    )


def _field(location: str) -> Any:
    """The pydantic FieldInfo of a dotted run-file key (None when it names no field)."""
    model: Any = RunConfig
    field = None
    for part in [p for p in location.split(".") if p]:
        fields = getattr(model, "model_fields", None)
        field = fields.get(part) if fields else None
        if field is None:
            return None
        annotation = field.annotation
        model = annotation if isinstance(annotation, type) else None
    return field


def _known_keys(section: str) -> list[str]:
    field = _field(section) if section else None
    model = RunConfig if not section else (field.annotation if field is not None else None)
    if not isinstance(model, type) or not hasattr(model, "model_fields"):
        return []
    return sorted(model.model_fields)


def dump_run_config(config: RunConfig) -> str:
    """The fully resolved run file, as YAML, in the schema's key order."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, default_flow_style=False)
