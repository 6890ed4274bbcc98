"""Typed trees from plain data: frozen dataclasses built from YAML mappings (and `--set a.b=v`
overrides) with every value checked against its annotation.

Every failure is a `ConfigError` naming the key, the value and what is allowed. A dataclass may
define `complete(kwargs, prefix) -> kwargs` (a static method) to fill keys in from others before
it is built (`ModelConfig` fills a preset's sizes). Used by `headrace.config` (the run's config)
and `headrace.sim.spec` (the simulator's).
"""

from __future__ import annotations

import dataclasses
import pathlib
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config file, key or value is wrong; the message says which and what is allowed."""


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {allowed}")


def plain(value: Any) -> Any:
    """Dataclass-dict output with tuples as lists (YAML- and JSON-friendly)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


Converters = dict[Any, Callable[[Any, str], Any]]


def _coerce(value: Any, annotation: Any, key: str, converters: Converters | None = None) -> Any:
    """Checks `value` against a field annotation, converting where YAML is looser than Python.

    `converters` maps annotations of custom types to functions (value, key) -> converted value.
    """
    origin = typing.get_origin(annotation)
    if converters and annotation in converters:
        return converters[annotation](value, key)
    if dataclasses.is_dataclass(annotation):
        return build(annotation, value, key, converters)
    if origin is Literal:
        allowed = typing.get_args(annotation)
        _check(value in allowed, key, value, f"one of {', '.join(map(str, allowed))}")
        return value
    if origin in (types.UnionType, typing.Union):
        for option in typing.get_args(annotation):
            if option is type(None) and value is None:
                return None
            try:
                return _coerce(value, option, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}={value!r}: must be "
                          + " or ".join(map(_described, typing.get_args(annotation))))
    if origin is tuple:
        _check(isinstance(value, (list, tuple)), key, value, "must be a list")
        (item_type, _) = typing.get_args(annotation)
        return tuple(_coerce(v, item_type, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        _check(isinstance(value, dict), key, value, "must be a mapping")
        _, value_type = typing.get_args(annotation)
        return {str(k): _coerce(v, value_type, f"{key}.{k}") for k, v in value.items()}
    if annotation is Any:
        return value
    if annotation is bool:
        _check(isinstance(value, bool), key, value, "must be true or false")
        return value
    if annotation is int:
        _check(isinstance(value, int) and not isinstance(value, bool), key, value,
               "must be an integer")
        return value
    if annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), key, value,
               "must be a number")
        return float(value)
    if annotation is str:
        _check(isinstance(value, str), key, value, "must be a string")
        return value
    raise TypeError(f"unsupported config annotation {annotation} at {key}")


def _described(annotation: Any) -> str:
    """What a value of `annotation` is, in words (for an error naming several)."""
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(annotation)))
    if typing.get_origin(annotation) is tuple:
        return f"a list of {_described(typing.get_args(annotation)[0])}s"
    return {int: "integer", float: "number", str: "string", bool: "true or false",
            type(None): "null"}.get(annotation, str(annotation))


def build(cls: type, data: Any, prefix: str = "", converters: Converters | None = None) -> Any:
    """Builds the dataclass `cls` from a nested mapping, checking keys and value types.

    Raises:
      ConfigError: an unknown key, a value of the wrong type, or one its `__post_init__` refuses.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'the top level'}={data!r}: must be a mapping of "
                          f"{cls.__name__} keys")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            raise ConfigError(f"{key}: unknown key; {prefix or 'the top level'} has "
                              f"{', '.join(sorted(fields))}")
        kwargs[name] = _coerce(value, hints[name], key, converters)
    complete = getattr(cls, "complete", None)  # a section that fills keys in from others
    if complete is not None:
        kwargs = complete(kwargs, prefix)
    return cls(**kwargs)


def _merge(base: dict, path: list[str], value: Any) -> None:
    for name in path[:-1]:
        node = base.setdefault(name, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(path)}: {name} is not a section")
        base = node
    base[path[-1]] = value


def parse_override(text: str) -> tuple[list[str], Any]:
    """Splits `a.b=v` into (["a", "b"], v), parsing v as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as error:
        raise ConfigError(f"--set {key}={raw!r}: not valid YAML ({error.problem})") from None
    return key.strip().split("."), value


def read_tree(path: str | pathlib.Path | None, overrides: typing.Sequence[str] = (),
              data: dict | None = None, what: str = "config file") -> dict[str, Any]:
    """A nested mapping from a YAML file (or a dict) with `section.key=value` overrides applied.

    Raises:
      ConfigError: the file is missing, not YAML, or not a mapping; an override is malformed.
    """
    tree: dict[str, Any] = dict(data or {})
    if path is not None:
        path = pathlib.Path(path)
        try:
            loaded = yaml.safe_load(path.read_text())
        except (FileNotFoundError, IsADirectoryError):
            raise ConfigError(f"{path}: no such {what}") from None
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{path}: not valid YAML{where}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: must be a mapping of sections")
        tree.update(loaded or {})
    for override in overrides:
        keys, value = parse_override(override)
        _merge(tree, keys, value)
    return tree


def import_object(key: str, spec: str, error: type[Exception] = ConfigError) -> Any:
    """The object `module:NAME` names (a user's plug-in: environment class, chat template).

    Raises:
      error: `spec` is not module:NAME, or the module cannot be imported; the message names `key`.
      AttributeError is not raised: a missing NAME gives None, for the caller to check the type.
    """
    import importlib

    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise error(f"{key}={spec!r}: cannot import {module_name} ({exc})") from None
    return getattr(module, attr, None)
