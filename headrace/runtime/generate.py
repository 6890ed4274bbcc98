"""`headrace generate MODEL --prompt TEXT [--chat] ...`: a user's first check that a checkpoint
loaded right, through the sampler the actors use (`headrace.model.generate`).

MODEL is hf:DIR, gguf:FILE (gguf:pkg:PACKAGE/PATH) or a run folder (its newest checkpoint, its
own tokenizer). With `chat` the prompt is one user message rendered by the checkpoint's chat
template (`headrace.text.checkpoint.with_template`: Jinja in a sandbox, as transformers renders it,
with the generation prompt).
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Any

from headrace.config import ConfigError
from headrace.formats import checkpoint_kind
from headrace.rundir import RunDir


def open_model(spec: str, dtype: str = "float32"):
    """(dims, params, tokenizer, chat template or None) of a checkpoint spec or run folder.

    Raises:
      ConfigError: no such checkpoint or run, or one that does not load.
    """
    if checkpoint_kind(spec):
        from headrace.model.load import load

        model = load(spec, dtype=dtype)
        return model.dims, model.params, model.tokenizer, model.chat_template
    from headrace.config import load as load_config
    from headrace.runtime.build import build_task
    from headrace.sft import load_init_params

    run_dir = pathlib.Path(spec)
    if not (run_dir / RunDir.CONFIG).is_file():
        raise ConfigError(f"{spec!r}: neither hf:DIR, gguf:FILE nor a run folder (no config.yaml)")
    source = load_config(run_dir / RunDir.CONFIG)
    task = build_task(source)
    config = dataclasses.replace(source, model=dataclasses.replace(source.model,
                                                                   init_from=str(run_dir)))
    return task.dims, load_init_params(config, task.dims)[1], task.tokenizer, None


def with_chat_template(tokenizer):
    """The checkpoint tokenizer with its own chat template attached (`text.template: auto`):
    its `template` renders as `apply_chat_template` does, its `stop_ids` include the template's
    end of turn.

    Raises:
      ConfigError: no chat template, or one that does not render a user turn.
    """
    from headrace.config import TextConfig
    from headrace.text.checkpoint import with_template

    return with_template(tokenizer, TextConfig(template="auto"))


def render_chat(tokenizer, prompt: str) -> str:
    """One user turn and the generation prompt, rendered by `with_chat_template(tokenizer)`."""
    return tokenizer.template.render([{"role": "user", "content": prompt}],
                                     add_generation_prompt=True)


def run(spec: str, *, prompt: str | None = None, prompt_ids: list[int] | None = None,
        chat: bool = False, max_new_tokens: int = 64, temperature: float = 0.0,
        dtype: str = "float32", seed: int = 0) -> dict[str, Any]:
    """Loads `spec`, continues the prompt; returns {"tokens", "text", "load_s", "generate_s",
    "prompt_tokens"}.

    Raises:
      ConfigError: a model that does not load, no prompt, a chat prompt without a template,
        text without a tokenizer, or a bad id / temperature.
    """
    from headrace.model.generate import generate

    if (prompt is None) == (prompt_ids is None):
        raise ConfigError("give one of --prompt TEXT or --prompt-ids 5,17,42")
    start = time.perf_counter()
    dims, params, tokenizer, template = open_model(spec, dtype)
    loaded = time.perf_counter()
    if prompt_ids is None:
        if tokenizer is None:
            raise ConfigError(f"{spec}: has no tokenizer (no tokenizer.json); give --prompt-ids")
        if chat:
            if not template:
                raise ConfigError(f"{spec}: has no chat template; drop --chat")
            tokenizer = with_chat_template(tokenizer)
            prompt_ids = list(tokenizer.encode_markup(render_chat(tokenizer, prompt)))
        else:
            prompt_ids = list(tokenizer.encode(prompt))
    stop = tuple(getattr(tokenizer, "stop_ids", ()) or ()) if tokenizer is not None else ()
    try:
        out = generate(dims, params, prompt_ids, max_new_tokens=max_new_tokens,
                       temperature=temperature, stop_ids=stop, seed=seed)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    done = time.perf_counter()
    tokens = [int(t) for t in out.tokens]
    text = tokenizer.decode(tokens) if tokenizer is not None else None
    return {"tokens": tokens, "text": text, "load_s": loaded - start, "generate_s": done - loaded,
            "prompt_tokens": len(prompt_ids)}
