"""Tests for the KL estimators (numpy references)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from offpolicy_jax import losses

RNG = np.random.default_rng(0)
LOGP = RNG.normal(-2.0, 1.0, (3, 5)).astype(np.float32)
REF = (LOGP + RNG.normal(0.0, 0.7, (3, 5))).astype(np.float32)
D = LOGP.astype(np.float64) - REF

GOLDEN = {
  "k1": (D, np.ones_like(D)),
  "k2": (0.5 * D**2, D),
  "k3": (np.exp(-D) - 1 + D, 1 - np.exp(-D)),
  "abs": (np.abs(D), np.sign(D)),
}


@pytest.mark.parametrize("kind", losses.KL_KINDS)
@pytest.mark.parametrize("straight_through", [False, True])
def test_kl_estimators_value_and_gradient(kind, straight_through):
  f = lambda lp: losses.kl(lp, REF, kind, straight_through=straight_through)
  value = f(LOGP)
  grad = jax.grad(lambda lp: jnp.sum(f(lp)))(LOGP)
  want_value, want_grad = GOLDEN[kind]
  np.testing.assert_allclose(value, want_value, rtol=1e-5, atol=1e-6)
  # The straight-through variant keeps the value and takes the k2 gradient.
  np.testing.assert_allclose(grad, D if straight_through else want_grad, rtol=1e-5, atol=1e-6)


def test_kl_estimators_are_sensible():
  # k3 and k2 are non-negative; all estimators vanish at logp == ref.
  for kind in losses.KL_KINDS:
    np.testing.assert_allclose(losses.kl(LOGP, LOGP, kind), 0.0, atol=1e-7)
  assert np.all(np.asarray(losses.kl(LOGP, REF, "k3")) >= 0)
  with pytest.raises(ValueError, match="kind"):
    losses.kl(LOGP, REF, "k4")
