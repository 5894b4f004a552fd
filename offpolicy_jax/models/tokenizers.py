"""Tokenizers: a tiny built-in character tokenizer and an HF `tokenizers` wrapper.

Both share one interface:

  ids = tok.encode("12+7=")            # list[int]
  text = tok.decode(ids)               # stops at the first EOS, skips padding
  tok.vocab_size, tok.pad_id, tok.eos_id, tok.bos_id
  text = tok.apply_chat_template([{"role": "user", "content": "hi"}])

`HFTokenizer` reads a Hugging Face tokenizer directory (`tokenizer.json`,
`tokenizer_config.json`, optional `chat_template.jinja`) and renders the chat
template with jinja2 the way `transformers` does, without depending on it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

from offpolicy_jax import files


class Tokenizer(Protocol):
  """What the data pipeline, samplers and rewards need from a tokenizer."""

  vocab_size: int
  pad_id: int
  eos_id: int
  bos_id: int | None

  def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...

  def apply_chat_template(
    self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
  ) -> str: ...

  def save_pretrained(self, path: str) -> None: ...


# Order is the vocabulary: ids are stable across versions (append only).
_CHAR_SPECIALS = ("<pad>", "<bos>", "<eos>")
_CHAR_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-=*/?:<>.,()|_!\n"


class CharTokenizer:
  """Deterministic character-level tokenizer for synthetic tasks.

  Vocabulary: `<pad>`=0, `<bos>`=1, `<eos>`=2, then digits, lower-case letters
  and the symbols ` +-=*/?:<>.,()|_!` and newline, one id per character
  (`vocab_size` = 57). Characters outside the vocabulary raise ValueError
  (synthetic tasks must never silently lose characters).
  """

  def __init__(self):
    self._itos = list(_CHAR_SPECIALS) + list(_CHAR_ALPHABET)
    self._stoi = {c: i for i, c in enumerate(_CHAR_ALPHABET, start=len(_CHAR_SPECIALS))}
    self.pad_id = 0
    self.bos_id = 1
    self.eos_id = 2
    self.vocab_size = len(self._itos)

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    """Maps each character to its id; optionally prepends `<bos>`."""
    try:
      ids = [self._stoi[c] for c in text]
    except KeyError as e:
      raise ValueError(f"CharTokenizer: character {e.args[0]!r} in {text!r} not in vocab.") from e
    return [self.bos_id, *ids] if add_bos else ids

  def decode(self, ids: Sequence[int]) -> str:
    """Inverse of `encode`: stops at the first EOS, skips pad and BOS."""
    out = []
    for i in ids:
      i = int(i)
      if i == self.eos_id:
        break
      if i in (self.pad_id, self.bos_id):
        continue
      if not 0 <= i < self.vocab_size:
        raise ValueError(f"CharTokenizer: id {i} outside [0, {self.vocab_size}).")
      out.append(self._itos[i])
    return "".join(out)

  def apply_chat_template(
    self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
  ) -> str:
    """No roles for the toy models: the message contents joined by newlines."""
    del add_generation_prompt
    return "\n".join(m["content"] for m in messages)

  def save_pretrained(self, path: str) -> None:
    """Writes the same character vocabulary as a Hugging Face fast tokenizer into `path`.

    `transformers.AutoTokenizer.from_pretrained(path)` then encodes and decodes
    exactly as this class does (one id per character; `<bos>`, `<eos>`, `<pad>`;
    no unknown token, so no id beyond the vocabulary), whichever class it picks:
    the file is a byte-level BPE without merges, the form `Qwen2Tokenizer`
    rebuilds from a `tokenizer.json` (transformers picks that class for any
    qwen2 checkpoint, whatever `tokenizer_class` says). Characters outside the
    vocabulary are dropped there, where `encode` raises.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = _byte_symbols()
    vocab = {c if c in _CHAR_SPECIALS else symbols[c]: i for i, c in enumerate(self._itos)}
    tok = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(_CHAR_SPECIALS))
    config = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "bos_token": _CHAR_SPECIALS[self.bos_id],
      "eos_token": _CHAR_SPECIALS[self.eos_id],
      "pad_token": _CHAR_SPECIALS[self.pad_id],
      "unk_token": None,
      "model_max_length": 1 << 20,
    }
    _write(path, tok, config)


def _byte_symbols() -> dict[str, str]:
  """GPT-2's byte-level alphabet: the printable character that stands for each byte.

  Printable Latin-1 bytes stand for themselves; the others (space, newline,
  controls) map in order to U+0100 and up, so " " is "Ġ" and "\n" is "Ċ".
  """
  kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
  moved = [b for b in range(256) if b not in kept]
  table = {chr(b): chr(b) for b in kept}
  table.update({chr(b): chr(256 + i) for i, b in enumerate(moved)})
  return table


def _token_content(tok: Any) -> str | None:
  """tokenizer_config.json stores special tokens as str or {"content": str, ...}."""
  if isinstance(tok, dict):
    return tok.get("content")
  return tok


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(
    x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
  )


def _raise_exception(message):
  import jinja2

  raise jinja2.exceptions.TemplateError(message)


def _compile_template(source: str):
  """Compiles a chat template with the environment `transformers` uses."""
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
  return env.from_string(source)


class HFTokenizer:
  """A Hugging Face fast tokenizer (`tokenizer.json`) plus its chat template.

  Attributes:
    vocab_size: size of the vocabulary including added tokens.
    eos_id: id of `eos_token` from tokenizer_config.json.
    eos_token: its text (e.g. "<|im_end|>"), or None.
    pad_id: id of `pad_token`, falling back to `eos_id` when there is none.
    bos_id: id of `bos_token` or None.
  """

  def __init__(self, tokenizer, config: dict[str, Any], chat_template: str | None):
    self._tok = tokenizer
    self._config = config
    self._special = {
      name: _token_content(config.get(name))
      for name in ("bos_token", "eos_token", "pad_token", "unk_token")
    }
    self.eos_token = self._special["eos_token"]
    self.bos_id = self._id(self._special["bos_token"])
    self.eos_id = self._id(self._special["eos_token"])
    pad = self._id(self._special["pad_token"])
    self.pad_id = pad if pad is not None else self.eos_id
    self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    self.chat_template = chat_template
    self._template = _compile_template(chat_template) if chat_template else None

  def _id(self, token: str | None) -> int | None:
    if token is None:
      return None
    i = self._tok.token_to_id(token)
    if i is None:
      raise ValueError(f"special token {token!r} from tokenizer_config.json is not in the vocab.")
    return i

  def save_pretrained(self, path: str) -> None:
    """Writes `tokenizer.json`, `tokenizer_config.json` (with the chat template) into `path`."""
    config = dict(self._config)
    if self.chat_template is not None:
      config["chat_template"] = self.chat_template
    _write(path, self._tok, config)

  @classmethod
  def from_pretrained(cls, path: str | os.PathLike) -> HFTokenizer:
    """Loads `tokenizer.json`, `tokenizer_config.json` and the chat template from `path`.

    Raises:
      ValueError: naming the file when `tokenizer.json` is missing or cannot
        be loaded, or `tokenizer_config.json` is not a JSON object.
    """
    from tokenizers import Tokenizer

    path = os.fspath(path)
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok_file):
      raise ValueError(f"tokenizer file not found: {tok_file}")
    cfg_file = os.path.join(path, "tokenizer_config.json")
    config = files.read_json_object(cfg_file) if os.path.exists(cfg_file) else {}
    try:
      tokenizer = Tokenizer.from_file(tok_file)
    except Exception as e:  # The Rust library raises a bare Exception without the path.
      raise ValueError(f"{tok_file}: cannot load the tokenizer: {e}") from e
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
      by_name = {t["name"]: t["template"] for t in template}
      template = by_name.get("default", next(iter(by_name.values()), None))
    jinja_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.exists(jinja_file):
      with open(jinja_file) as f:
        template = f.read()
    return cls(tokenizer, config, template)

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    """Token ids of `text` without the post-processor's special tokens.

    Chat templates already contain their special tokens; `add_bos=True`
    prepends `bos_id` (if the tokenizer has one) for raw text.
    """
    ids = self._tok.encode(text, add_special_tokens=False).ids
    if add_bos and self.bos_id is not None:
      ids = [self.bos_id, *ids]
    return ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Decodes up to (excluding) the first EOS; padding is dropped."""
    ids = [int(i) for i in ids]
    if self.eos_id is not None and self.eos_id in ids:
      ids = ids[: ids.index(self.eos_id)]
    ids = [i for i in ids if i != self.pad_id]
    return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

  def apply_chat_template(
    self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True, **kwargs
  ) -> str:
    """Renders the chat template as `transformers` does (text, not ids).

    Variables: `messages`, `add_generation_prompt`, the special tokens
    (`bos_token`, `eos_token`, `pad_token`, `unk_token`) and any `**kwargs`
    (e.g. `tools`, `enable_thinking`).
    """
    if self._template is None:
      raise ValueError("this tokenizer has no chat_template in tokenizer_config.json.")
    special = {k: v for k, v in self._special.items() if v is not None}
    return self._template.render(
      messages=list(messages),
      add_generation_prompt=add_generation_prompt,
      **special,
      **kwargs,
    )


def _write(path: str, tokenizer, config: dict[str, Any]) -> None:
  os.makedirs(path, exist_ok=True)
  tokenizer.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2, ensure_ascii=False)
