"""Tests for offpolicy_jax.learn.diagnostics: the off-policy terms against float64 references."""

import jax.numpy as jnp
import numpy as np

from offpolicy_jax import reductions as red
from offpolicy_jax import types
from offpolicy_jax.learn import diagnostics


def _batch(rng, b=4, n=6):
  mask = (rng.uniform(size=(b, n)) < 0.8).astype(np.float32)
  mask[:, 0] = 1
  mu = -rng.uniform(0.1, 3.0, size=(b, n))
  old = mu + 0.05 * rng.normal(size=(b, n))
  old[0, 1] = mu[0, 1] + 1.2  # one token far out: a tail
  zeros_b = np.zeros(b, np.float32)
  batch = types.pack_groups(
    np.ones((b // 2, 3), np.int32),
    np.full(b // 2, 3, np.int32),
    np.ones((b, n), np.int32),
    mask,
    mu.astype(np.float32),
    np.zeros((b, n), np.int32),
    zeros_b,
    zeros_b,
    np.full((b, n), 7, np.int32),
    old.astype(np.float32),
  )
  return batch, mask > 0


def _reference(top, bottom, valid):
  u = (np.asarray(top, np.float64) - np.asarray(bottom, np.float64))[valid]
  out = {"kl_k1": np.mean(-u), "kl_k2": np.mean(u**2 / 2), "kl_k3": np.mean(np.expm1(u) - u)}
  s = np.sort(u)
  for q in diagnostics.QUANTILES:
    out[f"ratio_p{q}"] = np.exp(s[int(np.round(q / 100 * (len(s) - 1)))])
  out["ratio_tail_low"] = np.mean(u < -np.log(2))
  out["ratio_tail_high"] = np.mean(u > np.log(2))
  return out


def test_terms_match_float64_references():
  rng = np.random.default_rng(0)
  batch, valid = _batch(rng)
  logp = np.asarray(batch.old_logp) + 0.3 * rng.normal(size=valid.shape)
  got = {**diagnostics.mismatch_terms(batch)}
  got |= red.results(diagnostics.policy_terms(jnp.asarray(logp, jnp.float32), batch))
  for name, top, bottom in (
    ("mismatch", batch.old_logp, batch.behavior_logp),
    ("behavior", logp, batch.behavior_logp),
  ):
    for key, value in _reference(top, bottom, valid).items():
      np.testing.assert_allclose(got[f"{name}_{key}"], value, rtol=1e-5, atol=1e-6, err_msg=key)
  stale = _reference(logp, batch.old_logp, valid)
  for k in ("kl_k1", "kl_k2", "kl_k3"):
    np.testing.assert_allclose(got[f"staleness_{k}"], stale[k], rtol=1e-5, atol=1e-6)
  assert got["mismatch_ratio_tail_high"] > 0  # the planted token


def test_factors_without_a_scored_pi_old():
  """pi_old = mu: no mismatch, and staleness equals the behaviour terms."""
  rng = np.random.default_rng(1)
  batch, valid = _batch(rng)
  batch = batch._replace(old_logp=batch.behavior_logp)
  logp = jnp.asarray(np.asarray(batch.behavior_logp) + 0.2 * rng.normal(size=valid.shape))
  got = diagnostics.mismatch_terms(batch) | red.results(diagnostics.policy_terms(logp, batch))
  for k in ("kl_k1", "kl_k2", "kl_k3"):
    assert float(got[f"mismatch_{k}"]) == 0.0
    np.testing.assert_allclose(got[f"staleness_{k}"], got[f"behavior_{k}"], rtol=1e-6)
  assert float(got["mismatch_ratio_p50"]) == 1.0
