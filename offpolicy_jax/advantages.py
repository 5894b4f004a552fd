"""Group-relative advantage estimators over a `[G, K]` reward array.

Every estimator is a pure, jittable function of the rewards of `G` prompts with
`K` responses each (row order: group-major, see `types.py`). `compute` is the
single entry point:

  adv_gk = advantages.compute("grpo", rewards_gk)                 # [G, K]
  adv_gk = advantages.compute("red_drop", rewards_gk, key=key)    # needs a key
  adv_gk = advantages.compute("opmd", rewards_gk, tau=0.5)        # override
  adv_gk = advantages.compute("rloo", rewards_gk, valid=valid_gk) # ragged groups

`name` and the overrides are Python values (static under `jax.jit`); `rewards`,
`key` and `valid` may be traced.

Ragged groups. `valid` ([G, K] bool, default all True) marks the responses that
exist (e.g. after discarding stale samples); group statistics run over the valid
entries only (`K` becomes the per-group count `n`) and invalid entries get 0.

Degenerate groups. A group whose valid rewards are all equal, or with at most
one valid response, carries no relative signal: every estimator returns exactly
`0` for it, never NaN, with one documented exception: `asymre`, whose point is
the constant shift `-baseline_shift` (a pull towards the behaviour policy),
returns that shift for valid entries.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

# name -> default overrides. An override not listed here is an error.
_DEFAULTS: dict[str, dict[str, Any]] = {
  "group_mean": {},
  "grpo": {"eps": 1e-6, "ddof": 1},
  "rloo": {},
  "asymre": {"baseline_shift": -0.1},
  "red_drop": {},
  "median": {"normalize": False, "eps": 1e-6},
  "opmd": {"tau": 1.0},
  "pass_at_k": {},
  "batch_whiten": {"eps": 1e-6},
  "remax": {},
}
# Estimators whose group's first response is a greedy baseline, not a sample to train on:
# the sampler decodes it greedily (`sampling.make_sampler(greedy_first=True)`) and the
# batch gives it no weight (`step.packing`).
GREEDY_FIRST = ("remax",)


def names() -> list[str]:
  """Returns the names accepted by `compute`."""
  return list(_DEFAULTS)


class _Group(NamedTuple):
  """Masked per-group statistics, all [G, 1] except `valid` [G, K]."""

  valid: jax.Array
  n: jax.Array  # number of valid responses (float)
  mean: jax.Array
  max: jax.Array
  degenerate: jax.Array  # bool: n <= 1 or all valid rewards equal


def _group(r_gk: jax.Array, valid: jax.Array) -> _Group:
  w = valid.astype(r_gk.dtype)
  n = jnp.sum(w, axis=1, keepdims=True)
  mean = jnp.sum(r_gk * w, axis=1, keepdims=True) / jnp.maximum(n, 1.0)
  hi = jnp.max(jnp.where(valid, r_gk, -jnp.inf), axis=1, keepdims=True)
  lo = jnp.min(jnp.where(valid, r_gk, jnp.inf), axis=1, keepdims=True)
  return _Group(valid, n, mean, hi, (n <= 1) | (hi == lo))


def _finish(adv_gk: jax.Array, g: _Group) -> jax.Array:
  """Zeroes invalid entries and degenerate groups."""
  return jnp.where(g.valid & ~g.degenerate, adv_gk, 0.0)


def group_mean(r_gk: jax.Array, g: _Group) -> jax.Array:
  """Group-mean baseline: `A_i = r_i - mean_j r_j`.

  Used by REC / REINFORCE presets and Dr. GRPO ("Understanding R1-Zero-Like
  Training: A Critical Perspective", arXiv:2503.20783).
  """
  return _finish(r_gk - g.mean, g)


def grpo(r_gk: jax.Array, g: _Group, *, eps: float, ddof: int) -> jax.Array:
  """GRPO: `A_i = (r_i - mean r) / (std r + eps)`.

  DeepSeekMath (arXiv:2402.03300). `std` uses `ddof=1` (unbiased, as
  `torch.std` in the reference implementations) by default.
  """
  centred = jnp.where(g.valid, r_gk - g.mean, 0.0)
  var = jnp.sum(centred**2, axis=1, keepdims=True) / jnp.maximum(g.n - ddof, 1.0)
  return _finish(centred / (jnp.sqrt(var) + eps), g)


def rloo(r_gk: jax.Array, g: _Group) -> jax.Array:
  """RLOO: `A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean r)`.

  "Buy 4 REINFORCE Samples, Get a Baseline for Free!" (Kool et al., 2019);
  Ahmadian et al., arXiv:2402.14740. `n <= 1` gives 0.
  """
  scale = g.n / jnp.maximum(g.n - 1.0, 1.0)
  return _finish(scale * (r_gk - g.mean), g)


def asymre(r_gk: jax.Array, g: _Group, *, baseline_shift: float) -> jax.Array:
  """AsymRE: `A_i = r_i - (mean r + baseline_shift)`.

  "Asymmetric REINFORCE for off-Policy Reinforcement Learning" (Arnal et al.,
  arXiv:2506.20520): a baseline below the value (`baseline_shift < 0`, default
  -0.1) keeps off-policy REINFORCE stable. Degenerate groups get
  `-baseline_shift` (not 0): that constant is the intended pull towards the
  behaviour policy.
  """
  return jnp.where(g.valid, r_gk - (g.mean + baseline_shift), 0.0)


def red_drop(r_gk: jax.Array, g: _Group, *, key: jax.Array) -> jax.Array:
  """RED-Drop: balance positives and negatives by dropping random negatives.

  A response is positive when `r_i >= mean r`. If the group has more negatives
  than positives, `n_neg - n_pos` uniformly random negatives are dropped; the
  mean is recomputed over the kept responses, `A_i = r_i - mean_kept` for kept
  ones and `A_i = 0` for dropped ones (arXiv:2509.24203, docs/science.md section 3). Fully
  vectorised: negatives are ranked by an i.i.d. uniform score per response and
  the first `n_pos` of them are kept.

  Args:
    r_gk: [G, K] rewards.
    g: masked group statistics.
    key: PRNG key; each group draws independently.

  Returns:
    [G, K] advantages.
  """
  # `r == max` guards against `mean` rounding above every reward.
  pos = g.valid & ((r_gk >= g.mean) | (r_gk == g.max))
  neg = g.valid & ~pos
  n_pos = jnp.sum(pos, axis=1, keepdims=True)
  score = jnp.where(neg, jax.random.uniform(key, r_gk.shape), 2.0)
  rank = jnp.argsort(jnp.argsort(score, axis=1), axis=1)  # negatives first
  kept = pos | (neg & (rank < n_pos))
  kept_f = kept.astype(r_gk.dtype)
  n_kept = jnp.maximum(jnp.sum(kept_f, axis=1, keepdims=True), 1.0)
  mean_kept = jnp.sum(r_gk * kept_f, axis=1, keepdims=True) / n_kept
  return _finish(jnp.where(kept, r_gk - mean_kept, 0.0), g)


def median(r_gk: jax.Array, g: _Group, *, normalize: bool, eps: float) -> jax.Array:
  """Median baseline (MC-GRPO): `A_i = r_i - median r`, optionally `/ (MAD + eps)`.

  The median is robust to a single outlying reward in small groups. With
  `normalize=True` the advantage is divided by the median absolute deviation
  `MAD = median_j |r_j - median r|`; when `MAD == 0` (e.g. binary rewards with
  a clear majority) the population standard deviation is used instead, so the
  scale never explodes. An even count uses the mean of the two middle values.
  """
  med = jnp.nanmedian(jnp.where(g.valid, r_gk, jnp.nan), axis=1, keepdims=True)
  adv = r_gk - med
  if normalize:
    mad = jnp.nanmedian(jnp.where(g.valid, jnp.abs(adv), jnp.nan), axis=1, keepdims=True)
    centred = jnp.where(g.valid, r_gk - g.mean, 0.0)
    std = jnp.sqrt(jnp.sum(centred**2, axis=1, keepdims=True) / jnp.maximum(g.n, 1.0))
    adv = adv / (jnp.where(mad > 0, mad, std) + eps)
  return _finish(adv, g)


def opmd(r_gk: jax.Array, g: _Group, *, tau: float) -> jax.Array:
  """OPMD baseline: `A_i = r_i - tau * log(mean_j exp(r_j / tau))`.

  The soft-max value of the KL-regularised objective (Kimi k1.5,
  arXiv:2501.12599; online policy mirror descent). `tau -> inf` recovers the
  group mean, `tau -> 0` the group max.
  """
  # Shift by the group max for stability; invalid entries weigh 0.
  z = jnp.where(g.valid, (r_gk - g.max) / tau, -jnp.inf)
  lme = jnp.log(jnp.sum(jnp.exp(z), axis=1, keepdims=True) / jnp.maximum(g.n, 1.0))
  return _finish(r_gk - (g.max + tau * lme), g)


def pass_at_k(r_gk: jax.Array, g: _Group) -> jax.Array:
  """Best-only (max@K) advantage: `A_i = max_j r_j - max_{j != i} r_j`.

  The objective is the expected best reward of the K samples, `E[max_i r_i]`
  (pass@K for binary rewards). Its REINFORCE gradient
  `E[max_j r_j * sum_i grad log pi(y_i)]` stays unbiased with a per-sample
  baseline that does not depend on `y_i`; the leave-one-out max is such a
  baseline, leaving each response its marginal contribution to the group max
  ("Optimizing Language Models for Inference Time Objectives using
  Reinforcement Learning", Tang et al., arXiv:2503.19595). Only a unique best
  response gets a non-zero (positive) advantage; ties and `n <= 1` give 0.
  """
  if r_gk.shape[1] < 2:
    return jnp.zeros_like(r_gk)
  top = jnp.sort(jnp.where(g.valid, r_gk, -jnp.inf), axis=1)[:, ::-1]
  loo_max = jnp.where(r_gk == top[:, :1], top[:, 1:2], top[:, :1])
  return _finish(top[:, :1] - loo_max, g)


def batch_whiten(r_gk: jax.Array, g: _Group, *, eps: float) -> jax.Array:
  """REINFORCE++-baseline: group-mean baseline, then whitening over the batch.

  `a_i = r_i - mean_group r`, `A_i = (a_i - mean_batch a) / (std_batch a + eps)`
  (Hu et al., "REINFORCE++", arXiv:2501.03262). The batch statistics run over
  all valid entries, degenerate groups included (their `a` is 0).
  """
  a = jnp.where(g.valid & ~g.degenerate, r_gk - g.mean, 0.0)
  w = g.valid.astype(r_gk.dtype)
  n = jnp.maximum(jnp.sum(w), 1.0)
  mu = jnp.sum(a * w) / n
  std = jnp.sqrt(jnp.sum(w * (a - mu) ** 2) / n)
  return _finish((a - mu) / (std + eps), g)


def remax(r_gk: jax.Array, g: _Group) -> jax.Array:
  """ReMax: each sample's reward against its group's greedy response.

  `A_i = r_i - r_0` for i >= 1, where response 0 of every group is decoded
  greedily (`GREEDY_FIRST`); `A_0 = 0` (Li et al., "ReMax", arXiv:2310.10505).
  A group whose greedy response is invalid, or whose sampled rewards all equal
  the greedy one, gets 0.
  """
  baseline = r_gk[:, :1]
  sampled = jnp.arange(r_gk.shape[1])[None, :] >= 1
  usable = g.valid[:, :1] & (g.n >= 2)
  return jnp.where(usable & sampled & g.valid, r_gk - baseline, 0.0)


_FNS: dict[str, Callable[..., jax.Array]] = {
  "group_mean": group_mean,
  "grpo": grpo,
  "rloo": rloo,
  "asymre": asymre,
  "red_drop": red_drop,
  "median": median,
  "opmd": opmd,
  "pass_at_k": pass_at_k,
  "batch_whiten": batch_whiten,
  "remax": remax,
}


def compute(
  name: str,
  rewards: ArrayLike,
  key: ArrayLike | None = None,
  *,
  valid: ArrayLike | None = None,
  **overrides,
) -> jax.Array:
  """Computes group-relative advantages.

  Args:
    name: one of `names()`.
    rewards: [G, K] rewards (G prompts, K responses each).
    key: PRNG key; required by `red_drop`, ignored otherwise.
    valid: optional [G, K] bool mask of existing responses (default: all).
    **overrides: estimator hyper-parameters: grpo `eps`, `ddof`; asymre
      `baseline_shift`; median `normalize`, `eps`; opmd `tau`; batch_whiten `eps`.

  Returns:
    [G, K] float32 advantages (0 on invalid entries).

  Raises:
    ValueError: unknown name or override, rewards not 2-D, `valid` of another
      shape, missing key.
  """
  if name not in _DEFAULTS:
    raise ValueError(f"Unknown advantage name {name!r}; expected one of {names()}.")
  unknown = sorted(set(overrides) - set(_DEFAULTS[name]))
  if unknown:
    raise ValueError(
      f"Unknown override(s) {unknown} for advantage {name!r}; accepted: {sorted(_DEFAULTS[name])}."
    )
  r_gk = jnp.asarray(rewards, jnp.float32)
  if r_gk.ndim != 2:
    raise ValueError(f"rewards must be [G, K], got shape {r_gk.shape}.")
  if valid is None:
    valid = jnp.ones(r_gk.shape, bool)
  valid = jnp.asarray(valid).astype(bool)
  if valid.shape != r_gk.shape:
    raise ValueError(f"valid must have the rewards' shape {r_gk.shape}, got {valid.shape}.")
  kwargs = {**_DEFAULTS[name], **overrides}
  if name == "red_drop":
    if key is None:
      raise ValueError("advantage 'red_drop' needs a PRNG `key`.")
    kwargs["key"] = key
  return _FNS[name](r_gk, _group(r_gk, valid), **kwargs)


def per_turn(
  name: str,
  rewards: ArrayLike,
  key: ArrayLike | None = None,
  *,
  gamma: float = 1.0,
  **overrides,
) -> jax.Array:
  """Turn-level credit of multi-turn groups: `[G, K, T]` rewards -> `[G, K, T]` advantages.

  Reward `r[g, k, t]` is what the environment paid after turn t of trajectory
  k, NaN for a turn the trajectory did not take (it had ended). The return
  to go of turn t, `R[t] = sum_{t' >= t} gamma^(t' - t) r[t']`, is made
  group-relative among the trajectories that took turn t (the estimator
  `name`, `compute` with `valid` = took turn t). So an episode that solves
  early is compared at turn 0 with the others' whole returns (the speed
  incentive holds), and a later turn only with the trajectories still playing
  it. With one turn, or every trajectory of a group taking the same turns and
  gamma 1 with rewards only at the end, this is the trajectory credit
  `compute(name, r.sum(-1))`.

  Args:
    name: one of `names()`.
    rewards: [G, K, T] per-turn rewards, NaN for turns not taken.
    key: PRNG key (`red_drop`); turn t uses `fold_in(key, t)`.
    gamma: discount per turn, in [0, 1].
    **overrides: the estimator's hyper-parameters (`compute`).
  """
  r_gkt = jnp.asarray(rewards, jnp.float32)
  if r_gkt.ndim != 3:
    raise ValueError(f"per-turn rewards must be [G, K, T], got shape {r_gkt.shape}.")
  if not 0.0 <= gamma <= 1.0:
    raise ValueError(f"gamma must be in [0, 1], got {gamma}.")
  t = r_gkt.shape[-1]
  taken = ~jnp.isnan(r_gkt)
  paid = jnp.where(taken, r_gkt, 0.0)
  # discount[t, t'] = gamma^(t' - t) for t' >= t: every turn's return to go at once.
  i = jnp.arange(t)
  power = jnp.maximum(i[None, :] - i[:, None], 0)
  discount = jnp.where(i[None, :] >= i[:, None], gamma**power, 0.0).astype(jnp.float32)
  togo = jnp.einsum("gku,tu->gkt", paid, discount)
  keys = [None if key is None else jax.random.fold_in(key, j) for j in range(t)]
  return jnp.stack(
    [compute(name, togo[:, :, j], keys[j], valid=taken[:, :, j], **overrides) for j in range(t)],
    axis=-1,
  )
