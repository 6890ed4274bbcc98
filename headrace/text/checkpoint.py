"""The text side of a real checkpoint: its tokenizer with a Jinja chat template attached (JAX-free).

`model.init_from: hf:DIR` or `gguf:FILE` (either may be `pkg:PACKAGE/FILE`, a file inside an
installed package) names a checkpoint; `checkpoint_tokenizer` loads its tokenizer and
`with_template` attaches the template `text.template` names:

- `auto`: the checkpoint's own (tokenizer_config.json, chat_template.jinja, or GGUF metadata);
- `FILE.jinja`: a Jinja chat template from a file (e.g. a tool-capable template for a checkpoint
  whose own has no tool syntax);
- the built-in `plain` / `chat` and `module:NAME` templates use headrace's fixed special ids, so
  with a checkpoint's tokenizer they are a ConfigError.

The attached template also fixes the tokenizer's `end_of_turn_id` (the first special token the
template writes after an assistant message: `<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`), which
joins the eos id(s) in `stop_ids`, the sampler's stop tokens.
"""

from __future__ import annotations

import copy
import json
import pathlib

from headrace.config import ConfigError, TextConfig
from headrace.rundir import RunDir
from headrace.text.hf_tokenizer import (
    CheckpointTextError,
    HFTokenizer,
    folder_tokenizer,
    gguf_tokenizer,
)
from headrace.text.jinja_template import ChatTemplateError, JinjaChatTemplate

PREFIXES = ("hf:", "gguf:")


def names_checkpoint(init_from: str) -> bool:
    """Whether `model.init_from` names a checkpoint (hf: or gguf:) rather than a run folder."""
    return init_from.startswith(PREFIXES)


def checkpoint_of(init_from: str, depth: int = 8) -> str:
    """The checkpoint (hf:/gguf:) a run starts from: `init_from` itself, or for a run folder the
    one its own config.yaml started from, followed back (a warm-up of SmolLM2, then a run from
    that warm-up, both use SmolLM2's tokenizer); "" when the chain ends without one."""
    from headrace.config import load

    for _ in range(depth):
        if not init_from or names_checkpoint(init_from):
            return init_from
        path = pathlib.Path(init_from) / RunDir.CONFIG
        if not path.is_file():
            return ""
        try:
            init_from = load(path).model.init_from
        except ConfigError:
            return ""  # check_init_from reports the broken folder
    return ""


def checkpoint_tokenizer(init_from: str) -> HFTokenizer:
    """The tokenizer of the checkpoint `model.init_from` names (no template attached yet).

    Raises:
      ConfigError: not hf:/gguf:, no such file or folder, or a tokenizer headrace cannot build
        (the message names the key and the file).
    """
    from headrace.formats import gguf

    key = f"model.init_from={init_from!r}"
    kind, _, where = init_from.partition(":")
    try:
        path = gguf.package_path(where)
        if kind == "hf":
            if not path.is_dir():
                raise ConfigError(f"{key}: {path} is not a folder (hf:DIR names a Hugging Face "
                                  "checkpoint folder)")
            return folder_tokenizer(path)
        if kind == "gguf":
            return gguf_tokenizer(gguf.read(path))
    except (CheckpointTextError, gguf.GGUFError) as error:
        raise ConfigError(f"{key}: {error}") from None
    raise ConfigError(f"{key}: not a checkpoint (hf:DIR or gguf:FILE)")


def _tools(config: TextConfig) -> tuple[str, ...]:
    if not config.tools:
        return ()
    path = pathlib.Path(config.tools)
    try:
        schemas = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(f"text.tools={config.tools!r}: not a readable JSON file ({error})") \
            from None
    if not isinstance(schemas, list) or not all(isinstance(s, dict) for s in schemas):
        raise ConfigError(f"text.tools={config.tools!r}: must hold a JSON list of tool schemas "
                          '({"type": "function", "function": {"name": ..., "parameters": ...}})')
    return tuple(json.dumps(s, ensure_ascii=False) for s in schemas)


def jinja_template(tokenizer: HFTokenizer, config: TextConfig) -> JinjaChatTemplate:
    """The Jinja template `text.template` names, for this tokenizer.

    Raises:
      ConfigError: auto with a checkpoint that has no chat template, an unreadable or broken
        template file, a built-in template with a checkpoint tokenizer, bad tools.
    """
    key = f"text.template={config.template!r}"
    if config.template == "auto":
        source, name = tokenizer.chat_template, f"of {tokenizer.source}"
        if not source:
            raise ConfigError(f"{key}: the checkpoint {tokenizer.source} has no chat template; "
                              "give one as text.template: FILE.jinja")
    elif config.template.endswith(".jinja"):
        try:
            source = pathlib.Path(config.template).read_text(encoding="utf-8")
        except OSError as error:
            raise ConfigError(f"{key}: cannot read the template file ({error})") from None
        name = config.template
    else:
        raise ConfigError(f"{key}: a checkpoint's tokenizer needs a Jinja chat template: auto "
                          "(the checkpoint's own) or FILE.jinja; the built-in templates use "
                          "headrace's small vocabularies")
    specials = tuple((k, v) for k, v in tokenizer.tokens.items() if v is not None)
    system = None
    try:
        template = JinjaChatTemplate(name, source, specials, system=config.system,
                                     observation_role=config.observation_role,
                                     tools=_tools(config), tool_format=config.tool_format)
        system = template.system_content()  # what every episode opens with must render
        template.render([*([{"role": "system", "content": system}] if system else []),
                         {"role": "user", "content": "?"}], add_generation_prompt=True)
    except ChatTemplateError as error:
        hint = " (text.system or text.tools make a system message)" if system else ""
        raise ConfigError(f"{key}: {error}{hint}") from None
    return template


def end_of_turn_id(tokenizer: HFTokenizer, template: JinjaChatTemplate) -> int | None:
    """The first special token the template writes after an assistant message's content."""
    marker = "\x00end\x00"
    try:
        text = template.render([{"role": "user", "content": "q"},
                                {"role": "assistant", "content": marker}], tools=False)
    except ChatTemplateError:
        return None
    after = text[text.find(marker) + len(marker):] if marker in text else ""
    ids = [int(i) for i in tokenizer.encode_markup(after)]
    return next((i for i in ids if i in tokenizer.special_ids), None)


def with_template(tokenizer: HFTokenizer, config: TextConfig) -> HFTokenizer:
    """A copy of the tokenizer with the configured Jinja template (and its end-of-turn id)
    attached (the copy shares the immutable backend)."""
    template = jinja_template(tokenizer, config)
    tokenizer = copy.copy(tokenizer)
    tokenizer.template = template
    eot = end_of_turn_id(tokenizer, template)
    if eot is not None:
        tokenizer.end_of_turn_id = eot
    return tokenizer
