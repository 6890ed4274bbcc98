"""Tokenizers of real checkpoints: a Hugging Face folder's `tokenizer.json`, or the tokenizer a
GGUF file embeds, through the `tokenizers` library (JAX-free).

`HFTokenizer` implements the project's tokenizer protocol (`encode`, `decode`, `special_id`,
`vocab_size`, `template`, and the special ids `pad_id`, `bos_id`, `eos_id`, `end_of_turn_id`,
`stop_ids` that the small tokenizers also have), plus `encode_markup` for text a chat template
rendered:

- `encode(text)` treats special-token strings as ordinary text (an observation saying
  `<|im_end|>` cannot end a turn); `encode_markup(text)` matches them as the special tokens, as
  `apply_chat_template` does with a rendered conversation. Neither adds a BOS: the template writes
  it where the model wants it.
- `decode(ids)` drops special tokens (what an environment is given); `decode_markup` keeps them.

Ids are the checkpoint's own: tests/text/test_hf_tokenizer.py checks them against transformers'
`AutoTokenizer` on a thousand strings.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from headrace.text.tokenizers import TokenizerError

if TYPE_CHECKING:
    from headrace.formats.gguf import GGUF


class CheckpointTextError(ValueError):
    """A checkpoint's tokenizer or chat template headrace cannot build (the message names the file
    and the field)."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the checkpoint's special tokens and chat template.

    Args:
      tokenizer: the backend (its added special tokens are the specials).
      bos_token, eos_token, pad_token, unk_token: the checkpoint's named specials (or None).
      chat_template: the Jinja source, or None (then `text.template: auto` has nothing to use).
      eos_ids: more ids that end generation (generation_config.json's `eos_token_id` list).
      source: where it came from, for error messages.
    """

    def __init__(self, tokenizer, *, bos_token: str | None, eos_token: str | None,
                 pad_token: str | None = None, unk_token: str | None = None,
                 chat_template: str | None = None, eos_ids: Sequence[int] = (), source: str = ""):
        import tokenizers

        self.source = source
        self._markup = tokenizer
        self._plain = tokenizers.Tokenizer.from_str(tokenizer.to_str())
        self._plain.encode_special_tokens = True  # specials in observation text stay text
        added = tokenizer.get_added_tokens_decoder()
        self.specials = {t.content: i for i, t in added.items() if t.special}
        self.added_tokens = tuple(t.content for t in added.values())  # special or not
        self.special_ids = frozenset(self.specials.values())
        self.tokens = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token,
                       "unk_token": unk_token}
        self.bos_id = self._id_or_none(bos_token)
        self.eos_id = self._id_or_none(eos_token)
        pad = self._id_or_none(pad_token)
        self.pad_id = pad if pad is not None else (self.eos_id if self.eos_id is not None else 0)
        self.chat_template = chat_template
        self._eos_ids = tuple(int(i) for i in eos_ids)
        self.template = None  # set by headrace.text.jinja_template.attach (`text.template: auto`)
        self.end_of_turn_id = self.eos_id  # the template's end-of-turn token once attached

    def _id_or_none(self, token: str | None) -> int | None:
        return None if token is None else self._markup.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._markup.get_vocab_size(with_added_tokens=True)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end a generated turn: the template's end of turn, the eos token(s)."""
        ids = [self.end_of_turn_id, self.eos_id, *self._eos_ids]
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._plain.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_markup(self, text: str) -> np.ndarray:
        """Token ids of template-rendered text, its special-token strings matched as specials."""
        return np.asarray(self._markup.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: Sequence[str], markup: bool = False) -> list[list[int]]:
        backend = self._markup if markup else self._plain
        return [e.ids for e in backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._markup.decode([int(i) for i in ids], skip_special_tokens=True)

    def decode_markup(self, ids: Sequence[int]) -> str:
        """The text of ids with their special tokens spelled out (what a template renders)."""
        return self._markup.decode([int(i) for i in ids], skip_special_tokens=False)

    def ids_of(self, words: Sequence[str]) -> tuple[int, ...]:
        raise TokenizerError("a checkpoint's tokenizer has no word tokens; actions are open text")

    def special_id(self, name: str) -> int:
        """The id of a special token by its text (`<|im_start|>`), or `<bos>` / `<eos>` / `<pad>`.

        Raises:
          TokenizerError: no such special token.
        """
        alias = {"<bos>": self.bos_id, "<eos>": self.eos_id, "<pad>": self.pad_id}
        if alias.get(name) is not None:
            return alias[name]
        if name in self.specials:
            return self.specials[name]
        raise TokenizerError(f"special token {name!r} is not in the tokenizer of {self.source} "
                             f"(it has {', '.join(sorted(self.specials)) or 'none'})")


def _read_json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointTextError(f"{path}: not readable JSON ({error})") from None


def folder_chat_template(folder: pathlib.Path, tokenizer_config: dict) -> str | None:
    """The chat template of a checkpoint folder: `chat_template.jinja` (transformers 5),
    `chat_template.json`, else tokenizer_config.json's `chat_template` (a string, or a list of
    named templates of which `default` is used)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if (folder / "chat_template.json").is_file():
        template = _read_json(folder / "chat_template.json").get("chat_template", template)
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise CheckpointTextError(f"{folder}: tokenizer_config.json lists chat templates "
                                      f"{sorted(named)} but none named 'default'")
        template = named["default"]
    return template if isinstance(template, str) and template else None


def folder_tokenizer(folder: str | pathlib.Path) -> HFTokenizer:
    """The tokenizer of a Hugging Face checkpoint folder (`tokenizer.json`, with specials, bos/eos
    and the chat template from tokenizer_config.json, chat_template.jinja, generation_config.json
    and config.json).

    Raises:
      CheckpointTextError: no tokenizer.json (slow, sentencepiece-only tokenizers are not read:
        save the tokenizer with transformers' fast tokenizer), or an unreadable file.
    """
    import tokenizers

    folder = pathlib.Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise CheckpointTextError(f"{folder}: no tokenizer.json (headrace reads fast tokenizers; "
                                  "save one with transformers' AutoTokenizer.save_pretrained)")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # the Rust library raises plain Exception on a bad file
        raise CheckpointTextError(f"{path}: the tokenizers library cannot read it ({error})") \
            from None
    config = _read_json(folder / "tokenizer_config.json") \
        if (folder / "tokenizer_config.json").is_file() else {}
    model_config = _read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    generation = _read_json(folder / "generation_config.json") \
        if (folder / "generation_config.json").is_file() else {}
    names = {key: _token_text(config.get(key)) for key in
             ("bos_token", "eos_token", "pad_token", "unk_token")}
    for key in ("bos_token", "eos_token", "pad_token"):  # fall back on the model's ids
        ident = model_config.get(f"{key}_id")
        if names[key] is None and isinstance(ident, int):
            names[key] = backend.id_to_token(ident)
    eos = generation.get("eos_token_id", model_config.get("eos_token_id"))
    eos_ids = eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
    return HFTokenizer(backend, **names, chat_template=folder_chat_template(folder, config),
                       eos_ids=eos_ids, source=str(folder))


# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) -> the split regex of the original
# tokenizer.json (None: GPT-2's byte-level regex). Others are refused by name.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GGUF_PRE = {"smollm": "digits", "gpt2": None, "default": None,
             "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes (what byte-level BPE vocabularies use)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    codes = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, codes)))


def gguf_tokenizer(checkpoint: GGUF) -> HFTokenizer:
    """The tokenizer a GGUF checkpoint (`headrace.formats.gguf.read`) embeds, with its chat
    template attached: byte-level BPE from `tokenizer.ggml.tokens` / `.merges`,
    the pre-tokenizer its `tokenizer.ggml.pre` names, control tokens (type 3) as specials and
    user-defined ones (type 4) as added tokens, as transformers builds it.

    Raises:
      headrace.formats.gguf.GGUFError: no embedded tokenizer, or a kind not built here
        (sentencepiece `llama` vocabularies, unknown pre-tokenizers).
    """
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from headrace.formats.gguf import GGUFError

    path, _value = checkpoint.path, lambda key, default=None: checkpoint.metadata(key, default)
    kind = _value("tokenizer.ggml.model")
    if kind is None:
        raise GGUFError(f"{path}: embeds no tokenizer (tokenizer.ggml.model is missing)")
    if kind != "gpt2":
        raise GGUFError(f"{path}: tokenizer.ggml.model={kind!r} is not supported (headrace builds "
                        "byte-level BPE vocabularies, 'gpt2'); load the Hugging Face folder")
    pre = _value("tokenizer.ggml.pre", "default")
    if pre not in _GGUF_PRE:
        raise GGUFError(f"{path}: pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported "
                        f"(known: {', '.join(sorted(_GGUF_PRE))}); load the Hugging Face folder")
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    tokens = list(_value("tokenizer.ggml.tokens"))
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in _value("tokenizer.ggml.merges", [])]
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
    split = _GGUF_PRE[pre]
    if split == "digits":
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False)])
    elif split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    types = list(_value("tokenizer.ggml.token_type", []))
    control = [tokenizers.AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, types) if kind == 3 and set(t) <= alphabet]
    backend.add_special_tokens(control)
    user = [tokenizers.AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types) if kind == 4 and t in vocab]
    backend.add_tokens(user)

    def name(key: str) -> str | None:
        ident = _value(f"tokenizer.ggml.{key}")
        return None if ident is None or ident >= len(tokens) else tokens[int(ident)]

    template = _value("tokenizer.chat_template")
    return HFTokenizer(backend, bos_token=name("bos_token_id"), eos_token=name("eos_token_id"),
                       pad_token=name("padding_token_id"), unk_token=name("unknown_token_id"),
                       chat_template=str(template) if template else None, source=str(path))
