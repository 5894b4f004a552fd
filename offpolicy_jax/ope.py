"""Off-policy evaluation: the current policy's expected reward from stored lagged data.

Every estimator is a pure, jittable function of the stored tokens' log-probs
under the current policy `pi` (`logp`) and under the sampler `mu` that drew
them (`behavior_logp`, kept by the replay buffer), the response mask and the
rewards; none samples. `estimate` is the single entry point:

  est = ope.estimate("wis", logp_bt, behavior_logp_bt, mask_bt, rewards_b)
  est = ope.estimate("dr", logp_bt, behavior_logp_bt, mask_bt, rewards_b, values=values_bt)
  est.value, est.stderr, est.ci_low, est.ci_high, est.ess

Weights. With `d_t = logp_t - behavior_logp_t` on valid tokens (0 on padding),
the prefix weight is `W_t = exp(sum_{k <= t} d_k)` and the sequence weight
`w = W_{L-1}` (L - 1: the row's last valid token). Log-weights are summed in
float32; `clip` truncates every weight, `W_t <- min(W_t, clip)` (None: none).

Rows. A row with no valid token is excluded: it weighs 0, is not counted in
`n` (the rows used) and is counted in `num_excluded`. Masked positions are
never read (any value there, NaN included, changes nothing). Rewards are
`[B]` (terminal: paid at the row's last valid token) or `[B, T]` (paid per
token; the sequence estimators use their sum over valid tokens, the return).

Intervals: `value +- z * stderr`, `z` the normal quantile of `level`. The
ordinary estimators (`is`, `pdis`, `dr`) average i.i.d. per-row terms `f_i`:
`stderr = std(f, ddof=1) / sqrt(n)`. The self-normalised ones (`wis`, `pdwis`,
`wdr`) use the delta-method (linearisation) standard error of a ratio: with
normalised weights `wbar_i = w_i / sum_j w_j`, `stderr^2 = n / (n - 1) * sum_i
wbar_i^2 (r_i - value)^2` for `wis` (per column `t` and summed inside the
square for the per-decision ones; `_ratio_estimate`). Both equal
`std(r, ddof=1) / sqrt(n)` on on-policy data. `ess` is Kish's effective sample
size of the sequence weights, `(sum_i w_i)^2 / sum_i w_i^2` (Kish, "Survey
Sampling", 1965), `n` on on-policy data. Fewer than two rows give a NaN
standard error; none a NaN value. Docs: docs/ope.md.
"""

import statistics
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from offpolicy_jax import errors

# The estimators that take a critic (`values`, `q`).
_CRITIC = ("dr", "wdr")


class OpeEstimate(NamedTuple):
  """One off-policy estimate of the current policy's expected reward.

  Attributes:
    value: float32 [] the estimate.
    stderr: float32 [] its standard error (see the module docstring for which).
    ci_low: float32 [] `value - z * stderr`.
    ci_high: float32 [] `value + z * stderr`.
    ess: float32 [] Kish's effective sample size of the sequence weights.
    n: int32 [] rows used (those with a valid token).
    num_excluded: int32 [] rows with no valid token, left out.
  """

  value: jax.Array
  stderr: jax.Array
  ci_low: jax.Array
  ci_high: jax.Array
  ess: jax.Array
  n: jax.Array
  num_excluded: jax.Array


class _Rows(NamedTuple):
  """Per-row weights and positions, all float32 unless said."""

  log_w_bt: jax.Array  # cumulative (clipped) log-weights log W_t; -inf on excluded rows
  valid_b: jax.Array  # bool: the row has a valid token
  last_bt: jax.Array  # one-hot of the row's last valid token
  first_bt: jax.Array  # one-hot of the row's first valid token
  mask_bt: jax.Array  # bool


_WHERE = {
  "behavior_logp": "; the replay buffer stores them as TrainBatch.behavior_logp (the sampler's)",
}


def _check(name: str, x, shape: tuple[int, ...] | None, what: str) -> jax.Array:
  """`x` as float32, or a one-line ValueError naming `name` when it is None or of another shape."""
  if x is None:
    raise ValueError(f"{name}: missing; off-policy evaluation needs {what}{_WHERE.get(name, '')}.")
  x = jnp.asarray(x, jnp.float32)
  if shape is not None and x.shape != shape:
    raise ValueError(f"{name}: expected shape {shape}, got {x.shape}.")
  return x


def _rows(logp, behavior_logp, mask, clip: float | None) -> _Rows:
  """Validates the shared inputs and builds the per-row weights."""
  logp = _check("logp", logp, None, "the current policy's log-probs of the stored tokens [B, T]")
  if logp.ndim != 2:
    raise ValueError(f"logp: expected [B, T] log-probs, got shape {logp.shape}.")
  behavior_logp = _check(
    "behavior_logp",
    behavior_logp,
    logp.shape,
    "the behaviour policy's log-probs of the stored tokens [B, T]",
  )
  if mask is not None and not isinstance(mask, jax.core.Tracer):
    values = np.unique(np.asarray(mask))
    if not np.isin(values, (0.0, 1.0)).all():
      raise ValueError(f"mask: entries must be 0 or 1, got values {values[:5].tolist()}.")
  mask = _check("mask", mask, logp.shape, "the response mask [B, T]") > 0
  if clip is not None and not clip > 0:
    raise ValueError(f"clip: the weight truncation must be > 0 or None, got {clip}.")
  d_bt = jnp.where(mask, logp - behavior_logp, 0.0)
  log_w_bt = jnp.cumsum(d_bt, axis=1)
  if clip is not None:
    log_w_bt = jnp.minimum(log_w_bt, float(np.log(clip)))
  valid_b = mask.any(axis=1)
  t = logp.shape[1]
  idx = jnp.arange(t)
  last = jnp.max(jnp.where(mask, idx[None, :], -1), axis=1)
  first = jnp.min(jnp.where(mask, idx[None, :], t), axis=1)
  return _Rows(
    log_w_bt=jnp.where(valid_b[:, None], log_w_bt, -jnp.inf),
    valid_b=valid_b,
    last_bt=(idx[None, :] == last[:, None]).astype(jnp.float32),
    first_bt=(idx[None, :] == first[:, None]).astype(jnp.float32),
    mask_bt=mask,
  )


def _rewards_bt(rows: _Rows, rewards) -> jax.Array:
  """[B, T] rewards paid per token: terminal `[B]` ones at the last valid token; 0 off the mask."""
  shape = rows.mask_bt.shape
  r = _check("rewards", rewards, None, "the rewards [B] or [B, T]")
  if r.shape == shape[:1]:
    return jnp.where(rows.valid_b, r, 0.0)[:, None] * rows.last_bt
  if r.shape == shape:
    return jnp.where(rows.mask_bt, r, 0.0)
  raise ValueError(f"rewards: expected shape {shape[:1]} or {shape}, got {r.shape}.")


def _finish(value, stderr, rows: _Rows, level: float) -> OpeEstimate:
  if not 0.0 < level < 1.0:
    raise ValueError(f"level: the interval's coverage must be in (0, 1), got {level}.")
  z = statistics.NormalDist().inv_cdf(0.5 + level / 2)
  log_w = rows.log_w_bt[:, -1]
  w = jnp.exp(log_w - jnp.max(log_w))  # Kish's ESS is scale-free: subtract the max
  n = rows.valid_b.sum().astype(jnp.int32)
  return OpeEstimate(
    value=value,
    stderr=stderr,
    ci_low=value - z * stderr,
    ci_high=value + z * stderr,
    ess=jnp.sum(w) ** 2 / jnp.sum(w**2),
    n=n,
    num_excluded=(rows.valid_b.shape[0] - n).astype(jnp.int32),
  )


def _mean_estimate(f_b, log_scale, rows: _Rows):
  """(value, stderr) of `exp(log_scale) * mean_i f_i` over valid rows, stderr `std / sqrt(n)`."""
  n = rows.valid_b.sum().astype(jnp.float32)
  f = jnp.where(rows.valid_b, f_b, 0.0)
  mean = jnp.sum(f) / n
  var = jnp.sum(jnp.where(rows.valid_b, (f - mean) ** 2, 0.0)) / (n - 1.0)
  scale = jnp.exp(log_scale)
  return scale * mean, scale * jnp.sqrt(jnp.where(n > 1, var / n, jnp.nan))


def _ratio_estimate(log_w_bt, g_bt, h_b, rows: _Rows):
  """(value, delta-method stderr) of `mean_i h_i + sum_t (sum_i W_it g_it) / (sum_i W_it)`.

  Linearising each column's ratio `G_t` around its limit gives row i the
  influence `psi_i = (h_i - mean h) / n + sum_t wbar_it (g_it - G_t)`, with
  `wbar_it = W_it / sum_j W_jt`; `stderr^2 = n / (n - 1) * sum_i psi_i^2`.
  """
  n = rows.valid_b.sum().astype(jnp.float32)
  # Each column's ratio is scale-free: subtract the column's max log-weight.
  w = jnp.exp(log_w_bt - jnp.max(log_w_bt, axis=0, keepdims=True))
  wbar_bt = w / jnp.sum(w, axis=0, keepdims=True)
  g_bt = jnp.where(rows.valid_b[:, None], g_bt, 0.0)
  g_t = jnp.sum(wbar_bt * g_bt, axis=0, keepdims=True)
  h_b = jnp.where(rows.valid_b, h_b, 0.0)
  h_mean = jnp.sum(h_b) / n
  psi_b = jnp.where(rows.valid_b, (h_b - h_mean) / n, 0.0)
  psi_b = psi_b + jnp.sum(wbar_bt * (g_bt - g_t), axis=1)
  var = n / (n - 1.0) * jnp.sum(psi_b**2)
  return h_mean + jnp.sum(g_t), jnp.sqrt(jnp.where(n > 1, var, jnp.nan))


def importance_sampling(
  logp, behavior_logp, mask, rewards, *, clip: float | None = None, level: float = 0.95
) -> OpeEstimate:
  """Per-sequence importance sampling: `value = mean_i w_i R_i`.

  `w_i = prod_t pi(y_t | s_t) / mu(y_t | s_t)` over the row's valid tokens and
  `R_i` its return (the terminal reward, or the sum of per-token rewards).
  Unbiased for `E_pi[R]` when `mu > 0` wherever `pi > 0` and `clip` is None
  (Precup, Sutton and Singh, "Eligibility Traces for Off-Policy Policy
  Evaluation", ICML 2000).

  Args:
    logp: [B, T] the current policy's log-probs of the stored tokens.
    behavior_logp: [B, T] the sampler's log-probs of the same tokens.
    mask: [B, T] float 1 on valid response tokens, 0 on padding.
    rewards: [B] terminal rewards, or [B, T] per-token rewards.
    clip: truncation of the sequence weight, `min(w, clip)`; None: none.
    level: the interval's coverage (static).

  Returns:
    An `OpeEstimate`; normal interval, `stderr = std(w R, ddof=1) / sqrt(n)`.
  """
  rows = _rows(logp, behavior_logp, mask, clip)
  ret_b = jnp.sum(_rewards_bt(rows, rewards), axis=1)
  log_w = rows.log_w_bt[:, -1]
  top = jnp.max(log_w)  # factor exp(max) out so the squares cannot overflow first
  value, stderr = _mean_estimate(jnp.exp(log_w - top) * ret_b, top, rows)
  return _finish(value, stderr, rows, level)


def weighted_importance_sampling(
  logp, behavior_logp, mask, rewards, *, clip: float | None = None, level: float = 0.95
) -> OpeEstimate:
  """Weighted (self-normalised) importance sampling: `value = sum_i w_i R_i / sum_i w_i`.

  Biased (`O(1/n)`) but consistent, never outside the range of the rewards,
  and far lower variance than `importance_sampling` when a few weights
  dominate (Precup et al. 2000). Interval: delta method,
  `stderr^2 = n / (n - 1) * sum_i wbar_i^2 (R_i - value)^2`, `wbar_i = w_i / sum_j w_j`.
  Arguments as `importance_sampling`.
  """
  rows = _rows(logp, behavior_logp, mask, clip)
  ret_b = jnp.sum(_rewards_bt(rows, rewards), axis=1)
  zeros = jnp.zeros_like(ret_b)
  value, stderr = _ratio_estimate(rows.log_w_bt[:, -1:], ret_b[:, None], zeros, rows)
  return _finish(value, stderr, rows, level)


def per_decision_is(
  logp, behavior_logp, mask, rewards, *, clip: float | None = None, level: float = 0.95
) -> OpeEstimate:
  """Per-decision importance sampling: `value = mean_i sum_t W_it r_it`.

  A reward paid at token t is weighted by the prefix weight `W_t` only: later
  tokens cannot have caused it (Precup et al. 2000). Equals
  `importance_sampling` for terminal rewards. Arguments as `importance_sampling`
  (`clip` truncates every prefix weight).
  """
  rows = _rows(logp, behavior_logp, mask, clip)
  r_bt = _rewards_bt(rows, rewards)
  top = jnp.max(rows.log_w_bt)
  f_b = jnp.sum(jnp.exp(rows.log_w_bt - top) * r_bt, axis=1)
  value, stderr = _mean_estimate(f_b, top, rows)
  return _finish(value, stderr, rows, level)


def per_decision_wis(
  logp, behavior_logp, mask, rewards, *, clip: float | None = None, level: float = 0.95
) -> OpeEstimate:
  """Per-decision weighted importance sampling: `value = sum_t sum_i W_it r_it / sum_i W_it`.

  Each token position t is self-normalised by its own prefix weights (Precup
  et al. 2000; Thomas, "Safe Reinforcement Learning", 2015, s3.4). A row that
  ended before t keeps its final weight in the column-t normaliser (it sits in
  an absorbing state of reward 0 and ratio 1). Equals
  `weighted_importance_sampling` when every row has the same length and the
  reward is terminal. Interval: the delta method over all columns
  (`_ratio_estimate`). Arguments as `importance_sampling`.
  """
  rows = _rows(logp, behavior_logp, mask, clip)
  r_bt = _rewards_bt(rows, rewards)
  zeros = jnp.zeros(r_bt.shape[:1], jnp.float32)
  value, stderr = _ratio_estimate(rows.log_w_bt, r_bt, zeros, rows)
  return _finish(value, stderr, rows, level)


def _critic(rows: _Rows, values, q) -> tuple[jax.Array, jax.Array]:
  """(V(s_0), Q of the last token), [B] each: `values` at the first valid token, and `q`.

  `q` defaults to `values` at the last valid token.
  """
  shape = rows.mask_bt.shape
  what = "a critic's V(s_t) [B, T] at each token for the doubly robust estimators (dr, wdr)"
  values = jnp.where(rows.mask_bt, _check("values", values, shape, what), 0.0)
  v0_b = jnp.sum(rows.first_bt * values, axis=1)
  if q is None:
    return v0_b, jnp.sum(rows.last_bt * values, axis=1)
  return v0_b, jnp.where(rows.valid_b, _check("q", q, shape[:1], "Q of the last token [B]"), 0.0)


def doubly_robust(
  logp,
  behavior_logp,
  mask,
  rewards,
  values,
  q=None,
  *,
  clip: float | None = None,
  level: float = 0.95,
) -> OpeEstimate:
  """Doubly robust estimator for a token MDP: `value = mean_i [V(s_0) + sum_t W_t r_t - W_L q]`.

  Jiang and Li, "Doubly Robust Off-policy Value Evaluation for Reinforcement
  Learning" (arXiv:1511.03722), with gamma = 1, per row:

    DR = sum_t [W_{t-1} V(s_t) + W_t (r_t - Q(s_t, y_t))],   W_{-1} = 1,

  where `s_t` = (prompt, y_<t) and `V(s_t) = values[:, t]`, the critic's value
  before token t. Transitions are deterministic (`s_{t+1} = s_t + y_t`), so
  `Q(s_t, y_t) = V(s_{t+1})` for every token but the last (the critic predicts
  no reward before the end) and `Q(s_{L-1}, y_{L-1}) = q`, the model's reward
  for the finished sequence (default: `V(s_{L-1})`, the value at the last
  token). The value terms telescope, `W_{t-1} V(s_t) - W_{t-1} Q(s_{t-1},
  y_{t-1}) = 0`, leaving

    DR = V(s_0) + sum_t W_t r_t - W_{L-1} q  (terminal reward r: V(s_0) + w (r - q)),

  the contextual-bandit DR over whole sequences: only the critic's value at the
  prompt and its prediction for the finished sequence enter. Unbiased when
  `V(s_0) = E_pi[q | prompt]`; a perfect critic (`V(s_0) = V_pi`, `q = r` with a
  deterministic reward) gives the true value with zero variance, and a zero
  critic gives `per_decision_is` exactly. Weights are not rescaled (the critic
  term is absolute), so a log-weight above ~88 overflows to inf.

  Args:
    logp, behavior_logp, mask, rewards, clip, level: as `importance_sampling`.
    values: [B, T] the critic's V(s_t), read on valid tokens only.
    q: optional [B] Q of the last token (the predicted final reward).

  Returns:
    An `OpeEstimate`; normal interval, `stderr = std(DR_i, ddof=1) / sqrt(n)`.
  """
  rows = _rows(logp, behavior_logp, mask, clip)
  r_bt = _rewards_bt(rows, rewards)
  v0_b, q_b = _critic(rows, values, q)
  g_bt = r_bt - rows.last_bt * q_b[:, None]
  value, stderr = _mean_estimate(v0_b + jnp.sum(jnp.exp(rows.log_w_bt) * g_bt, axis=1), 0.0, rows)
  return _finish(value, stderr, rows, level)


def weighted_doubly_robust(
  logp,
  behavior_logp,
  mask,
  rewards,
  values,
  q=None,
  *,
  clip: float | None = None,
  level: float = 0.95,
) -> OpeEstimate:
  """Weighted doubly robust: `doubly_robust` with per-decision self-normalised weights.

  Thomas and Brunskill, "Data-Efficient Off-Policy Policy Evaluation for
  Reinforcement Learning" (arXiv:1604.00923): every `W_t` (and `W_{t-1}`) of
  `doubly_robust` becomes `wbar_it = W_it / sum_j W_jt` (`W_{-1}` becomes
  `1 / n`). The same telescoping holds column by column, so

    WDR = mean_i V_i(s_0) + sum_t sum_i wbar_it (r_it - [t = L_i - 1] q_i).

  A perfect critic gives the true value with zero variance; a zero critic gives
  `per_decision_wis`. Interval: the delta method (`_ratio_estimate`).
  Arguments as `doubly_robust`.
  """
  rows = _rows(logp, behavior_logp, mask, clip)
  r_bt = _rewards_bt(rows, rewards)
  v0_b, q_b = _critic(rows, values, q)
  g_bt = r_bt - rows.last_bt * q_b[:, None]
  value, stderr = _ratio_estimate(rows.log_w_bt, g_bt, v0_b, rows)
  return _finish(value, stderr, rows, level)


_FNS: dict[str, Callable[..., OpeEstimate]] = {
  "is": importance_sampling,
  "wis": weighted_importance_sampling,
  "pdis": per_decision_is,
  "pdwis": per_decision_wis,
  "dr": doubly_robust,
  "wdr": weighted_doubly_robust,
}


def names() -> list[str]:
  """Returns the names accepted by `estimate`."""
  return list(_FNS)


def estimate(
  name: str,
  logp: ArrayLike,
  behavior_logp: ArrayLike | None,
  mask: ArrayLike,
  rewards: ArrayLike,
  *,
  values: ArrayLike | None = None,
  q: ArrayLike | None = None,
  clip: float | None = None,
  level: float = 0.95,
) -> OpeEstimate:
  """Estimates the current policy's expected reward from stored data with estimator `name`.

  Args:
    name: one of `names()` (static): `is`, `wis`, `pdis`, `pdwis`, `dr`, `wdr`.
    logp: [B, T] the current policy's log-probs of the stored tokens.
    behavior_logp: [B, T] the sampler's log-probs (`TrainBatch.behavior_logp`).
    mask: [B, T] 1 on valid response tokens.
    rewards: [B] terminal or [B, T] per-token rewards.
    values: [B, T] the critic's V(s_t); `dr` and `wdr` only, and required there.
    q: optional [B] Q of the last token; `dr` and `wdr` only.
    clip: truncation of the importance weights; None: none (static).
    level: the interval's coverage (static).

  Returns:
    An `OpeEstimate`.

  Raises:
    ValueError: one line naming the argument: an unknown name (with the nearest
      one), a missing input (`behavior_logp` None), a shape, a mask entry not
      in {0, 1}, a critic given to an estimator without one.
  """
  if name not in _FNS:
    near = errors.did_you_mean(name, _FNS)
    raise ValueError(
      f"name: unknown off-policy estimator {name!r}"
      + (f"; {near}" if near else "")
      + f" Expected one of {names()}."
    )
  if name in _CRITIC:
    return _FNS[name](logp, behavior_logp, mask, rewards, values, q, clip=clip, level=level)
  for arg, x in (("values", values), ("q", q)):
    if x is not None:
      raise ValueError(f"{arg}: only the estimators {list(_CRITIC)} use a critic, not {name!r}.")
  return _FNS[name](logp, behavior_logp, mask, rewards, clip=clip, level=level)
