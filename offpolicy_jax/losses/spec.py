"""`LossSpec`: the independent axes of a composable policy loss.

Every policy loss in this package is "REINFORCE with a per-token coefficient
plus a regulariser" (Yao et al., "Group-relative REINFORCE is secretly an
off-policy algorithm", arXiv 2509.24203). A spec picks one value on each axis:

1. ``ratio``: which ratio the trust region acts on. ``behavior``
   (``rho = pi / mu``), ``proximal`` (``pi / prox``), ``decoupled``
   (``pi / prox`` for the trust region, ``prox / mu`` as a rollout correction)
   or ``old`` (``pi / pi_old``, ``pi_old`` the behaviour version's parameters
   scored by the learner: the staleness factor of docs/science.md s7).
2. ``level``: granularity of the ratio. ``token``; ``seq_prod``
   (``exp(sum_t log rho_t)``); ``seq_geo`` (``exp(mean_t log rho_t)``, GSPO);
   ``seq_geo_token`` (GSPO-token: ``s_it = sg(s_i) pi_t / sg(pi_t)``, value
   ``s_i``, gradient through each token); ``prefix_min``
   (``min_{s <= t} rho_s``, MinPRO); ``turn_geo`` (geometric mean over the
   tokens of one turn, ST-PPO; ``turn_ids``). ``seq_prod`` and ``seq_geo``
   use the sequence-mean advantage and ``turn_geo`` the turn mean; the other
   levels keep the token advantages ``A_it``.
3. ``shaping``: ``none``; ``clip`` (PPO clip, optional dual clip); ``mask``
   (``mask_kind`` one_side / two_side / ring, or DPPO's ``tv`` /
   ``binary_kl`` divergence masks); ``truncate`` (bounded weight,
   CISPO / DISPO); ``topr``; ``soft_gate`` (SAPO); ``log_clip`` (GMPO);
   ``regression`` (OAPL squared regression); ``bounded_target`` (GBPO);
   ``log_bound`` (MHPO's bounded log-ratio).
4. ``grad``: ``logp`` (``-A * sg(w) * logp``) or ``ratio`` (surrogate of a
   differentiable ratio, ``grad rho = rho * grad logp``).
5. extra weights: ``weight`` (``one`` / ``ratio``), ``adv_weight`` (``exp``:
   RED-Weight), and the rollout-correction family (``corrections``), all on
   ``w = pi_x / mu`` with ``pi_x`` chosen by ``correction_ratio``:
   ``correction`` (IS weight: ``is``, ``truncate`` TIS, ``mask`` IcePop / MIS)
   at ``correction_level`` token / seq; ``reject`` (rejection: ``token``,
   ``seq_any`` min/max rule, ``seq_geo`` geometric-mean band); a veto
   (``veto_threshold``); trust-region masking (``trm`` k1 / k3, ``trm_stat``
   max / mean); and ``seq_filter`` (``opsm``).
6. regularisers: ``reg`` (``k2`` / ``forward_kl`` towards mu, ``hazard``:
   MHPO's cumulative-hazard penalty on the token log-ratio), KL to a
   reference (``kl_coef``, ``kl_kind``), entropy bonus (``entropy_coef``);
   batch-level shapers ``adaptive`` (``m2po``, ``m2po_capped``, ``bapo``) and ``cov``
   (``clip`` / ``kl``: Clip-Cov / KL-Cov).
7. ``agg``: ``token_mean``, ``seq_mean_token_mean``, ``seq_mean_token_sum``,
   ``seq_mean_token_sum_norm``.
"""

import dataclasses

_CHOICES = {
  "ratio": ("behavior", "proximal", "decoupled", "old"),
  "level": ("token", "seq_prod", "seq_geo", "seq_geo_token", "prefix_min", "turn_geo"),
  "shaping": (
    "none",
    "clip",
    "mask",
    "truncate",
    "topr",
    "soft_gate",
    "log_clip",
    "regression",
    "bounded_target",
    "log_bound",
  ),
  "mask_kind": ("one_side", "two_side", "ring", "tv", "binary_kl"),
  "grad": ("logp", "ratio"),
  "weight": ("one", "ratio"),
  "adv_weight": ("none", "exp"),
  "correction": ("none", "is", "truncate", "mask"),
  "correction_level": ("token", "seq"),
  "correction_ratio": ("auto", "current", "proximal", "old"),
  "reject": ("none", "token", "seq_any", "seq_geo"),
  "trm": ("none", "k1", "k3"),
  "trm_stat": ("max", "mean"),
  "adaptive": ("none", "m2po", "m2po_capped", "bapo"),
  "cov": ("none", "clip", "kl"),
  "seq_filter": ("none", "opsm"),
  "reg": ("none", "k2", "forward_kl", "hazard"),
  "kl_kind": ("k1", "k2", "k3", "abs"),
  "agg": (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
  ),
}

# Fields that must be >= 0 when set.
_NON_NEGATIVE = (
  "eps_low",
  "eps_high",
  "eps_low_prime",
  "eps_high_prime",
  "eps_low_neg",
  "eps_high_neg",
  "dual_clip_c",
  "reg_coef",
  "kl_coef",
  "entropy_coef",
  "is_cap",
  "is_low",
  "is_high",
  "m2po_budget",
  "bapo_step_low",
  "bapo_step_high",
  "bapo_target",
  "opsm_delta",
  "reject_low",
  "reject_high",
  "trm_bound",
  "dppo_delta",
  "cov_frac",
  "cov_coef",
)
_POSITIVE = ("temp", "tau_pos", "tau_neg", "beta", "log_bound")


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """A composable policy loss; hashable, so it can be a static jit argument.

  Per token (``sg`` = stop-gradient, ``rho`` the chosen ratio):
  ``loss_t = pg_t(rho, A) + R_t``, with ``pg_t`` from the shaping and gradient
  path axes, times the extra weights, and ``R_t`` the regularisers. Per-token
  losses are reduced to ``(sum, count)`` by ``agg``. See the module docstring
  for the axes; the scalar knobs are:

  Attributes:
    eps_low, eps_high: ratio band ``[1 - eps_low, 1 + eps_high]`` (for
      ``log_clip``: the band on ``log rho`` is ``[-eps_low, eps_high]``).
    eps_low_neg, eps_high_neg: band for tokens with A < 0 (DISPO); ``None``
      means the same as for A >= 0.
    eps_low_prime, eps_high_prime: outer ring of the ``ring`` mask.
    dual_clip_c: dual-clip constant (caps the loss at ``-c * A`` for A < 0);
      ``None`` disables it.
    reg_coef: coefficient ``c`` of the ``k2`` / ``forward_kl`` / ``hazard``
      regulariser. The ``k2`` regulariser is ``c (l - l_mu)^2`` as in the REC
      paper's OPMD reading (no 1/2, unlike the ``k2`` KL estimator ``d^2 / 2``).
    log_bound: MHPO bound ``c``: the ratio seen is ``exp(c tanh(log rho / c))``.
    hazard_shape: Weibull shape ``k >= 1`` of the ``hazard`` penalty
      ``c ((d+ / log(1 + eps_high))^k + (d- / -log(1 - eps_low))^k)``.
    kl_coef, kl_kind, kl_straight_through: KL penalty to ``ref_logp`` in the
      loss, estimator kind, and straight-through gradient (k2 gradient).
    entropy_coef: entropy bonus coefficient (needs ``entropy=``).
    temp: RED-Weight temperature: weight ``exp(A / temp)``.
    tau_pos, tau_neg: SAPO gate temperatures for A > 0 and A < 0.
    beta: OAPL temperature.
    is_cap: TIS truncation constant ``C`` (``min(w, C)``).
    is_low, is_high: IcePop / MIS band ``[is_low, is_high]`` on the rollout
      correction weight.
    correction_ratio: numerator of the correction-family weight
      ``w = pi_x / mu``: ``current`` (``sg(pi_theta)``), ``proximal``
      (``prox``), ``old`` (``pi_old``, the engine-mismatch factor; needs
      ``old_logp``, which defaults to ``mu``), or ``auto``: ``current`` for
      ``ratio='behavior'``, ``old`` for ``ratio='old'``, ``proximal``
      otherwise.
    reject_low, reject_high: rejection band on ``w_t`` (``reject`` token /
      seq_any) or on ``exp(mean_t log w_t)`` (``reject='seq_geo'``).
    veto_threshold: drop a sequence if any ``w_t < veto_threshold``; ``None``
      disables the veto.
    trm_bound: trust-region masking bound on the sequence statistic
      (``trm_stat`` max / mean) of the per-token k1 / k3 estimate.
    dppo_delta: DPPO threshold on the binary TV ``|pi - mu|`` or binary KL
      (``mask_kind`` tv / binary_kl).
    m2po_budget: M2PO bound on the second moment of ``log rho``.
    bapo_low_max, bapo_high_max, bapo_step_low, bapo_step_high, bapo_target:
      BAPO bound search (absolute ratio bounds start at ``1 - eps_low`` and
      ``1 + eps_high``).
    opsm_delta: OPSM threshold on the per-sequence mean of ``l_mu - l``.
    cov_frac, cov_coef: Clip-Cov / KL-Cov selected token fraction and KL-Cov
      penalty coefficient.
    max_len: normaliser for ``seq_mean_token_sum_norm``; ``None`` uses T.
  """

  ratio: str = "behavior"
  level: str = "token"
  shaping: str = "none"
  mask_kind: str = "one_side"
  grad: str = "logp"
  weight: str = "one"
  adv_weight: str = "none"
  correction: str = "none"
  correction_level: str = "token"
  correction_ratio: str = "auto"
  reject: str = "none"
  trm: str = "none"
  trm_stat: str = "max"
  adaptive: str = "none"
  cov: str = "none"
  seq_filter: str = "none"
  reg: str = "none"
  kl_kind: str = "k3"
  kl_straight_through: bool = False
  agg: str = "token_mean"
  eps_low: float = 0.2
  eps_high: float = 0.2
  eps_low_neg: float | None = None
  eps_high_neg: float | None = None
  eps_low_prime: float = 0.6
  eps_high_prime: float = 2.0
  dual_clip_c: float | None = None
  reg_coef: float = 0.0
  log_bound: float = 0.5
  hazard_shape: float = 2.0
  kl_coef: float = 0.0
  entropy_coef: float = 0.0
  temp: float = 1.0
  tau_pos: float = 1.0
  tau_neg: float = 1.05
  beta: float = 1.0
  is_cap: float = 2.0
  is_low: float = 0.5
  is_high: float = 5.0
  m2po_budget: float = 0.04
  bapo_low_max: float = 0.8
  bapo_high_max: float = 2.0
  bapo_step_low: float = 0.05
  bapo_step_high: float = 0.2
  bapo_target: float = 0.4
  opsm_delta: float = 0.1
  reject_low: float = 0.125
  reject_high: float = 8.0
  veto_threshold: float | None = None
  trm_bound: float = 0.05
  dppo_delta: float = 0.15
  cov_frac: float = 2e-4
  cov_coef: float = 1.0
  max_len: int | None = None

  def __post_init__(self):
    for field, choices in _CHOICES.items():
      if getattr(self, field) not in choices:
        raise ValueError(f"LossSpec.{field}={getattr(self, field)!r}; expected one of {choices}")
    for field in _NON_NEGATIVE:
      value = getattr(self, field)
      if value is not None and value < 0:
        raise ValueError(f"LossSpec.{field}={value} must be >= 0")
    for field in _POSITIVE:
      if getattr(self, field) <= 0:
        raise ValueError(f"LossSpec.{field}={getattr(self, field)} must be > 0")
    if self.max_len is not None and self.max_len <= 0:
      raise ValueError(f"LossSpec.max_len={self.max_len} must be > 0")
    if self.shaping == "log_clip" and self.level != "seq_geo":
      raise ValueError("LossSpec.shaping='log_clip' requires level='seq_geo'")
    ratio_shapings = ("clip", "soft_gate", "log_clip", "regression", "bounded_target", "log_bound")
    if self.shaping in ratio_shapings and self.grad != "ratio":
      raise ValueError(f"LossSpec.shaping={self.shaping!r} requires grad='ratio'")
    if self.shaping in ("truncate", "topr") and self.grad != "logp":
      raise ValueError(f"LossSpec.shaping={self.shaping!r} requires grad='logp'")
    if self.shaping == "bounded_target" and min(self.eps_low, self.eps_high) <= 0:
      raise ValueError("LossSpec.eps_low and eps_high must be > 0 for shaping='bounded_target'")
    if self.reject_low > self.reject_high:
      raise ValueError(
        f"LossSpec.reject_low={self.reject_low} must be <= reject_high={self.reject_high}"
      )
    if self.veto_threshold is not None and not 0 < self.veto_threshold < 1:
      raise ValueError(f"LossSpec.veto_threshold={self.veto_threshold} must be in (0, 1) or None")
    if not self.is_low <= self.is_high:
      raise ValueError(f"LossSpec.is_low={self.is_low} must be <= is_high={self.is_high}")
    if not self.is_cap > 0:
      raise ValueError(f"LossSpec.is_cap={self.is_cap} must be > 0")
    if self.shaping == "mask" and self.mask_kind in ("tv", "binary_kl") and self.level != "token":
      raise ValueError(f"LossSpec.mask_kind={self.mask_kind!r} requires level='token'")
    if self.reg == "hazard":
      if not 0 < self.eps_low < 1 or self.eps_high <= 0:
        raise ValueError("LossSpec.eps_low must be in (0, 1) and eps_high > 0 for reg='hazard'")
      if self.hazard_shape < 1:
        raise ValueError(f"LossSpec.hazard_shape={self.hazard_shape} must be >= 1")

  @property
  def correction_source(self) -> str:
    """Numerator of the correction weight ``w = pi_x / mu``: current, proximal or old."""
    if self.correction_ratio != "auto":
      return self.correction_ratio
    return {"behavior": "current", "old": "old"}.get(self.ratio, "proximal")

  @property
  def reads_correction_weight(self) -> bool:
    """Whether a correction-family option reads ``w`` (IS weight, rejection, veto, TRM)."""
    return (
      self.correction != "none"
      or self.reject != "none"
      or self.veto_threshold is not None
      or self.trm != "none"
    )

  @property
  def needs_proximal(self) -> bool:
    """Whether ``policy_loss`` needs ``proximal_logp``."""
    if self.ratio in ("proximal", "decoupled"):
      return True
    return self.reads_correction_weight and self.correction_source == "proximal"

  @property
  def needs_old(self) -> bool:
    """Whether ``policy_loss`` reads ``old_logp`` (``pi_old``; it defaults to ``mu``).

    True for ``ratio='old'`` (trust region on ``pi / pi_old``) and for a
    correction-family option whose weight is the mismatch factor
    ``pi_old / mu`` (``correction_source == 'old'``).
    """
    if self.ratio == "old":
      return True
    return self.reads_correction_weight and self.correction_source == "old"

  @property
  def needs_ref(self) -> bool:
    """Whether ``policy_loss`` needs ``ref_logp``."""
    return self.kl_coef > 0

  @property
  def batch_dependent(self) -> bool:
    """Whether a token's loss depends on other sequences of the same call.

    True for the per-batch searches (M2PO, BAPO) and covariance selection
    (Clip-Cov, KL-Cov): micro-batch accumulation is then exact only per call.
    """
    return self.adaptive != "none" or self.cov != "none"

  @property
  def zero_advantage_inert(self) -> bool:
    """Whether a sequence whose advantages are all 0 has exactly zero loss and gradient.

    True when every per-token term carries a factor of ``A`` (or ``|A|``) and
    nothing couples sequences: no regulariser (``reg``, KL to a reference,
    entropy bonus), no batch-level search or selection (``batch_dependent``),
    and not OAPL's regression ``(beta log rho - A)^2``. The rollout-correction
    family (IS weight, rejection, veto, trust-region masking, OPSM, DPPO's
    masks) only multiplies terms that carry ``A`` and reads one row at a time
    (sequence-level rules included), so it keeps a loss inert. Such sequences
    still count in the aggregation's denominator, which depends on the mask
    only, so the train step can leave them out of the forward pass exactly.
    """
    return (
      self.shaping != "regression"
      and self.reg == "none"
      and self.kl_coef == 0
      and self.entropy_coef == 0
      and not self.batch_dependent
    )

  def replace(self, **overrides) -> "LossSpec":
    """Returns a copy with ``overrides``; unknown names raise ValueError."""
    known = {f.name for f in dataclasses.fields(self)}
    for name in overrides:
      if name not in known:
        raise ValueError(f"Unknown loss override {name!r}; known: {sorted(known)}")
    return dataclasses.replace(self, **overrides)
