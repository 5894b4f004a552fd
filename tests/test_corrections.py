"""The rollout-correction family (docs/science.md s7) against float64 references.

The golden batch and the per-preset reference (`correction_ref`) live in
tests/test_losses.py, which also checks every preset's loss and gradient,
padding, micro-batch and jit invariances; here: the mismatch factor
``pi_old / mu`` (``old_logp``), the per-correction metrics, hand-computed
sequence rules (veto, rejection), DPPO's probability masks, and validation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from offpolicy_jax import losses
from tests.test_losses import (
  A_BT,
  INPUTS,
  LOGP,
  MASK,
  MU,
  SEQ_CORRECTIONS,
  _dppo_keep,
  _pad,
  correction_ref,
  reference,
)

VALID = MASK > 0
N = MASK.sum()
# pi_old: the behaviour version scored by the learner. Its mismatch factor
# pi_old / mu reaches both sides of every band; rows 2 and 7 have none.
_NOISE = np.random.default_rng(5).uniform(-1.2, 1.2, MASK.shape)
_NOISE[[2, 7]] = 0.0
OLD = MU + _NOISE
CORRECTIONS = (
  "tis",
  "icepop",
  "tis_seq",
  "tis_old",
  "icepop_old",
  "mis_token",
  "mis_seq",
  "mis_geo",
  "tr_mask_k3",
  "tr_mask_k1",
  "opsm",
)


def _run(spec, jit=False, **inputs):
  """(LossOutput, d loss / d logp) on the golden batch with ``inputs`` replaced."""
  kw = dict(INPUTS, **inputs)
  logp = kw.pop("logp")

  def f(lp):
    out = losses.policy_loss(spec, logp=lp, **kw)
    return out.loss, out

  fn = jax.value_and_grad(f, has_aux=True)
  (_, out), grad = (jax.jit(fn) if jit else fn)(logp)
  return out, np.asarray(grad, np.float64)


def _weighted_ref(weight):
  """Token-mean REINFORCE ``-A * weight * logp`` (weight constant): (loss, grad)."""
  coef = -A_BT * weight * MASK / N
  return np.sum(coef * np.where(VALID, LOGP, 0.0)), coef


def _rule(name):
  """The `correction_ref` rule of a preset (``tis`` / ``icepop`` are their token rules)."""
  return {"tis": "tis_old", "icepop": "icepop_old"}.get(name, name)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", ["tis_old", "icepop_old"])
def test_old_logp_splits_the_ratio(name, jit):
  """``c(pi_old / mu) * PPO-clip(pi / pi_old)``; ``old_logp=None`` is ``mu`` (factor 1: PPO)."""
  spec = losses.get_spec(name)
  assert spec.needs_old and not spec.needs_proximal and spec.zero_advantage_inert
  out, grad = _run(spec, jit, old_logp=_pad(OLD))
  want_loss, want_grad = reference(name, old=OLD)
  np.testing.assert_allclose(out.loss, want_loss, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-6)
  w, dropped, truncated = correction_ref(name, np.where(VALID, OLD - MU, 0.0), MASK)
  assert dropped.any() or truncated.any()  # the factor bites on this batch
  assert abs(float(out.loss) - reference("ppo")[0]) > 1e-3
  out_none, grad_none = _run(spec, jit)
  np.testing.assert_allclose(out_none.loss, reference("ppo")[0], rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(grad_none, reference("ppo")[1], rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["tis", "icepop"])
def test_at_pi_old_equal_to_pi_the_split_gradient_is_the_full_one(name):
  # pi / mu = (pi / pi_old)(pi_old / mu): with pi_old = pi the PPO factor is 1
  # and unclipped, so the split preset's gradient is the REINFORCE-with-
  # correction gradient on the full ratio.
  _, grad_split = _run(losses.get_spec(f"{name}_old"), old_logp=INPUTS["logp"])
  _, grad_full = _run(losses.get_spec(name))
  np.testing.assert_allclose(grad_split, grad_full, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("name", SEQ_CORRECTIONS + ("mis_token", "tis", "icepop"))
def test_mismatch_factor_on_any_correction(name):
  """``correction_ratio='old'``: the weight reads ``pi_old / mu`` only (a constant in theta)."""
  spec = losses.get_spec(name, correction_ratio="old")
  assert spec.needs_old and not losses.get_spec(name).needs_old
  out, grad = _run(spec, old_logp=_pad(OLD))
  weight, _, _ = correction_ref(_rule(name), np.where(VALID, OLD - MU, 0.0), MASK)
  want_loss, want_grad = _weighted_ref(weight)
  np.testing.assert_allclose(out.loss, want_loss, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-7)


def _fractions_ref(lw, weight, dropped, truncated):
  """The ``corr_*`` metrics of `policy_loss` in float64."""
  rows = VALID.any(-1)
  kept = VALID & ~dropped
  k1, k3 = -lw, np.exp(lw) - 1 - lw
  mean = lambda x, where: x[where].mean() if where.any() else 0.0
  return {
    "corr_token_masked_frac": dropped[VALID].mean(),
    "corr_seq_masked_frac": np.all(dropped | ~VALID, -1)[rows].mean(),
    "corr_token_truncated_frac": truncated[VALID].mean(),
    "corr_seq_truncated_frac": truncated.any(-1)[rows].mean(),
    "corr_weight_mean": weight[VALID].mean(),
    "corr_kl_k1": k1[VALID].mean(),
    "corr_kl_k3": k3[VALID].mean(),
    "corr_kl_k1_kept": mean(k1, kept),
    "corr_kl_k3_kept": mean(k3, kept),
  }


@pytest.mark.parametrize("name", CORRECTIONS)
def test_correction_metrics_against_reference(name):
  """Masked / truncated fractions and the mismatch k1 / k3 before and after, per preset."""
  old = name.endswith("_old")
  out, _ = _run(losses.get_spec(name), **({"old_logp": _pad(OLD)} if old else {}))
  lw = np.where(VALID, (OLD if old else LOGP) - MU, 0.0)
  if name == "opsm":
    seq_kl = (-lw * MASK).sum(-1, keepdims=True) / np.maximum(MASK.sum(-1, keepdims=True), 1)
    dropped = (A_BT < 0) & (seq_kl > 0.1) & VALID
    weight, truncated = np.where(dropped, 0.0, 1.0), np.zeros_like(dropped)
  else:
    weight, dropped, truncated = correction_ref(_rule(name), lw, MASK)
  want = _fractions_ref(lw, weight, dropped, truncated)
  for key, value in want.items():
    np.testing.assert_allclose(out.metrics[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
  assert dropped.any() or truncated.any(), name  # each preset bites on the golden batch
  if dropped.any():
    assert (VALID & ~dropped).any(), name  # ... and keeps something


def test_sequence_rules_and_veto_by_hand():
  """Geometric band [0.5, 2] and veto 0.2 on the golden rows, counted by hand.

  Row geometric means ``exp(mean_t d)``: only row 3 (``exp(3.5 / 3) = 3.2``)
  leaves the band; only row 4 has a token below the veto (``d = -2.2``,
  ``w = 0.11 < 0.2``). Weight 1 elsewhere.
  """
  spec = losses.get_spec("mis_geo", reject_low=0.5, reject_high=2.0, veto_threshold=0.2)
  out, grad = _run(spec)
  keep = np.ones(MASK.shape)
  keep[[3, 4]] = 0.0
  want_loss, want_grad = _weighted_ref(keep)
  np.testing.assert_allclose(out.loss, want_loss, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-7)
  m = out.metrics
  np.testing.assert_allclose(m["corr_reject_seq_frac"], 1 / 8, rtol=1e-6)
  np.testing.assert_allclose(m["corr_reject_token_frac"], 3 / N, rtol=1e-6)
  np.testing.assert_allclose(m["corr_veto_seq_frac"], 1 / 8, rtol=1e-6)
  np.testing.assert_allclose(m["corr_veto_token_frac"], 6 / N, rtol=1e-6)
  np.testing.assert_allclose(m["corr_seq_masked_frac"], 2 / 8, rtol=1e-6)
  np.testing.assert_allclose(m["clip_frac"], 9 / N, rtol=1e-6)
  assert "corr_trm_seq_frac" not in m and "corr_band_seq_frac" not in m


def test_trust_region_statistics_by_hand():
  # Row 6: d = (0.5, 0.8, -0.2, 0.3). k1 mean = -0.35 (kept for any bound >= 0);
  # k3 = (0.148721, 0.425541, 0.018731, 0.049859): max 0.4255, mean 0.1607.
  d = np.array([0.5, 0.8, -0.2, 0.3])
  k3 = np.exp(d) - 1 - d
  np.testing.assert_allclose([k3.max(), k3.mean()], [0.425541, 0.160713], rtol=1e-5)
  cases = (("max", 0.42, True), ("max", 0.43, False), ("mean", 0.16, True), ("mean", 0.17, False))
  for stat, bound, dropped in cases:
    spec = losses.get_spec("tr_mask_k3", trm_stat=stat, trm_bound=bound)
    _, grad = _run(spec)
    assert np.all(grad[6, :4] == 0) == dropped, (stat, bound)
  _, grad = _run(losses.get_spec("tr_mask_k1", trm_bound=0.0))
  assert np.all(grad[6, :4] != 0)


def test_dppo_masks_read_probabilities_not_ratios():
  """Equal ratios, different probabilities: DPPO masks the high-probability token only.

  rho = 3 for both tokens (A > 0): mu = 0.01 gives ``pi - mu = 0.02`` (kept),
  mu = 0.3 gives ``pi - mu = 0.6`` (masked, TV 0.15); PPO's clip treats them
  alike (Qi et al., arXiv 2602.04879).
  """
  mu = np.log(np.array([[0.01], [0.3]], np.float32))
  kw = dict(behavior_logp=mu, advantages=np.ones(2, np.float32), mask=np.ones((2, 1), np.float32))
  for name in ("dppo_tv", "dppo_kl"):
    grad = jax.grad(lambda lp, n=name: losses.policy_loss(n, logp=lp, **kw).loss)(mu + np.log(3.0))
    np.testing.assert_allclose(grad[:, 0], [-3.0 / 2, 0.0], rtol=1e-6)
    ppo = jax.grad(lambda lp: losses.policy_loss("ppo", logp=lp, **kw).loss)(mu + np.log(3.0))
    np.testing.assert_allclose(ppo[:, 0], [0.0, 0.0])


@pytest.mark.parametrize("name, delta", [("dppo_tv", 0.02), ("dppo_kl", 0.01)])
def test_dppo_masks_both_sides_against_reference(name, delta):
  """DPPO loss, gradient and masked fraction with deltas that bite on both signs of A.

  The golden probabilities are small (mu ~ 0.02..0.08), so the preset deltas
  mask only A > 0 tokens there; these deltas give masked and kept tokens on
  the side each A pushes.
  """
  p, q = np.exp(LOGP), np.exp(MU)
  div = (
    np.abs(p - q) if name == "dppo_tv" else q * np.log(q / p) + (1 - q) * np.log((1 - q) / (1 - p))
  )
  for sign, side in ((A_BT > 0, p > q), (A_BT < 0, p < q)):
    assert np.any(VALID & sign & side & (div > delta)), name
    assert np.any(VALID & sign & side & (div <= delta)), name
  out, grad = _run(losses.get_spec(name, dppo_delta=delta))
  keep = _dppo_keep(name, np.where(VALID, LOGP, 0.0), np.where(VALID, MU, 0.0), A_BT, delta)
  want_loss, want_grad = _weighted_ref(np.exp(np.where(VALID, LOGP - MU, 0.0)) * keep)
  np.testing.assert_allclose(out.loss, want_loss, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-7)
  np.testing.assert_allclose(out.metrics["clip_frac"], (~keep)[VALID].mean(), rtol=1e-6)


def test_binary_kl_against_numpy():
  p = np.array([0.01, 0.3, 0.5, 0.9, 0.999], np.float32)
  q = np.array([0.02, 0.1, 0.5, 0.6, 1.0], np.float32)
  with np.errstate(divide="ignore", invalid="ignore"):
    rest = np.where(q < 1, (1 - q) * np.log((1 - q) / (1 - p)), 0.0)
  want = q * np.log(q / p) + rest
  got = losses.shaping.binary_kl(jnp.asarray(p), jnp.asarray(q))
  np.testing.assert_allclose(got, want, rtol=1e-4)


def test_spec_properties_and_validation():
  assert not any(losses.get_spec(n).needs_old for n in ("reinforce", "tis", "decoupled_ppo"))
  assert losses.get_spec("tis", correction_ratio="proximal").needs_proximal
  assert not losses.get_spec("reinforce", correction_ratio="old").needs_old  # nothing reads w
  assert losses.get_spec("ppo", ratio="old").needs_old
  assert losses.get_spec("decoupled_ppo").correction_source == "proximal"
  assert losses.get_spec("tis_old").correction_source == "old"
  for name in CORRECTIONS + ("dppo_tv", "dppo_kl"):
    assert losses.get_spec(name).zero_advantage_inert, name
  bad = (
    ({"veto_threshold": 0.0}, "veto_threshold"),
    ({"reject_low": 2.0, "reject_high": 1.0}, "reject_low"),
    ({"trm_bound": -1.0}, "trm_bound"),
    ({"correction_ratio": "pi"}, "correction_ratio"),
    ({"trm_stat": "median"}, "trm_stat"),
  )
  for overrides, field in bad:
    with pytest.raises(ValueError, match=field):
      losses.get_spec("mis_geo", **overrides)
  with pytest.raises(ValueError, match="level='token'"):
    losses.get_spec("dppo_tv", level="seq_geo", shaping="mask")
  with pytest.raises(ValueError, match="old_logp"):
    losses.policy_loss("tis_old", **dict(INPUTS, old_logp=np.zeros((2, 2), np.float32)))


@pytest.mark.parametrize(
  "overrides,field",
  [
    ({"is_low": 5.0, "is_high": 0.5}, "is_low"),
    ({"is_cap": 0.0}, "is_cap"),
    ({"veto_threshold": 2.0}, "veto_threshold"),
  ],
)
def test_inverted_or_empty_correction_bounds_are_refused(overrides, field):
  with pytest.raises(ValueError, match=f"LossSpec.{field}="):
    losses.get_spec("icepop_old", **overrides)
