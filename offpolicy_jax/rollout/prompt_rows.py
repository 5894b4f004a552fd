"""A step's prompt rows: the static batch shape, and prompt batches across processes.

Multi-host data path: every process reads the same global prompt stream and
keeps its own block of rows of each batch (`prompts_per_step / process_count`
prompts, process `p` taking rows `[p * G_local, (p + 1) * G_local)`:
`ProcessRows`), and `assemble_global` builds global arrays from the blocks
with `jax.make_array_from_process_local_data`, rows split over the mesh's
`(data, fsdp)` axes. So the global batch, and with it every number of the
run, does not depend on the number of processes, and the iterator state is
the same on every process. With one process the global batch is the local
one; `local_rows` reads a global array's rows back on the process that owns
them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from offpolicy_jax.rewards import tasks
from offpolicy_jax.rollout import data
from offpolicy_jax.rollout.protocol import Finished
from offpolicy_jax.scale import sharding

# Prompt fields that become global device arrays (the rest stay host-side).
DEVICE_FIELDS = ("prompt_tokens", "prompt_lengths", "answer_tokens")


class Sizes(NamedTuple):
  """Static batch shape: G prompts of K responses, P prompt and N response tokens.

  `token_advantages`: advantages are per token, [B, N] (turn-level credit of
  multi-turn trajectories), not per row; `token_rewards`: batches keep each
  turn's reward on its last token for a critic (`TrainBatch.token_rewards`).
  `routing`: (L blocks, k experts per token, E experts) when batches carry the
  sampler's routing (routing replay, `models.moe`), else None.
  """

  prompts_per_step: int
  group_size: int
  max_prompt_len: int
  max_new_tokens: int
  token_advantages: bool = False
  token_rewards: bool = False
  routing: tuple[int, int, int] | None = None


def device_prompts(prompts: dict[str, Any]) -> dict[str, Any]:
  """The fields of a prompt batch that the jitted programs take (`DEVICE_FIELDS`)."""
  return {k: prompts[k] for k in DEVICE_FIELDS}


def device_finished(fin: Finished) -> Finished:
  """`fin` with only its prompts' device fields (what the jitted programs take)."""
  return fin._replace(prompts=device_prompts(fin.prompts))


def assemble_global(mesh, local: dict[str, Any], *, leading_axes: int = 0) -> dict[str, Any]:
  """Per-process prompt batches -> global arrays with rows over `(data, fsdp)`.

  Device fields (`DEVICE_FIELDS`) become global `jax.Array`s through
  `jax.make_array_from_process_local_data`; the host fields (`index`,
  `valid`, `truncated`) are gathered from every process in process order (the
  row order of the global arrays). A global batch that does not split over
  `data * fsdp` devices is replicated (one process only).

  Args:
    mesh: the run's mesh.
    local: this process's batch, dict of numpy arrays with G_local rows.
    leading_axes: unsharded axes before the row axis (1 for a stack of L
      batches [L, G_local, ...]: device fields only).

  Returns:
    dict with the same keys and G_local * process_count rows.
  """
  procs = jax.process_count()
  rows = local["prompt_tokens"].shape[leading_axes] * procs
  split = rows % sharding.axis_size(mesh, sharding.BATCH_AXES) == 0
  if not split and procs > 1:
    raise ValueError(
      f"config.prompts_per_step: {rows} prompts do not split over data*fsdp = "
      f"{sharding.axis_size(mesh, sharding.BATCH_AXES)} devices across {procs} processes"
    )
  out = {}
  for k, v in local.items():
    if k in DEVICE_FIELDS:
      lead = (None,) * leading_axes
      rest = (None,) * (v.ndim - 1 - leading_axes)
      spec = P(*lead, sharding.BATCH_AXES, *rest) if split else P()
      out[k] = jax.make_array_from_process_local_data(NamedSharding(mesh, spec), v)
    elif procs > 1 and isinstance(v, np.ndarray):
      out[k] = np.asarray(multihost_utils.process_allgather(v, tiled=True))
    else:
      out[k] = v
  return out


class ProcessRows:
  """This process's block of rows of every batch of a global prompt iterator.

  Process `index` of `count` keeps rows `[index * n, (index + 1) * n)`, `n =
  G / count`; the state is the global iterator's, the same on every process.
  """

  def __init__(self, it, index: int, count: int):
    self._it, self._index, self._count = it, index, count

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, Any]:
    batch = next(self._it)
    n = len(batch["index"]) // self._count
    lo = self._index * n
    return {k: v[lo : lo + n] for k, v in batch.items()}

  def get_state(self):
    return self._it.get_state()

  def set_state(self, state) -> None:
    self._it.set_state(state)


def prompt_iterator(
  task: tasks.Task,
  tokenizer,
  sizes: Sizes,
  seed: int,
  split: str = "train",
  batch_size: int | None = None,
  truncate: bool = False,
  candidates: int = 1,
):
  """The grain iterator over tokenized prompts (shuffled by `seed` for training).

  Training batches (no `batch_size`: `candidates * sizes.prompts_per_step`
  prompts, `candidates` read per prompt a step samples: `rollout.prompt_filter`)
  are this process's block of rows of the global batch; an explicit `batch_size`
  (evaluation, warm start) reads the whole split on every process.
  `truncate` cuts prompts longer than `sizes.max_prompt_len` (else an error).
  """
  rows = batch_size is None and jax.process_count() > 1
  it = data.prompt_iterator(
    task,
    tokenizer,
    batch_size=candidates * sizes.prompts_per_step if batch_size is None else batch_size,
    max_prompt_len=sizes.max_prompt_len,
    seed=seed,
    split=split,
    truncate=truncate,
  )
  return ProcessRows(it, jax.process_index(), jax.process_count()) if rows else it


def truncated(batch: dict[str, Any]) -> int:
  """How many valid prompts of a batch were cut to `max_prompt_len` (`prompts_truncated`)."""
  return int((batch["truncated"] & batch["valid"]).sum())


def local_rows(x: jax.Array) -> tuple[np.ndarray, int]:
  """(this process's block of rows of `x`, its first row).

  Process `p` of `n` owns rows `[p * R / n, (p + 1) * R / n)` (the prompts it
  read, `assemble_global`). When its devices hold exactly those rows they are
  read locally; otherwise the whole array is gathered and sliced.
  """
  rows = x.shape[0] // jax.process_count()
  lo = jax.process_index() * rows
  shards: dict[int, Any] = {}
  for shard in x.addressable_shards:
    start = shard.index[0].start or 0
    shards.setdefault(start, shard)
  blocks, at = [], lo
  while at < lo + rows and at in shards:
    block = np.asarray(shards[at].data)
    blocks.append(block)
    at += block.shape[0]
  if at == lo + rows:
    return np.concatenate(blocks), lo
  full = np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return full[lo : lo + rows], lo
