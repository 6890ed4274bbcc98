"""docs/config.md documents every config key: a key added to the dataclasses without a line there
fails here, and so does a table row for a key the code no longer has."""

import dataclasses
import pathlib
import re
import typing

from headrace.config import Config

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _fields(cls: type = Config, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted key, its type) of every key of `cls`, nested sections included."""
    hints, out = typing.get_type_hints(cls), []
    for field in dataclasses.fields(cls):
        key = f"{prefix}.{field.name}" if prefix else field.name
        out.append((key, hints[field.name]))
        if dataclasses.is_dataclass(hints[field.name]):
            out.extend(_fields(hints[field.name], key))
    return out


def config_keys() -> list[str]:
    """Every dotted key of the config, sections included (`learner`, `learner.optimizer`,
    `learner.optimizer.lr`). Annotations are strings (`from __future__ import annotations`), so
    nested sections are found through `typing.get_type_hints`."""
    return [key for key, _ in _fields()]


def test_the_walk_finds_nested_sections():
    keys = config_keys()
    for key in ("run.dir", "learner.optimizer", "learner.optimizer.lr", "learner.loss.kind",
                "env.latency.sigma", "model.lora.rank", "actor.vllm.threads", "sft.lr"):
        assert key in keys
    assert len(keys) == len(set(keys))


def test_every_key_is_documented():
    """Every key has a row of its section's table; a section (`learner`, `learner.optimizer`)
    has its heading or its row."""
    text = DOC.read_text()
    rows = set(re.findall(r"^\| `([a-z0-9_.]+)` \|", text, flags=re.MULTILINE))
    sections = {name for name, field in _fields() if dataclasses.is_dataclass(field)}
    missing = [key for key in config_keys()
               if key not in rows and not (key in sections and f"`{key}`" in text)]
    assert not missing, (f"{len(missing)} config keys are not in docs/config.md (as `key`, in the "
                         f"table of their section): {', '.join(missing)}")


def test_every_documented_key_exists():
    rows = re.findall(r"^\| `([a-z0-9_.]+)` \|", DOC.read_text(), flags=re.MULTILINE)
    assert rows, "docs/config.md has no key tables"
    stale = sorted(set(rows) - set(config_keys()))
    assert not stale, f"docs/config.md documents keys the code does not have: {', '.join(stale)}"
