"""The `Rollout` protocol: every way of sampling a step's rows is one implementation.

A rollout is an `(init, advance)` pair over a carried state (optax's
`GradientTransformation`, an `(init, update)` pair):

  rstate                  = rollout.init()
  rstate, finished, info  = rollout.advance(rstate, params, version, prompts, step, key)

`advance` takes the step's G prompt groups and the behaviour parameters
theta_v (the whole model state, version v in optimizer steps), samples, and
hands back the groups it finished as a `Finished` record: tokens, masks,
behaviour log-probs, per-token versions, kept-set sizes, log pi_old when the
run scores it, rewards when the rollout earned them itself (episodes), and
which groups are valid and in which order they go to the replay buffer.
Everything after it is the same for every kind: score (`scoring.score`),
pack (`packing.pack`, the one packer) and learn (`learning.learn`).

Kinds (chosen and built once, in `run.components_rollout.rollout_kind`), each
declared against the protocol (a subclass of `Rollout`, so the type checker
checks it; `tests/test_rollout_kinds.py` checks that each implements every
member and keeps `advance`'s signature):

  `whole.Whole`                 static or continuous batching: every response to its end
  `partial.Partial`             APRIL partial rollouts: groups in flight across steps (device)
  `episodes.WholeEpisodes`      multi-turn episodes played to their end (host)
  `episode_pool.EpisodePool`    episodes in flight across steps, paused mid-turn (host)
  `sampler_mesh.OnSamplerMesh`  any of the above placed on a disaggregated sampler mesh

A kind whose `advance` is traceable (`traced`) runs inside the jitted step
(`rl_step.rl_step`, scanned by `rl_steps`, vmapped over seeds by the study);
the others run on the host between jitted programs (`host_step`). A kind
with carried state names its checkpoint item (`item`); its state is saved and
restored by that name through `arrays` / `meta` / `restore`.

`pi_old` is the one scorer of log pi_old: each token is scored by the
learner at the parameters of its own version.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax.sampling import SampleOutput, Sampler


class Finished(NamedTuple):
  """The groups a rollout hands to the step (G' groups of K rows, rows group-major).

  Attributes:
    prompts: dict of [G', ...] prompt fields (`prompt_tokens` [G', P] left-padded,
      `prompt_lengths` [G'], `answer_tokens`; host kinds add `index`).
    out: the rows, a `SampleOutput` [G' K, N]: tokens, behaviour log-probs,
      mask (policy tokens), lengths, kept-set sizes, log pi_old (or None).
    versions: int32, the parameter version that drew each token: a scalar
      (every token of the step) or [G' K, N].
    rewards: float32 [G' K] or [G' K, turns] when the rollout earned them
      itself (the environment of an episode); None: the step scores the rows.
    valid: bool [G'], the groups finished and to be learnt from (None: all).
    order: int32 [G'], the order the groups enter the replay buffer in
      (None: as they are).
  """

  prompts: dict[str, Any]
  out: SampleOutput
  versions: Any
  rewards: Any = None
  valid: Any = None
  order: Any = None


class EvalRows(NamedTuple):
  """One seed's evaluated rows [G * k]: rewards, policy tokens, failed rewards.

  Episodes add the turns each took and its tool calls (None for single-turn rows).
  """

  rewards: np.ndarray
  lengths: np.ndarray
  failures: int
  turns: np.ndarray | None = None
  tool_calls: np.ndarray | None = None


class Rollout(Protocol):
  """How a run samples: `init` and `advance` over a carried state (module docstring).

  Attributes:
    traced: `advance` is a pure traceable function (it runs inside the jitted step).
    prefetch: the next step's `advance` may be dispatched before this step has
      learnt (no carried state, nothing on the host).
    item: the checkpoint item of the carried state ("": nothing carried).
  """

  @property
  def traced(self) -> bool: ...

  @property
  def prefetch(self) -> bool: ...

  @property
  def item(self) -> str: ...

  def init(self) -> Any:
    """The empty carried state (None for a kind that carries nothing)."""
    ...

  def advance(
    self, rstate, params, version, prompts: dict[str, Any], step, key: jax.Array, latest=None
  ) -> tuple[Any, Finished, dict[str, Any]]:
    """Samples step `step`'s prompts (and the groups in flight) under `params` at `version`.

    Args:
      rstate: the carried state (`init`, or the previous step's).
      params: the behaviour parameters (the whole model state).
      version: their version in optimizer steps (int, or a traced int32 scalar).
      prompts: the step's G prompt groups (device fields; host kinds also `index`).
      step: the loop step.
      key: the step's sampling key.
      latest: `() -> (params, version)`, the newest published parameters
        (async mode); a kind that can continue under newer parameters asks it.

    Returns:
      `(rstate, finished, info)`: the carried state, the groups to pack and
      learn from, and the rollout's metrics.
    """
    ...

  def signature(self) -> dict[str, Any] | None:
    """What a checkpoint's carried state must match to be resumed (None: its arrays' shapes)."""
    ...

  def with_sampler(self, sampler: Sampler) -> Rollout:
    """This rollout sampling with `sampler` (the sampler choice's switch to continuous
    batching, `step.sampler_choice`); a kind with samplers of its own raises ValueError."""
    ...

  def arrays(self, rstate) -> Any:
    """The carried state's arrays (the checkpoint item `item`)."""
    ...

  def meta(self, rstate) -> dict[str, Any]:
    """The carried state's JSON part (checkpoint meta under `item`)."""
    ...

  def restore(self, rstate, arrays, meta: dict[str, Any]) -> Any:
    """The carried state of a checkpoint (`arrays`, `meta`); `rstate` is this run's template."""
    ...


def own_sampler(kind: str) -> ValueError:
  """`with_sampler`'s error for a kind that decodes with samplers of its own."""
  return ValueError(f"{kind}: decodes with samplers of its own, no switch to continuous batching")


class Stateless:
  """The carried-state half of the protocol for a kind that carries nothing."""

  item = ""

  def init(self) -> None:
    return None

  def signature(self) -> None:
    return None

  def arrays(self, rstate) -> None:
    del rstate
    return None

  def meta(self, rstate) -> dict[str, Any]:
    del rstate
    return {}

  def restore(self, rstate, arrays, meta: dict[str, Any]) -> None:
    del rstate, arrays, meta
    return None


def pi_old(
  score: Callable,
  scored: Sequence[tuple[Any, Any]],
  prompts: dict[str, Any],
  out: SampleOutput,
  versions,
  previous=None,
) -> jax.Array:
  """log pi_old [B, N]: every token scored by the learner at its own version's parameters.

    pi_old_t = score_{theta_v(t)}(y_t | x, y_<t),   v(t) = the version that drew y_t

  Args:
    score: the learner's scorer (`learn.scorer.make_scorer`):
      `(params, prompt_tokens, prompt_lengths, out) -> [B, N]`.
    scored: `(params, version)` pairs, the versions whose tokens to score now.
    prompts: `prompt_tokens` [B / K, P] and `prompt_lengths` [B / K].
    out: the rows.
    versions: int32 version of each token, a scalar or [B, N].
    previous: [B, N] scores kept from earlier steps (tokens of versions not in
      `scored` keep them), or None.

  Returns:
    float32 [B, N]; tokens of no scored version keep `previous` (0 without it).
  """
  old = previous
  tokens, lengths = prompts["prompt_tokens"], prompts["prompt_lengths"]
  for params, version in scored:
    s = score(params, tokens, lengths, out._replace(old_logprobs=None))
    if old is None and len(scored) == 1:
      return s
    own = (jnp.asarray(versions) == version) & (out.mask > 0)
    old = jnp.where(own, s, jnp.zeros_like(s) if old is None else old)
  return old


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
