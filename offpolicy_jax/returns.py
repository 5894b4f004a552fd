"""Token-level returns and advantages: GAE, lambda-returns, V-trace and Retrace.

Every function is pure and jittable over batch-major `[B, T]` arrays (B rows,
T token positions): one reverse `jax.lax.scan` over T, batched over B.

  adv, ret = returns.gae(rewards_bt, values_bt, mask_bt, gamma=1.0, lam=0.95)
  g_bt = returns.lambda_returns(rewards_bt, values_bt, mask_bt, gamma=1.0, lam=0.95)
  vs, pg_adv = returns.vtrace(rewards_bt, values_bt, mask_bt, log_rhos_bt, gamma=1.0)
  g_bt = returns.retrace(rewards_bt, q_bt, values_bt, mask_bt, log_rhos_bt, gamma=1.0, lam=0.9)

The token MDP. The state before token t is `s_t` (the prompt, every token
before t, observations included); `values[:, t]` is the critic's `V(s_t)`
and `rewards[:, t]` the reward paid after token t (`token_rewards` places a
terminal reward at the row's last valid token and per-turn rewards at each
turn's last token; `kl_penalized_rewards` folds in a per-token KL penalty).

Masks. `mask` [B, T] (0 or 1) marks the valid (policy) tokens; rows are
ragged and may have holes (the observation tokens of a multi-turn row). The
recursions run over the valid tokens of a row only: with `t'` the next valid
token after t, every formula below reads `x_{t'}` for "the next step". A
masked token is not a step: it pays no reward, has no value, is not
discounted and does not cut the bootstrap chain between the valid tokens
around it. So inserting masked tokens anywhere in a row changes no output at
a valid token (the scan carries its state through them unchanged). Masked
inputs are never read (NaN there changes nothing); every output is 0 on
masked positions, and a row with no valid token gets 0 everywhere.

Episode end. After a row's last valid token `V = bootstrap_value[b]`, 0 when
None (a terminal state). Pass the critic's value of the state after the
last token for a row cut by a token limit, 0 for a row that ended.

Hyper-parameters (`gamma`, `lam`, truncations) are Python floats, static
under `jax.jit`, checked at trace time: a bad one raises a `ValueError`
naming it. Arithmetic is float32. The outputs are targets: every input is
read through `jax.lax.stop_gradient`, so no gradient flows through them.
Docs: docs/values.md.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from offpolicy_jax import types


class GaeOutput(NamedTuple):
  """Advantages and value targets, float32 [B, T], 0 on masked positions."""

  advantages: jax.Array
  returns: jax.Array


class VtraceOutput(NamedTuple):
  """V-trace value targets `vs` and policy-gradient advantages, float32 [B, T]."""

  vs: jax.Array
  pg_advantages: jax.Array


# --- Checks -----------------------------------------------------------------


def _static(name: str, x) -> float:
  if isinstance(x, jax.core.Tracer):
    raise ValueError(f"{name}: must be a Python number (static under jit), got a traced value.")
  return float(x)


def _unit(name: str, x, what: str) -> float:
  x = _static(name, x)
  if not 0.0 <= x <= 1.0:
    raise ValueError(f"{name}: the {what} must be in [0, 1], got {x}.")
  return x


def _mask(mask, shape: tuple[int, ...]) -> jax.Array:
  """bool [B, T] valid tokens; a concrete mask must hold only 0 and 1."""
  if not isinstance(mask, jax.core.Tracer):
    values = np.unique(np.asarray(mask))
    if not np.isin(values, (0.0, 1.0)).all():
      raise ValueError(f"mask: entries must be 0 or 1, got values {values[:5].tolist()}.")
  mask = jnp.asarray(mask)
  if mask.shape != shape:
    raise ValueError(f"mask: expected the rewards' shape {shape}, got {mask.shape}.")
  return mask > 0


def _read(name: str, x, valid: jax.Array) -> jax.Array:
  """float32 `x` of the mask's shape, 0 on masked positions, gradient stopped."""
  x = jnp.asarray(x, jnp.float32)
  if x.shape != valid.shape:
    raise ValueError(f"{name}: expected shape {valid.shape} (that of rewards), got {x.shape}.")
  return jnp.where(valid, jax.lax.stop_gradient(x), 0.0)


def _rows(rewards, mask, bootstrap_value) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(rewards [B, T], valid [B, T], value after the last valid token [B])."""
  shape = jnp.shape(rewards)
  if len(shape) != 2:
    raise ValueError(f"rewards: expected [B, T] per-token rewards, got shape {shape}.")
  valid = _mask(mask, shape)
  if bootstrap_value is None:
    return _read("rewards", rewards, valid), valid, jnp.zeros(shape[:1], jnp.float32)
  end = jnp.asarray(bootstrap_value, jnp.float32)
  if end.shape != shape[:1]:
    raise ValueError(f"bootstrap_value: expected shape {shape[:1]} ([B]), got {end.shape}.")
  return _read("rewards", rewards, valid), valid, jax.lax.stop_gradient(end)


# --- Reverse scans over the valid tokens ------------------------------------
# Step functions live at module level so that eager calls reuse one traced scan.


def _next_step(carry, xs):
  x, ok = xs
  return jnp.where(ok, x, carry), carry


def _next(x_bt: jax.Array, valid: jax.Array, end_b: jax.Array) -> jax.Array:
  """[B, T]: `x` at the next valid token after each position (`end_b` after the last)."""
  _, out = jax.lax.scan(_next_step, end_b, (x_bt.T, valid.T), reverse=True)
  return out.T


def _backward_step(carry, xs):
  a, k, ok = xs
  y = jnp.where(ok, a + k * carry, carry)
  return y, y


def _backward(a_bt: jax.Array, k_bt: jax.Array, valid: jax.Array, end_b: jax.Array) -> jax.Array:
  """`y_t = a_t + k_t y_{t'}` over the valid tokens, `y = end_b` after the last; 0 when masked."""
  k_bt = jnp.broadcast_to(k_bt, a_bt.shape)
  _, y = jax.lax.scan(_backward_step, end_b, (a_bt.T, k_bt.T, valid.T), reverse=True)
  return jnp.where(valid, y.T, 0.0)


# --- Estimators -------------------------------------------------------------


def gae(
  rewards: ArrayLike,
  values: ArrayLike,
  mask: ArrayLike,
  *,
  gamma: float,
  lam: float,
  bootstrap_value: ArrayLike | None = None,
) -> GaeOutput:
  """Generalized advantage estimation over the valid tokens of each row.

  `delta_t = r_t + gamma V_{t'} - V_t`, `A_t = delta_t + gamma lam A_{t'}`
  (`A = 0` after the last valid token), value target `A_t + V_t`: the
  lambda-return (`lambda_returns`). "High-Dimensional Continuous Control
  Using Generalized Advantage Estimation" (Schulman et al., arXiv:1506.02438).
  `lam = 1` gives the Monte Carlo return minus `V_t`, `lam = 0` the TD error.

  Args:
    rewards: [B, T] per-token rewards.
    values: [B, T] critic values `V(s_t)`, the state before token t.
    mask: [B, T] 1 on valid tokens, 0 elsewhere.
    gamma: discount per valid token, in [0, 1].
    lam: GAE's lambda, in [0, 1].
    bootstrap_value: [B] value after each row's last valid token; None: 0.

  Returns:
    `GaeOutput(advantages, returns)`, float32 [B, T], 0 on masked positions.
  """
  gamma, lam = _unit("gamma", gamma, "discount"), _unit("lam", lam, "GAE lambda")
  r, valid, end = _rows(rewards, mask, bootstrap_value)
  v = _read("values", values, valid)
  delta = r + gamma * _next(v, valid, end) - v
  adv = _backward(delta, jnp.float32(gamma * lam), valid, jnp.zeros_like(end))
  return GaeOutput(adv, jnp.where(valid, adv + v, 0.0))


def lambda_returns(
  rewards: ArrayLike,
  values: ArrayLike,
  mask: ArrayLike,
  *,
  gamma: float,
  lam: float,
  bootstrap_value: ArrayLike | None = None,
) -> jax.Array:
  """Lambda-returns: `G_t = r_t + gamma ((1 - lam) V_{t'} + lam G_{t'})`.

  `G = V = bootstrap_value` after the last valid token. The truncated
  TD(lambda) target, a `(1 - lam) lam^(n-1)`-weighted mix of the n-step
  returns (Sutton and Barto, "Reinforcement Learning: An Introduction", 2nd
  ed., ch. 12). Equals `gae(...).returns`; `V_t` itself is not read.
  Arguments as `gae`.

  Returns:
    float32 [B, T] returns, 0 on masked positions.
  """
  gamma, lam = _unit("gamma", gamma, "discount"), _unit("lam", lam, "lambda")
  r, valid, end = _rows(rewards, mask, bootstrap_value)
  v = _read("values", values, valid)
  a = r + gamma * (1.0 - lam) * _next(v, valid, end)
  return _backward(a, jnp.float32(gamma * lam), valid, end)


def vtrace(
  rewards: ArrayLike,
  values: ArrayLike,
  mask: ArrayLike,
  log_rhos: ArrayLike,
  *,
  gamma: float,
  lam: float = 1.0,
  rho_bar: float = 1.0,
  c_bar: float = 1.0,
  pg_rho_bar: float | None = None,
  bootstrap_value: ArrayLike | None = None,
) -> VtraceOutput:
  """V-trace targets and policy-gradient advantages.

  With `rho_t = exp(log_rhos_t)`, `rho'_t = min(rho_bar, rho_t)`,
  `c_t = lam min(c_bar, rho_t)` and `delta_t = r_t + gamma V_{t'} - V_t`:
  `vs_t - V_t = rho'_t delta_t + gamma c_t (vs_{t'} - V_{t'})` (the paper's
  `v_s = V_s + sum_t gamma^(t-s) (prod_{i<t} c_i) rho'_t delta_t`), with
  `vs = V = bootstrap_value` after the last valid token, and
  `pg_t = min(pg_rho_bar, rho_t) (r_t + gamma vs_{t'} - V_t)`. "IMPALA:
  Scalable Distributed Deep-RL with Importance Weighted Actor-Learner
  Architectures" (Espeholt et al., arXiv:1802.01561); `lam` is its remark
  on mixing in a TD(lambda)-style trace.

  Truncations: the paper assumes `rho_bar >= c_bar` (section 4.1), and
  both are positive; values below 1 are legal (`rho_bar` then moves the
  fixed point from pi towards mu, `c_bar` cuts traces sooner). `inf` turns a
  truncation off. On-policy (`log_rhos = 0`, `rho_bar, c_bar >= 1`) `vs` is
  `lambda_returns` and, at `lam = 1`, `pg` is `gae`'s advantage.

  Args:
    rewards, values, mask, bootstrap_value: as `gae`.
    log_rhos: [B, T] `log pi(y_t | s_t) - log mu(y_t | s_t)` per token.
    gamma: discount per valid token, in [0, 1].
    lam: trace lambda, in [0, 1].
    rho_bar: truncation of the TD weights, `>= c_bar`.
    c_bar: truncation of the traces, `> 0`.
    pg_rho_bar: truncation of the policy-gradient weight, `> 0`; None: `rho_bar`.

  Returns:
    `VtraceOutput(vs, pg_advantages)`, float32 [B, T], 0 on masked positions.
  """
  gamma, lam = _unit("gamma", gamma, "discount"), _unit("lam", lam, "trace lambda")
  rho_bar, c_bar = _static("rho_bar", rho_bar), _static("c_bar", c_bar)
  pg_rho_bar = rho_bar if pg_rho_bar is None else _static("pg_rho_bar", pg_rho_bar)
  if not c_bar > 0:
    raise ValueError(f"c_bar: the trace truncation must be > 0, got {c_bar}.")
  if not rho_bar >= c_bar:
    raise ValueError(
      f"rho_bar: V-trace needs rho_bar >= c_bar (Espeholt et al. 2018, section 4.1), "
      f"got rho_bar={rho_bar} < c_bar={c_bar}."
    )
  if not pg_rho_bar > 0:
    raise ValueError(f"pg_rho_bar: the policy-gradient truncation must be > 0, got {pg_rho_bar}.")
  r, valid, end = _rows(rewards, mask, bootstrap_value)
  v = _read("values", values, valid)
  rho = jnp.exp(_read("log_rhos", log_rhos, valid))
  delta = r + gamma * _next(v, valid, end) - v
  c = gamma * lam * jnp.minimum(c_bar, rho)
  vs = _backward(jnp.minimum(rho_bar, rho) * delta, c, valid, jnp.zeros_like(end)) + v
  pg = jnp.minimum(pg_rho_bar, rho) * (r + gamma * _next(vs, valid, end) - v)
  return VtraceOutput(vs, jnp.where(valid, pg, 0.0))


def retrace(
  rewards: ArrayLike,
  q_values: ArrayLike,
  values: ArrayLike,
  mask: ArrayLike,
  log_rhos: ArrayLike,
  *,
  gamma: float,
  lam: float,
  bootstrap_value: ArrayLike | None = None,
) -> jax.Array:
  """Retrace(lambda) targets for the action values of the sampled tokens.

  `G_t = r_t + gamma (V_{t'} + c_{t'} (G_{t'} - Q_{t'}))` with the traces
  `c_t = lam min(1, rho_t)`, `rho_t = exp(log_rhos_t)`, and
  `G_t = r_t + gamma bootstrap_value` at the last valid token; that is
  `G_s - Q_s = sum_{t>=s} gamma^(t-s) (prod_{s<i<=t} c_i) (r_t + gamma V_{t+1} - Q_t)`.
  "Safe and Efficient Off-Policy Reinforcement Learning" (Munos et al.,
  arXiv:1606.02647). `Q_t = Q(s_t, y_t)` is the critic's value of the
  sampled token, `V_t = sum_y pi(y | s_t) Q(s_t, y)` its expectation under
  the target policy pi; the first valid token's `log_rhos` is not read.
  `lam = 0` gives the expected-SARSA target `r_t + gamma V_{t'}`; with
  `Q = V` and `rho >= 1` everywhere, `lambda_returns`.

  Args:
    rewards, mask, bootstrap_value: as `gae`.
    q_values: [B, T] `Q(s_t, y_t)` of the sampled tokens.
    values: [B, T] `V(s_t)` under the target policy.
    log_rhos: [B, T] `log pi(y_t | s_t) - log mu(y_t | s_t)` per token.
    gamma: discount per valid token, in [0, 1].
    lam: trace lambda, in [0, 1].

  Returns:
    float32 [B, T] targets for `q_values`, 0 on masked positions.
  """
  gamma, lam = _unit("gamma", gamma, "discount"), _unit("lam", lam, "trace lambda")
  r, valid, end = _rows(rewards, mask, bootstrap_value)
  q = _read("q_values", q_values, valid)
  v = _read("values", values, valid)
  c = lam * jnp.minimum(1.0, jnp.exp(_read("log_rhos", log_rhos, valid)))
  zeros = jnp.zeros_like(end)
  a = r + gamma * _next(v, valid, end) - q
  return _backward(a, gamma * _next(c, valid, zeros), valid, zeros) + q


# --- Rewards per token ------------------------------------------------------


def token_rewards(rewards: ArrayLike, mask: ArrayLike) -> jax.Array:
  """Places sequence or per-turn rewards on tokens: `[B]` or `[B, J]` -> `[B, T]`.

  `[B]`: a terminal reward, paid at the row's last valid token. `[B, J]`:
  the reward of turn j, paid at that turn's last valid token (turns are the
  runs of valid tokens, `types.turn_ids`); NaN (a turn not taken) and turns
  beyond J pay 0. Every other token pays 0.

  Args:
    rewards: [B] or [B, J] rewards.
    mask: [B, T] 1 on valid (policy) tokens.

  Returns:
    float32 [B, T] per-token rewards.
  """
  shape = jnp.shape(mask)
  if len(shape) != 2:
    raise ValueError(f"mask: expected [B, T], got shape {shape}.")
  valid = _mask(mask, shape)
  r = jax.lax.stop_gradient(jnp.asarray(rewards, jnp.float32))
  if r.ndim not in (1, 2) or r.shape[0] != shape[0]:
    raise ValueError(f"rewards: expected [B] or [B, J] with B = {shape[0]}, got shape {r.shape}.")
  after = jnp.pad(valid, ((0, 0), (0, 1)))[:, 1:]
  if r.ndim == 1:
    last = valid & ~jnp.cumsum(after[:, ::-1], axis=1)[:, ::-1].astype(bool)
    return jnp.where(last, r[:, None], 0.0)
  turn = types.turn_ids(valid)
  paid = jnp.take_along_axis(r, jnp.minimum(turn, r.shape[1] - 1), axis=1)
  paid = jnp.where(jnp.isnan(paid) | (turn >= r.shape[1]), 0.0, paid)
  return jnp.where(valid & ~after, paid, 0.0)


def kl_penalized_rewards(
  rewards: ArrayLike, logp: ArrayLike, ref_logp: ArrayLike, mask: ArrayLike, coef: float
) -> jax.Array:
  """Per-token rewards with a KL penalty folded in: `r_t - coef (logp_t - ref_logp_t)`.

  The k1 estimate of `KL(pi || ref)` per sampled token: summed over a
  response it is `log pi(y) / ref(y)`, whose mean under pi is the sequence
  KL ("Fine-Tuning Language Models from Human Preferences", Ziegler et al.,
  arXiv:1909.08593; InstructGPT, arXiv:2203.02155). The penalty is a
  reward, so its gradient is stopped.

  Args:
    rewards: [B, T] per-token rewards (`token_rewards`).
    logp: [B, T] log-probs of the sampled tokens under the penalised policy.
    ref_logp: [B, T] their log-probs under the reference policy.
    mask: [B, T] 1 on valid tokens.
    coef: the penalty's coefficient, >= 0.

  Returns:
    float32 [B, T] rewards, 0 on masked positions.
  """
  coef = _static("coef", coef)
  if not coef >= 0:
    raise ValueError(f"coef: the KL coefficient must be >= 0, got {coef}.")
  r, valid, _ = _rows(rewards, mask, None)
  d = _read("logp", logp, valid) - _read("ref_logp", ref_logp, valid)
  return jnp.where(valid, r - coef * d, 0.0)
