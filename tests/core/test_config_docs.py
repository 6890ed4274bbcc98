"""docs/config.md documents every config key: a key added to the dataclasses without a line there
fails here, and so does a table row for a key the code no longer has."""

import dataclasses
import pathlib
import re
import typing

from headrace.config import Config

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "config.md"


def config_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of `cls`, sections included (`learner`, `learner.optimizer`,
    `learner.optimizer.lr`). Annotations are strings (`from __future__ import annotations`), so
    nested sections are found through `typing.get_type_hints`."""
    hints = typing.get_type_hints(cls)
    keys = []
    for field in dataclasses.fields(cls):
        key = f"{prefix}.{field.name}" if prefix else field.name
        keys.append(key)
        if dataclasses.is_dataclass(hints[field.name]):
            keys.extend(config_keys(hints[field.name], key))
    return keys


def test_the_walk_finds_nested_sections():
    keys = config_keys()
    for key in ("run.dir", "learner.optimizer", "learner.optimizer.lr", "learner.loss.kind",
                "env.latency.sigma", "model.lora.rank", "actor.vllm.threads", "sft.lr"):
        assert key in keys
    assert len(keys) == len(set(keys))


def test_every_key_is_documented():
    text = DOC.read_text()
    missing = [key for key in config_keys() if f"`{key}`" not in text]
    assert not missing, (f"{len(missing)} config keys are not in docs/config.md (as `key`, in the "
                         f"table of their section): {', '.join(missing)}")


def test_every_documented_key_exists():
    rows = re.findall(r"^\| `([a-z0-9_.]+)` \|", DOC.read_text(), flags=re.MULTILINE)
    assert rows, "docs/config.md has no key tables"
    stale = sorted(set(rows) - set(config_keys()))
    assert not stale, f"docs/config.md documents keys the code does not have: {', '.join(stale)}"
