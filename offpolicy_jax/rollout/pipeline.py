"""The pieces of the one pipeline from prompts to a scored, packed `TrainBatch`.

  prompts (`prompt_iterator`, `assemble_global`)
    -> the run's rollout (`protocol.Rollout.advance`, with the parameters the step chose)
    -> `score` (`score_on_device`, or `score_on_host` in the sandboxed workers)
    -> `pack` (advantages, per-token versions, group order: a `types.TrainBatch`)

Every rollout kind and every path of a run goes through these functions: the
jitted RL step (`rl_step`), the host step (`host_step`: host rewards, host
rollouts, a disaggregated sampler), the async producer and the study, in
the two halves of a step (`acting`, `learning`). `pack`
is the one packer: partial rollouts and the episode pool pass the groups
that finished (`valid`) and their buffer order (`order`).

Multi-host data path: every process reads the same global prompt stream and
keeps its own block of rows of each batch (`prompts_per_step / process_count`
prompts, process `p` taking rows `[p * G_local, (p + 1) * G_local)`), and
`assemble_global` builds global arrays from the blocks with
`jax.make_array_from_process_local_data`, rows split over the mesh's
`(data, fsdp)` axes. So the global batch, and with it every number of the run,
does not depend on the number of processes, and the iterator state is the
same on every process. With one process the global batch is the local one.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from offpolicy_jax import advantages, types
from offpolicy_jax.rewards import scoring as rewards
from offpolicy_jax.rollout import data
from offpolicy_jax.rollout.protocol import Finished
from offpolicy_jax.rollout.run_state import Packing, StepFns
from offpolicy_jax.scale import sharding
from offpolicy_jax.types import TrainBatch

# Streams of per-step randomness: step_key(seed, t, stream).
SAMPLE, ADV, REPLAY, TRAIN, EVAL, INIT = range(6)
# Prompt fields that become global device arrays (the rest stay host-side).
DEVICE_FIELDS = ("prompt_tokens", "prompt_lengths", "answer_tokens")
# Host reward statistics of a batch (every metrics row carries them; zero for device rewards).
REWARD_STATS = ("reward_failures", "reward_timeouts", "reward_worker_restarts", "reward_time_s")


def device_prompts(prompts: dict[str, Any]) -> dict[str, Any]:
  """The fields of a prompt batch that the jitted programs take (`DEVICE_FIELDS`)."""
  return {k: prompts[k] for k in DEVICE_FIELDS}


def device_finished(fin: Finished) -> Finished:
  """`fin` with only its prompts' device fields (what the jitted programs take)."""
  return fin._replace(prompts=device_prompts(fin.prompts))


def no_reward_stats() -> dict[str, Any]:
  return dict.fromkeys(REWARD_STATS[:3], 0) | {"reward_time_s": 0.0}


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


def prompt_iterator(fns: StepFns, seed: int, split: str = "train", batch_size: int | None = None):
  """The grain iterator over tokenized prompts (shuffled by `seed` for training).

  Training batches are this process's block of rows of the global batch; an
  explicit `batch_size` (evaluation, warm start) reads the whole split on every
  process.
  """
  rows = batch_size is None and jax.process_count() > 1
  it = data.prompt_iterator(
    fns.task,
    fns.model.tokenizer,
    batch_size=fns.sizes.prompts_per_step if batch_size is None else batch_size,
    max_prompt_len=fns.sizes.max_prompt_len,
    seed=seed,
    split=split,
    truncate=fns.truncate_prompts,
  )
  return ProcessRows(it, jax.process_index(), jax.process_count()) if rows else it


def _local_rows(x: jax.Array) -> tuple[np.ndarray, int]:
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


def _gather_stats(stats: dict[str, Any]) -> dict[str, Any]:
  """Reward statistics summed over processes (time: the slowest), with each process's time."""
  local = np.array([stats[k] for k in REWARD_STATS], np.float64)
  every = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, len(REWARD_STATS))
  out: dict[str, Any] = {k: int(every[:, i].sum()) for i, k in enumerate(REWARD_STATS[:3])}
  out["reward_time_s"] = float(every[:, 3].max())
  out |= {f"reward_time_s/process{p}": float(t) for p, t in enumerate(every[:, 3])}
  return out


def score_on_host(fns: StepFns, prompts: dict, rollout, *, split: str, group_size: int):
  """Host rewards [B] (a device array) and their statistics (`REWARD_STATS` keys).

  Each process scores the rows of its own prompts in its verifier workers; the
  scores become one global array with rows over `(data, fsdp)` like the
  prompts, and the statistics are summed over processes (`reward_time_s` is
  the slowest process's, `reward_time_s/process<i>` each one's).
  """
  reward, procs = fns.reward, jax.process_count()
  tokens, lo = _local_rows(rollout.tokens) if procs > 1 else (np.asarray(rollout.tokens), 0)
  lengths = _local_rows(rollout.lengths)[0] if procs > 1 else np.asarray(rollout.lengths)
  index = np.asarray(prompts["index"])[lo // group_size : (lo + len(tokens)) // group_size]
  examples = data.examples(fns.task, split, index.tolist())
  examples = [ex for ex in examples for _ in range(group_size)]
  texts = [fns.model.tokenizer.decode(t[:n]) for t, n in zip(tokens, lengths, strict=True)]
  assert reward.host is not None, "score_on_host needs a host reward"
  res = rewards.score_batch(
    reward.host,
    examples,
    texts,
    timeout_s=reward.timeout_s,
    pool=reward.pool,
    batch_timeout_s=reward.batch_timeout_s,
  )
  stats = {
    "reward_failures": int(res.failed.sum()),
    "reward_timeouts": int(res.timed_out.sum()) if res.timed_out is not None else 0,
    "reward_worker_restarts": res.restarts,
    "reward_time_s": res.seconds,
  }
  if procs == 1:
    return jnp.asarray(res.scores), stats
  scores, rows = np.asarray(res.scores, np.float32), rollout.tokens.sharding
  if isinstance(rows, NamedSharding) and rows.spec and rows.spec[0] is not None:
    out = jax.make_array_from_process_local_data(
      NamedSharding(rows.mesh, P(rows.spec[0])), scores, (rollout.tokens.shape[0],)
    )
  else:  # rows not split over processes: every process passes all scores
    out = np.asarray(multihost_utils.process_allgather(scores, tiled=True))
  return out, _gather_stats(stats)


def step_key(seed, step, stream: int) -> jax.Array:
  """The PRNG key of `stream` at loop step `step`: a pure function of (seed, step); traceable."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), stream)


def decode_waste(mask_bn) -> jax.Array:
  """The static batch's decode waste on these responses: row-steps decoded after a row ended.

  The static sampler decodes all B rows until the longest ends, B * max_b L_b
  row-steps for sum_b L_b tokens; the waste is 1 - sum_b L_b / (B * max_b L_b)
  (0 when every response has the same length). Computed from the lengths, so
  it is the same whichever sampler produced them.
  """
  lengths = jnp.sum(jnp.asarray(mask_bn, jnp.float32), axis=1)
  longest = jnp.maximum(jnp.max(lengths), 1.0)
  return 1.0 - jnp.sum(lengths) / (lengths.shape[0] * longest)


def score_on_device(
  fns: StepFns, prompts: dict, rollout, group_size: int | None = None
) -> jax.Array:
  """Rewards [B] of a device-reward task (traceable): each response against its prompt's answer."""
  k = group_size or fns.sizes.group_size
  answers = jnp.repeat(jnp.asarray(prompts["answer_tokens"]), k, axis=0)
  assert fns.reward.device is not None, "score_on_device needs a device reward"
  return fns.reward.device(answers, rollout.tokens, rollout.mask)


def score(
  fns: StepFns, prompts: dict, rollout, *, split: str = "train", group_size: int | None = None
):
  """Rewards [B] and the host reward statistics, on device or in the verifier workers."""
  k = group_size or fns.sizes.group_size
  if fns.reward.device is not None:
    return score_on_device(fns, prompts, rollout, k), no_reward_stats()
  return score_on_host(fns, prompts, rollout, split=split, group_size=k)


def rewards_of(fns: StepFns, fin: Finished):
  """The rewards of finished groups and the host reward statistics: the rollout's own (an
  environment's, with zero statistics), or scored (`score`)."""
  if fin.rewards is not None:
    return fin.rewards, no_reward_stats()
  return score(fns, fin.prompts, fin.out)


def pack(
  packing: Packing, prompts: dict, rollout, rewards_b, version, key, valid=None, order=None
) -> TrainBatch:
  """Packs scored rows into a `TrainBatch` (traceable): the one packer of every rollout.

  Args:
    packing: group size, advantage estimator and turn discount (`StepFns.packing`).
    prompts: dict with `prompt_tokens` [G, P] and `prompt_lengths` [G].
    rollout: the sampler's output for the G * K rows.
    rewards_b: float32 [B]; a non-finite reward makes the loss non-finite and
      the train step skips that update (failing host rewards score 0). Or
      float32 [B, T], the rewards after each turn of multi-turn trajectories
      (`multiturn.credit = "turn"`): token advantages are then per turn
      (`advantages.per_turn`, turns = runs of policy tokens, `types.turn_ids`)
      and the batch's reward is their sum.
    version: the behaviour parameters' version, in optimizer steps (`fns.learner.version`),
      or int [B, N] per token (episodes whose turns were drawn by different versions).
    key: PRNG key of stochastic advantage estimators.
    valid: optional bool [G], the groups the advantages are computed over (the
      others get 0 and no say in batch-level estimators): the finished groups
      of a partial-rollout pool. Default: all.
    order: optional int [G], the order of the groups in the batch (a FIFO
      replay buffer trains them in that order): groups are permuted before
      anything else, so advantages and keys see them in that order. Default:
      as they are.
  """
  # G groups: the step's prompts, or the slots of a partial-rollout pool.
  g, k = jnp.shape(prompts["prompt_tokens"])[0], packing.group_size
  rewards_b = jnp.asarray(rewards_b, jnp.float32)
  if order is not None:
    rows = (jnp.asarray(order)[:, None] * k + jnp.arange(k)[None, :]).reshape(-1)
    prompts = {name: jnp.asarray(x)[order] for name, x in prompts.items() if name in DEVICE_FIELDS}
    rollout = jax.tree.map(lambda x: x[rows], rollout)
    rewards_b = rewards_b[rows]
    version = jnp.asarray(version)
    version = version[rows] if version.ndim else version
    valid = None if valid is None else jnp.asarray(valid)[order]
  rows_valid = None if valid is None else jnp.repeat(jnp.asarray(valid, bool), k)
  if rewards_b.ndim == 2:
    if rows_valid is not None:  # NaN: turns not taken (`advantages.per_turn`)
      rewards_b = jnp.where(rows_valid[:, None], rewards_b, jnp.nan)
    adv_bt = advantages.per_turn(
      packing.advantage, rewards_b.reshape(g, k, -1), key, gamma=packing.gamma
    ).reshape(g * k, -1)
    turn = jnp.minimum(types.turn_ids(rollout.mask), adv_bt.shape[1] - 1)
    adv = jnp.take_along_axis(adv_bt, turn, axis=1) * (rollout.mask > 0)
    rewards_b = jnp.nansum(rewards_b, axis=1)
  else:
    valid_gk = None if rows_valid is None else rows_valid.reshape(g, k)
    adv = advantages.compute(packing.advantage, rewards_b.reshape(g, k), key=key, valid=valid_gk)
    adv = adv.reshape(g * k)
  versions = jnp.broadcast_to(jnp.asarray(version, jnp.int32), rollout.tokens.shape)
  return types.pack_groups(
    prompts["prompt_tokens"],
    prompts["prompt_lengths"],
    rollout.tokens,
    rollout.mask,
    rollout.logprobs,
    versions,
    rewards_b,
    adv,
    rollout.kept,
    rollout.old_logprobs,
  )


# `pack` jitted, for callers on the host (`learning.pack_finished` outside a jitted step).
pack_jit = jax.jit(pack, static_argnums=0)
