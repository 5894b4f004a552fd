"""Partial rollouts of multi-turn episodes: episodes in flight across loop steps.

With `rollout.partial_budget = b` and episodes (`multiturn.max_turns > 0`),
the sync loop no longer plays every episode to its end within its step. An
`EpisodePool` of S group slots (K trajectories each) is carried from step to
step; each step

  admit    the step's G prompt groups take free slots, and their environments
           are reset (in the sandboxed workers, as always);
  advance  every unfinished trajectory decodes at most b policy tokens under
           the step's behaviour parameters theta_v, turns and environment
           answers interleaved as in a whole episode
           (`MultiTurnSampler.advance`); a trajectory that has used its b
           tokens pauses, mid-turn if need be, and goes on at the next step;
  emit     groups whose K trajectories have all ended are packed (rewards,
           group-relative advantages, per-token versions) and buffered; the
           step trains from the buffer (FIFO), as single-turn partial
           rollouts do (`rollout.partial`).

Versions. Every policy token records the version v that drew it, and its
behaviour log-prob under theta_v given the whole trajectory so far: at the
start of each step the pool's caches are recomputed from the tokens under
theta_v (`MultiTurnSampler.reencode`), never continued from keys and values
of older parameters (the argument of `sampling.partial`). With
`rollout.score_old`, each token's pi_old is the learner's score under the
parameters of its own step.

Capacity. An unfinished trajectory decodes b tokens every step, so it ends
within L = ceil(N / b) steps (N = max_new_tokens); with S = L * G slots and G
admissions per step no prompt is ever turned away, and the replay buffer
holds at least L batches (`components.replay_capacity`), as for single-turn
partial rollouts.

Resume. The pool (tokens, log-probs, versions, the environments' JSON
states and rewards) is part of the checkpoint (`arrays` / `meta`,
`restore`); its caches are not, since every step recomputes them. A run
killed and resumed writes the uninterrupted run's rows.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax import types
from offpolicy_jax.rewards import tasks
from offpolicy_jax.rollout import data, episodes, prompt_rows, protocol
from offpolicy_jax.rollout.protocol import Finished, Rollout, pi_old
from offpolicy_jax.sampling import SampleOutput, multiturn, turn_pieces
from offpolicy_jax.sampling import partial as partial_rollouts

# Metrics of every step with a pool (the names of single-turn partial rollouts).
POOL_STATS = (
  "partial_emitted_groups",
  "partial_inflight_groups",
  "partial_mixed_rows",
  "partial_dropped_prompts",
)
# Row fields of the pool kept between steps ([R] or [R, N]; `turn_pieces.MultiTurnState`).
_ROW_FIELDS = ("pos", "turn_start", "turn", "ended", "eos", "tokens", "logprobs", "kept")
_MASK_FIELDS = ("policy", "observation", "turn_ids")


@dataclasses.dataclass(frozen=True, eq=False)
class EpisodePool(Rollout):
  """Episodes in flight across loop steps as a `protocol.Rollout` (module docstring; host).

  Its carried state is a `PoolState` (host arrays and the environments'
  states), checkpointed as the item `episode_pool`.

  Attributes:
    ep: the run's `Episodes`.
    task: the task (the prompts' source examples are the environments' input).
    sizes: the run's batch shape (G prompts, K trajectories, N tokens).
    budget: b, policy tokens per trajectory per loop step.
    prompt_fields: `{name: (shape without the group axis, dtype)}` of the
      prompts' device fields (`prompt_rows.DEVICE_FIELDS`).
    score_old: the learner's scorer of log pi_old, or None.
  """

  ep: episodes.Episodes
  task: tasks.Task
  sizes: prompt_rows.Sizes
  budget: int
  prompt_fields: dict[str, tuple[tuple[int, ...], Any]]
  score_old: Callable | None = None
  traced = False
  prefetch = False
  item = "episode_pool"

  @property
  def slots(self) -> int:
    """S = ceil(N / b) * G group slots (no prompt is ever turned away)."""
    n, g = self.sizes.max_new_tokens, self.sizes.prompts_per_step
    return partial_rollouts.steps_to_finish(n, self.budget) * g

  def signature(self) -> dict[str, Any]:
    """What a checkpoint's pool must match to be resumed (`step.run_state.state_meta`)."""
    return {"item": self.item, "slots": self.slots, "budget": self.budget}

  def with_sampler(self, sampler) -> Rollout:
    raise protocol.own_sampler("the episode pool (rollout.episode_pool)")

  def init(self) -> PoolState:
    return PoolState(self)

  def advance(self, rstate: PoolState, params, version, prompts, step, key, latest=None):
    del latest
    fin, stats = rstate.step(params, prompts, step, key, int(version))
    return rstate, fin, stats

  def arrays(self, rstate: PoolState) -> dict[str, np.ndarray]:
    return rstate.arrays()

  def meta(self, rstate: PoolState) -> dict[str, Any]:
    return rstate.meta()

  def restore(self, rstate: PoolState, arrays, meta: dict[str, Any]) -> PoolState:
    rstate.restore(arrays, meta)
    return rstate


class PoolState:
  """The in-flight episodes of a run with partial rollouts (host arrays; module docstring)."""

  def __init__(self, pool: EpisodePool):
    ep = pool.ep
    self.pool, self.ep, self.budget = pool, ep, int(pool.budget)
    self.sampler = ep.make_sampler(pool.sizes.group_size, False)
    k, n = pool.sizes.group_size, pool.sizes.max_new_tokens
    self.slots = pool.slots
    r = self.slots * k
    self.k = k
    self.prompts = {
      name: np.zeros((self.slots, *shape), dtype)
      for name, (shape, dtype) in pool.prompt_fields.items()
    }
    self.prompts["prompt_lengths"][:] = 1  # free slots hold a one-token prompt (finite scores)
    self.index = np.zeros(self.slots, np.int64)
    self.occupied = np.zeros(self.slots, bool)
    self.admitted = np.zeros(self.slots, np.int64)  # the loop step each group came in
    self.rows = {
      name: np.zeros((r, n) if name in ("tokens", "logprobs", "kept") else (r,), _dtype(name))
      for name in _ROW_FIELDS
    }
    self.rows.update({name: np.zeros((r, n), _dtype(name)) for name in _MASK_FIELDS})
    self.versions = np.zeros((r, n), np.int32)
    self.old = np.zeros((r, n), np.float32)
    self.rec = multiturn.Rows.fresh(np.full(r, n, np.int32))
    self.rec.done[:] = True  # free rows never decode
    self.turns = episodes.Turns(ep, r, self.sampler.max_turns)

  def step(self, params, prompts: dict[str, Any], step: int, key, version: int):
    """Admits `prompts` (the step's G groups), advances the pool, finishes ended groups.

    Args:
      params: the behaviour parameters (the whole model state) of this step.
      prompts: the step's prompts (`prompt_rows.DEVICE_FIELDS` and `index`).
      step: the loop step (the groups' admission step).
      key: the step's sampling key.
      version: the behaviour parameters' version (optimizer steps).

    Returns:
      `(finished, stats)`: the S slots' rows (`valid`: the groups whose K
      trajectories have ended; `order`: oldest admission first), and host
      statistics.
    """
    t0 = time.perf_counter()
    self.turns.clear()
    self._admit(prompts, step)
    st = self.sampler.reencode(params, self._state())
    before = self.rows["pos"].copy()
    k, r = self.k, self.slots * self.k
    ids_b = jnp.asarray(np.repeat(np.arange(self.slots), k), jnp.int32)
    samples_b = jnp.asarray(np.tile(np.arange(k), self.slots), jnp.int32)
    st = self.sampler.advance(
      params, st, key, ids_b, samples_b, self.turns, self.rec, budget=self.budget
    )
    got = jax.device_get({name: getattr(st, name) for name in (*_ROW_FIELDS, *_MASK_FIELDS)})
    self.rows = {name: np.array(x) for name, x in got.items()}
    slot = np.arange(self.versions.shape[1])[None, :]
    new = (slot >= before[:, None]) & (slot < self.rows["pos"][:, None])
    self.versions[new] = int(version)
    out = self._output()
    device = {name: jnp.asarray(x) for name, x in self.prompts.items()}
    if self.pool.score_old is not None:
      scored = pi_old(
        self.pool.score_old,
        [(params, int(version))],
        device,
        out,
        jnp.asarray(np.where(new, version, -1)),
        jnp.asarray(self.old),
      )
      self.old = np.array(jax.device_get(scored), np.float32)  # a writable copy
      out = out._replace(old_logprobs=jnp.asarray(self.old))
    emitted = self.occupied & self.rec.done.reshape(self.slots, k).all(axis=1)
    rows = np.flatnonzero(np.repeat(emitted, k))
    turns = self.rows["turn"][rows]
    rewards_r, turn_rewards_r = episodes.trajectory_rewards(
      self.turns, np.arange(r), self.rows["turn"]
    )
    rewards = turn_rewards_r if self.ep.credit == "turn" else rewards_r
    # Oldest admission first, so the buffer's FIFO trains groups in the order they came;
    # advantages over the emitted groups only (batch-level estimators see no group in flight).
    order = np.lexsort((np.arange(self.slots), self.admitted))
    fin = Finished(
      device,
      out,
      jnp.asarray(self.versions),
      rewards=jnp.asarray(rewards),
      valid=jnp.asarray(emitted),
      order=jnp.asarray(order, jnp.int32),
    )
    stats = episodes.episode_stats(self.ep, self.turns, rows, turns, time.perf_counter() - t0)
    # Per emitted trajectory, over its whole life (the counters above are this step's calls).
    b = max(len(rows), 1)
    stats["episode/observation_tokens"] = float(self.rows["observation"][rows].sum() / b)
    stats["episode/observations_cut"] = int(self.rec.cut[rows].sum())
    mixed = [len(np.unique(self.versions[i][self.rows["policy"][i]])) > 1 for i in rows]
    self.occupied &= ~emitted
    self.rows["pos"][rows] = 0  # free rows: nothing for the next steps' re-encoding to span
    stats |= {
      "partial_emitted_groups": int(emitted.sum()),
      "partial_inflight_groups": int(self.occupied.sum()),
      "partial_mixed_rows": int(sum(mixed)),
      "partial_dropped_prompts": 0,
    }
    return fin, stats

  def _admit(self, prompts: dict[str, Any], step: int) -> None:
    """The step's groups take the lowest free slots; their rows and environments start."""
    g, k = len(np.asarray(prompts["index"])), self.k
    free = np.flatnonzero(~self.occupied)
    if len(free) < g:  # impossible by the capacity argument (module docstring)
      raise RuntimeError(f"episode pool: {g} groups to admit, {len(free)} free slots")
    slots = free[:g]
    for name in self.prompts:
      self.prompts[name][slots] = np.asarray(prompts[name])
    self.index[slots] = np.asarray(prompts["index"])
    self.occupied[slots] = True
    self.admitted[slots] = step
    rows = (slots[:, None] * k + np.arange(k)[None, :]).reshape(-1)
    for x in (*self.rows.values(), self.versions, self.old):
      x[rows] = 0
    self.rec.done[rows] = False
    self.rec.reason[rows] = multiturn.END_TURNS
    self.rec.cut[rows] = False
    examples = data.examples(self.pool.task, "train", np.repeat(self.index[slots], k).tolist())
    self.turns.reset(rows, examples)  # a failed reset ends its row after one turn, as in `play`

  def _state(self) -> turn_pieces.MultiTurnState:
    """The pool as a sampler state without caches (`reencode` computes them)."""
    p = self.prompts["prompt_tokens"].shape[1]
    rows = {name: jnp.asarray(x) for name, x in self.rows.items()}
    return turn_pieces.MultiTurnState(
      prompt_tokens=jnp.asarray(self.prompts["prompt_tokens"]),
      prompt_mask=types.prompt_mask(jnp.asarray(self.prompts["prompt_lengths"]), p),
      # No caches or logits: `reencode` computes them from the tokens (module docstring).
      prefix=None,  # type: ignore[arg-type]
      suffix=None,  # type: ignore[arg-type]
      logits=None,  # type: ignore[arg-type]
      limit=jnp.asarray(self.rec.limit),
      done=jnp.asarray(self.rec.done),
      **rows,
    )

  def _output(self) -> SampleOutput:
    policy = self.rows["policy"]
    return SampleOutput(
      tokens=jnp.asarray(self.rows["tokens"]),
      logprobs=jnp.asarray(np.where(policy, self.rows["logprobs"], 0.0).astype(np.float32)),
      mask=jnp.asarray(policy.astype(np.float32)),
      lengths=jnp.asarray(self.rows["pos"]),
      kept=jnp.asarray(np.where(policy, self.rows["kept"], 0).astype(np.int32)),
    )

  # Checkpointing: arrays (an item of the checkpoint) and JSON meta.

  def arrays(self) -> dict[str, np.ndarray]:
    """The pool's arrays by name (a checkpoint item; `restore` takes them back)."""
    t = self.turns
    return {
      **{f"prompt_{name}": x for name, x in self.prompts.items()},
      **{f"row_{name}": x for name, x in self.rows.items()},
      "index": self.index,
      "occupied": self.occupied,
      "admitted": self.admitted,
      "versions": self.versions,
      "old": self.old,
      "done": self.rec.done,
      "reason": self.rec.reason,
      "cut": self.rec.cut,
      "rewards": t.rewards,
      "turn_rewards": t.turn_rewards,
      "failures": t.failures,
      "tool_calls": t.tool_calls,
      "dead": t.dead,
    }

  def meta(self) -> dict[str, Any]:
    """The pool's shape and the environments' states (JSON values) of its rows."""
    return {"slots": self.slots, "budget": self.budget, "env_states": list(self.turns.states)}

  def restore(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
    """Takes back the pool of a checkpoint (`arrays`, `meta`)."""
    mine = self.arrays()
    if set(arrays) != set(mine):
      raise ValueError(f"episode pool checkpoint: fields {sorted(arrays)}, expected {sorted(mine)}")
    for name, x in arrays.items():
      x = np.asarray(x)
      if x.shape != mine[name].shape:
        raise ValueError(
          f"episode pool checkpoint: {name} has shape {x.shape}, this run's pool "
          f"{mine[name].shape} (rollout.partial_budget or the batch shape changed)"
        )
      mine[name][...] = x
    states = meta.get("env_states")
    if not isinstance(states, list) or len(states) != len(self.turns.states):
      raise ValueError("episode pool checkpoint: env_states missing or of the wrong length")
    self.turns.states = list(states)


def _dtype(name: str):
  if name in ("ended", "eos", "policy", "observation"):
    return bool
  return np.float32 if name == "logprobs" else np.int32
