"""A checkpoint's own chat template (Jinja), rendered as Hugging Face renders it (JAX-free).

`compile_template` builds the environment transformers' `apply_chat_template` uses: a sandboxed
(immutable) Jinja environment with `trim_blocks` and `lstrip_blocks`, the loop-controls extension,
a `tojson` that does not escape HTML (`ensure_ascii=False`, with indent / separators / sort_keys),
and the globals `raise_exception` and `strftime_now`. `JinjaChatTemplate.render` passes what
transformers passes: `messages`, `tools`, `add_generation_prompt` and the tokenizer's named special
tokens (`bos_token`, `eos_token`, `pad_token`, `unk_token`).

Tools (`text.tools`: a JSON file of function schemas; `text.tool_format`):

- `auto` (default): a template that reads `tools` (Qwen2.5, Llama 3.1, Hermes, ...) renders them
  itself; one that does not (SmolLM2's) gets the `hermes` fallback.
- `template`: the template must read `tools` (else a ConfigError at start).
- `hermes`: the fallback, always. The tool definitions are written into the system message (made
  if there is none) as below; the policy calls a tool with `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` in its turn; a tool result is a `tool` turn when the template renders that
  role (it shows a tool message's content), else a user turn holding
  `<tool_response>\\nRESULT\\n</tool_response>`.

`HERMES_TOOLS` is the fallback's system block (Qwen2.5's own wording, so a policy trained on either
sees the same instructions).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
from collections.abc import Sequence
from typing import Any

HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}"
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}}\n</tool_call>")
TOOL_RESPONSE = "<tool_response>\n{content}\n</tool_response>"
TOOL_FORMATS = ("auto", "template", "hermes")


class ChatTemplateError(ValueError):
    """A chat template that does not compile, raises while rendering (`raise_exception`), or
    cannot render what an episode needs; the message names the template and the turns."""


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """The compiled template, in transformers' Jinja environment (see the module docstring).

    Raises:
      ChatTemplateError: a syntax error (with its line).
    """
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise ChatTemplateError(f"the chat template does not compile: line {error.lineno}: "
                                f"{error.message}") from None


@functools.lru_cache(maxsize=16)
def reads_variable(source: str, name: str) -> bool:
    """Whether the template reads a variable (e.g. `tools`) it is given from outside."""
    import jinja2
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ast = ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols]).parse(source)
    except jinja2.exceptions.TemplateSyntaxError:
        return False
    return name in meta.find_undeclared_variables(ast)


@dataclasses.dataclass(frozen=True)
class JinjaChatTemplate:
    """A Jinja chat template with the run's system prompt, observation role and tools.

    Frozen: one instance serves every episode. `specials` are the tokenizer's named special
    tokens the template may read (`bos_token`, ...).
    """

    name: str
    source: str
    specials: tuple[tuple[str, str], ...] = ()
    system: str = ""  # system prompt opening every episode ("": the template's default, if any)
    observation_role: str = "user"  # role of the observations after the first (user or tool)
    tools: tuple[str, ...] = ()  # tool schemas, each as JSON text (hashable, immutable)
    tool_format: str = "auto"  # auto | template | hermes (see the module docstring)

    def __post_init__(self):
        if self.observation_role not in ("user", "tool"):
            raise ValueError(f"observation_role={self.observation_role!r}: user or tool")
        if self.tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format={self.tool_format!r}: one of {', '.join(TOOL_FORMATS)}")
        if self.tool_format == "template" and not self.template_reads_tools:
            raise ChatTemplateError(f"text.tool_format=template: the chat template {self.name} "
                                    "has no tool syntax (it never reads `tools`); use auto or "
                                    "hermes for the documented fallback")
        compile_template(self.source)

    @property
    def template_reads_tools(self) -> bool:
        return reads_variable(self.source, "tools")

    @property
    def hermes(self) -> bool:
        """Whether tools use the hermes fallback (only when there are tools)."""
        return bool(self.tools) and (self.tool_format == "hermes" or not self.template_reads_tools)

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return [json.loads(t) for t in self.tools]

    @functools.cached_property
    def renders_tool_role(self) -> bool:
        """Whether a `tool` message's content appears in the rendering (else the fallback wraps a
        tool result in a user turn)."""
        probe = "\x00tool-result\x00"
        try:
            text = self.render([{"role": "user", "content": "q"},
                                {"role": "assistant", "content": "a"},
                                {"role": "tool", "content": probe}], tools=False)
        except ChatTemplateError:
            return False
        return probe in text

    def system_content(self, escape=lambda text: text) -> str | None:
        """The system message's content: the configured prompt (through `escape`), with the
        hermes tool block."""
        parts = [escape(self.system)] if self.system else []
        if self.hermes:
            listing = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in self.tool_schemas)
            parts.append(HERMES_TOOLS.format(tools=listing))
        return "\n\n".join(parts) if parts else None

    def tool_message(self, content: str) -> dict[str, str]:
        """A tool result as a message (see the module docstring)."""
        if self.hermes and not self.renders_tool_role:
            return {"role": "user", "content": TOOL_RESPONSE.format(content=content)}
        return {"role": "tool", "content": content}

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False,
               tools: bool = True) -> str:
        """The template's text for a conversation, as `apply_chat_template(tokenize=False)`.

        Raises:
          ChatTemplateError: the template raised (its message, and the roles rendered).
        """
        import jinja2

        schemas = self.tool_schemas if tools and self.tools and not self.hermes else None
        try:
            return compile_template(self.source).render(
                messages=list(messages), tools=schemas,
                add_generation_prompt=add_generation_prompt, **dict(self.specials))
        except jinja2.exceptions.TemplateError as error:
            roles = ", ".join(m.get("role", "?") for m in messages)
            raise ChatTemplateError(f"chat template {self.name} cannot render [{roles}]: "
                                    f"{error}") from None
