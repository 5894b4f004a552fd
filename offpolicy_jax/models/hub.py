"""Models by Hugging Face repo id: `--config.model=Qwen/Qwen2.5-0.5B-Instruct`.

`config.model` names a preset (`tiny`, `qwen2.5-0.5b`, ...), a local Hugging
Face directory, or a hub repo id (`org/name`, what TRL and verl users type).
`model_dir` gives the local directory a name stands for: a repo id's files
(config, safetensors, tokenizer, chat template) are downloaded by
`huggingface_hub` into its usual cache (`HF_HOME` / `HF_HUB_CACHE`), or found
there when the machine is offline (`HF_HUB_OFFLINE=1`, or no network). The
config keeps the id as written, so a resume or an eval names the same model.
"""

from __future__ import annotations

import functools
import os
import re

from offpolicy_jax import errors

# What a checkpoint and its tokenizer need; no other weights formats, no READMEs.
FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "tokenizer*")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9]")


def is_repo_id(name: str) -> bool:
  """Whether `name` reads as `org/name` and is not a path on this machine."""
  return bool(_REPO_ID.fullmatch(name)) and not os.path.exists(name) and ".." not in name


def model_dir(name: str, field: str = "model") -> str | None:
  """The local Hugging Face directory `name` (the config's `field`) stands for; None for a
  preset name.

  Raises:
    errors.ConfigError: a repo id that is neither downloadable nor in the cache.
  """
  if os.path.isdir(name):
    return name
  if not is_repo_id(name):
    return None
  return _snapshot(name, field)


@functools.cache
def _snapshot(repo_id: str, field: str = "model") -> str:
  import huggingface_hub
  from huggingface_hub import constants

  try:
    # Online this checks the hub for a newer revision; offline (HF_HUB_OFFLINE=1) it
    # reads the cache only.
    return huggingface_hub.snapshot_download(repo_id, allow_patterns=list(FILES))
  except Exception as online:  # no network, no such repo, a gated repo, ...
    try:
      return huggingface_hub.snapshot_download(
        repo_id, allow_patterns=list(FILES), local_files_only=True
      )
    except Exception:
      reason = " ".join(str(online).split())
      reason = reason if len(reason) <= 200 else reason[:200].rsplit(" ", 1)[0] + " ..."
      raise errors.ConfigError(
        f"config.{field}: {repo_id!r} is not a preset or a local directory, and as a "
        f"Hugging Face repo id it could not be downloaded ({reason}) nor found in the "
        f"cache {constants.HF_HUB_CACHE}",
        "check the id, log in for a gated model, or give a local directory",
      ) from None
