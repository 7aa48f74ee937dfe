"""The config tree (engine.config) as command-line flags and a `--config FILE.yaml`.

Each option of the sections a command takes becomes one flag with the field's help;
no flag has a value of its own (argparse only splits the command line), so every value,
whatever its source, is validated once, by the tree. Precedence, highest first: a flag
on the command line, a key of the config file, the option's environment variable (only
the few options that name one, such as --admin-token), the tree's default.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from typing import Any, Literal

import yaml

from engine.config import (
    ConfigError,
    EngineConfig,
    ModelOptions,
    Options,
    SchedulerOptions,
    StoreOptions,
    VllmOptions,
    flag_name,
)
from kvstore.options import expand_path, format_size, option_meta

# Sections made of several (EngineConfig is the model, scheduler and store sections).
_PARTS: dict[type[Options], tuple[type[Options], ...]] = {
    EngineConfig: (ModelOptions, SchedulerOptions, StoreOptions, VllmOptions),
}
_SIZE_METAVARS = ("SIZE", "GiB")
MODEL_POSITIONAL = "model_tag"  # the dest of `kvtier serve MODEL`


def add_config_arguments(
    parser: argparse.ArgumentParser, *sections: type[Options], model_positional: bool = False
) -> None:
    """Add `--config` and one flag per option of `sections`, in their help groups; with
    `model_positional`, also the model as an optional first argument (`kvtier serve
    MODEL`, as `vllm serve MODEL`), which counts as --model."""
    if model_positional:
        parser.add_argument(MODEL_POSITIONAL, nargs="?", metavar="MODEL", default=argparse.SUPPRESS,
                            help="The model, as --model takes it (give one of the two).")
    parser.add_argument(
        "--config", metavar="FILE.yaml", default=None,
        help="Options from a YAML file: keys are the flag names without the leading dashes "
        "(max-num-seqs or max_num_seqs). A flag on the command line overrides the file.")
    for section in sections:
        for part in _PARTS.get(section, (section,)):
            group = parser.add_argument_group(part.title)
            for name, field in part.model_fields.items():
                _add_flag(group, name, field)


def _add_flag(group: argparse._ArgumentGroup, name: str, field: Any) -> None:
    meta = option_meta(field)
    kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": _help(field, meta)}
    if field.annotation in (bool, bool | None):
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        choices = _choices(field.annotation)
        kwargs["metavar"] = meta.get("metavar") or ("{" + ",".join(choices) + "}" if choices else _metavar(field))
        if _is_tuple(field.annotation) and name != "kv_offload":
            kwargs["nargs"] = "+"
    group.add_argument(flag_name(name), **kwargs)


def _help(field: Any, meta: dict[str, Any]) -> str:
    text = field.description or ""
    default = field.default
    if meta.get("metavar") in _SIZE_METAVARS and isinstance(default, int):
        default = format_size(default)
    if default not in (None, ()) and field.repr:
        text += f" (default: {default})"
    if meta.get("env"):
        text += " Also read from " + ", else ".join(f"${name}" for name in meta["env"]) + "."
    return text.replace("%", "%%")


def _metavar(field: Any) -> str:
    return "N" if "int" in str(field.annotation) else "VALUE"


def _choices(annotation: Any) -> tuple[str, ...]:
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        for arg in typing.get_args(annotation):
            if typing.get_origin(arg) is Literal:
                return typing.get_args(arg)
    return ()


def _is_tuple(annotation: Any) -> bool:
    base = typing.get_args(annotation)[0] if typing.get_origin(annotation) is typing.Annotated else annotation
    return typing.get_origin(base) is tuple


# A config file is a few dozen lines; a larger one is a mistake (or an attack).
MAX_CONFIG_BYTES = 1024**2


class _ConfigLoader(yaml.SafeLoader):
    """yaml.SafeLoader without what a config file never needs and an attacker uses:
    aliases (a few hundred bytes of nested `*refs` expand to gigabytes: the alias bomb)
    and duplicate keys (PyYAML keeps the last one silently)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.MarkedYAMLError(
                problem="aliases (*name) are not allowed in a config file",
                problem_mark=self.peek_event().start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):
                continue  # the SafeLoader refuses it below
            if key in seen:
                raise yaml.MarkedYAMLError(problem=f"duplicate key {key!r}", problem_mark=key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line for a YAML error: what is wrong and where (PyYAML's own text spans lines)."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return " ".join(str(exc).split())
    problem = " ".join(f"{exc.context or ''} {exc.problem or ''}".split())
    mark = exc.problem_mark or exc.context_mark
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark else problem


def read_config_file(path: str) -> dict[str, Any]:
    """The options of a YAML config file, keyed by option name (dashes become underscores).
    Every problem (unreadable, too large, not YAML, aliases, a key given twice in either
    spelling) is a one-line ConfigError naming the file."""
    try:
        with open(expand_path(path), "rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError("config", f"{path} is larger than {MAX_CONFIG_BYTES // 1024**2} MiB: not a config file")
    try:
        data = yaml.load(raw.decode("utf-8"), Loader=_ConfigLoader)
    except UnicodeDecodeError as exc:
        raise ConfigError("config", f"{path} is not UTF-8 text: {exc.reason}") from None
    except yaml.YAMLError as exc:
        raise ConfigError("config", f"{path} is not valid YAML: {_yaml_problem(exc)}") from None
    except RecursionError:
        raise ConfigError("config", f"{path} is nested too deeply to be a config file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping of option: value, got {type(data).__name__}")
    options: dict[str, Any] = {}
    spelled: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name in options:
            raise ConfigError("config", f"{path}: {name!r} is set twice, as {spelled[name]!r} and as {key!r}")
        options[name], spelled[name] = value, key
    return options


def load_options(args: argparse.Namespace, *sections: type[Options]) -> list[Options]:
    """Build each section from the parsed flags, the --config file, environment
    variables and defaults (in that order of precedence). ConfigError names the flag."""
    path = getattr(args, "config", None)
    from_file = read_config_file(path) if path else {}
    known = {name for section in sections for name in section.model_fields}
    unknown = sorted(set(from_file) - known)
    if unknown:
        raise ConfigError("config", f"{path}: {unknown[0]!r} is not an option of this command")
    _fold_model_positional(args)
    built = []
    for section in sections:
        values: dict[str, Any] = {}
        for name, field in section.model_fields.items():
            from_env = [os.environ[var] for var in option_meta(field).get("env", ()) if os.environ.get(var)]
            if from_env:
                values[name] = from_env[0]
            if name in from_file:
                values[name] = from_file[name]
            if hasattr(args, name):
                values[name] = getattr(args, name)
        try:
            built.append(section(**values))
        except ConfigError as exc:
            if exc.option in from_file and not hasattr(args, exc.option):
                raise ConfigError(exc.option, f"{exc.message} (set in {path})") from None
            raise
    return built


def _fold_model_positional(args: argparse.Namespace) -> None:
    """MODEL given as the first argument is --model (a flag: it beats the config file)."""
    positional = getattr(args, MODEL_POSITIONAL, None)
    if positional is None:
        return
    flag = getattr(args, "model", positional)
    if flag != positional:
        raise ConfigError(
            "model", f"the model is given twice, as MODEL {positional!r} and as --model {flag!r}; "
            "give one of them")
    args.model = positional


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of a command that takes the engine options."""
    (config,) = load_options(args, EngineConfig)
    return config
