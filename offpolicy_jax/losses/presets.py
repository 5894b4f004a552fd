# size: declaration table: every loss preset declared once (_BUILTIN, _CORRECTIONS, _CRITIC_PRESETS)
"""Named loss presets: every method is a `LossSpec`.

``get_spec(name, **overrides)`` returns a preset with overrides applied;
``names()`` lists presets in registration order; ``register`` adds one.
``describe(name)`` gives a one-line summary with the paper,
``default_advantage(name)`` the advantage estimator the preset pairs with
(what a run uses when ``config.advantage.name`` is empty) and
``default_critic(name)`` the critic's estimator (``learn.critic``: ``gae``
for ``ppo_critic`` and ``rec_critic``, ``vtrace`` for ``vtrace`` and
``vtrace_rec``, else ``""``,
no critic; what a run uses when ``config.critic.estimator`` is empty).

Paper-only methods are reconstructions from their descriptions: DISPO (the
default four bounds are illustrative), MinPRO (prefix-minimum ratio inside a
PPO clip), OAPL (squared regression with the behaviour policy as the lagged
policy and the advantage as the regression target), OPSM (threshold value),
Clip-Cov (deterministic top-covariance selection) and BAPO (share measured on
gradient-carrying tokens).

Three presets are reconstructed from their papers' descriptions only (no
reference code was available; paper level only):

- ``gbpo`` (Group-relative Bounded Policy Optimization, "Bounded Ratio
  Reinforcement Learning", arXiv 2604.18578): the analytic optimum of the
  bounded-ratio problem sets the ratio to ``1 + eps`` where the advantage is
  positive and ``1 - eps`` where it is negative; BPO minimises an
  advantage-weighted divergence to it. Assumed: the divergence is the squared
  ratio error ``|A| (rho - rho*)^2 / (2 eps)`` per token (the ``1 / eps``
  makes the on-policy gradient equal REINFORCE's ``-A``), token ratios,
  token-mean aggregation, eps = (0.2, 0.2).
- ``mhpo`` (Modulated Hazard-aware Policy Optimization, arXiv 2603.16929): a
  log-fidelity modulator maps the ratio to a bounded differentiable domain
  and a decoupled hazard penalty regulates up and down shifts separately.
  Assumed: modulator ``exp(c tanh(log rho / c))`` with c = 0.5 in the
  surrogate ``-A * ratio``; hazard = Weibull cumulative hazard
  ``(x / lambda)^k`` of ``max(log rho, 0)`` and ``max(-log rho, 0)`` with
  scales ``log(1 + eps_high)`` and ``-log(1 - eps_low)``, k = 2, weight 0.1.
- ``st_ppo`` (turn-level importance ratios for multi-turn agents): PPO clip
  on ``exp(mean of log rho over the tokens of a turn)`` with the turn-mean
  advantage. Assumed: eps = (0.2, 0.2), token-mean aggregation, no further
  clipping-bias correction; turns come from ``policy_loss(turn_ids=...)`` and
  default to one turn per sequence.
"""

from offpolicy_jax import advantages, errors
from offpolicy_jax.losses.spec import LossSpec

_PPO = dict(shaping="clip", grad="ratio")
_ONE_SIDE = dict(shaping="mask", mask_kind="one_side")
_TWO_SIDE = dict(shaping="mask", mask_kind="two_side")
_RING = dict(shaping="mask", mask_kind="ring")
_GSPO = dict(_PPO, eps_low=3e-4, eps_high=4e-4, agg="seq_mean_token_mean")

_BUILTIN: tuple[tuple[str, dict, str, str], ...] = (
  ("reinforce", {}, "group_mean", "-A * logp; no trust region (Williams 1992)."),
  (
    "remax",
    {},
    "remax",
    "-A * logp, A = r - r(greedy): each group's first response is decoded greedily as the "
    "baseline and not trained on (Li et al., ReMax, arXiv 2310.10505).",
  ),
  (
    "remax_rec",
    _ONE_SIDE,
    "remax",
    "ReMax's advantage (r - r(greedy)) under REC-OneSide-NoIS's mask: -A sg(M) logp, M drops "
    "tokens whose pi / mu left [0.8, 1.2] on the side A pushes (ReMax with a trust region).",
  ),
  (
    "grpo",
    _PPO,
    "grpo",
    "PPO clip (0.2, 0.2) on token ratios; pair with the 'grpo' advantage "
    "(Shao et al., DeepSeekMath, arXiv 2402.03300).",
  ),
  ("ppo", _PPO, "grpo", "max(-A rho, -A clip(rho, 0.8, 1.2)) (Schulman et al., arXiv 1707.06347)."),
  (
    "dual_clip",
    dict(_PPO, dual_clip_c=3.0),
    "grpo",
    "PPO clip, loss capped at -c A for A < 0, c = 3 (Ye et al., arXiv 1912.09729).",
  ),
  (
    "rec_oneside_is",
    dict(_ONE_SIDE, weight="ratio"),
    "group_mean",
    "REC one-side mask with IS weight: the PPO-clip gradient (Yao et al., arXiv 2509.24203).",
  ),
  (
    "rec_oneside_nois",
    _ONE_SIDE,
    "group_mean",
    "REC one-side mask, no IS weight; the recommended REC loss (arXiv 2509.24203).",
  ),
  (
    "rec_oneside_nois_wide",
    dict(_ONE_SIDE, eps_low=0.6, eps_high=2.0),
    "group_mean",
    "REC-OneSide-NoIS with the wide band (0.6, 2.0) (arXiv 2509.24203).",
  ),
  (
    "rec_twoside_is",
    dict(_TWO_SIDE, weight="ratio"),
    "group_mean",
    "REC two-side mask, IS weight.",
  ),
  ("rec_twoside_nois", _TWO_SIDE, "group_mean", "REC two-side mask, no IS weight."),
  (
    "rec_ring_is",
    dict(_RING, weight="ratio"),
    "group_mean",
    "REC ring mask: band (0.2, 0.2) plus outer rings beyond (0.6, 2.0), IS weight.",
  ),
  ("rec_ring_nois", _RING, "group_mean", "REC ring mask, no IS weight."),
  (
    "opmd",
    dict(reg="k2", reg_coef=0.1),
    "group_mean",
    "REINFORCE + c (logp - logp_mu)^2, c = 0.1 (Kimi k1.5, arXiv 2501.12599; REC reading).",
  ),
  (
    "asymre",
    dict(reg="forward_kl", reg_coef=0.1),
    "group_mean",
    "REINFORCE - c logp, c = 0.1: baseline lowered by c (Arnal et al., AsymRE).",
  ),
  (
    "red_weight",
    dict(adv_weight="exp"),
    "group_mean",
    "REINFORCE with weight exp(A / temp) (arXiv 2509.24203).",
  ),
  (
    "cispo",
    dict(shaping="truncate", eps_low=1.0, eps_high=0.28),
    "group_mean",
    "-sg(clip(rho, 0, 1.28)) A logp: bounded, never zero gradient (MiniMax-M1, arXiv 2506.13585).",
  ),
  (
    "dispo",
    dict(shaping="truncate", eps_low=1.0, eps_high=0.28, eps_low_neg=0.2, eps_high_neg=1.0),
    "group_mean",
    "CISPO with separate weight bounds for A > 0 [0, 1.28] and A < 0 [0.8, 2.0] "
    "(reconstruction; bounds illustrative).",
  ),
  (
    "gspo",
    dict(_GSPO, level="seq_geo"),
    "grpo",
    "PPO clip on the geometric-mean sequence ratio, seq-mean (Zheng et al., arXiv 2507.18071).",
  ),
  (
    "gspo_token",
    dict(_GSPO, level="seq_geo_token"),
    "grpo",
    "GSPO-token: PPO clip on sg(s_i) pi / sg(pi) with token advantages A_it, seq-mean; "
    "equals gspo when A is constant per sequence (arXiv 2507.18071).",
  ),
  (
    "gmpo",
    dict(
      level="seq_geo",
      shaping="log_clip",
      grad="ratio",
      eps_low=0.4,
      eps_high=0.4,
      agg="seq_mean_token_mean",
    ),
    "grpo",
    "Sign-aware clip of log rho to (-0.4, 0.4), then exp(mean) (Zhao et al., GMPO, "
    "arXiv 2507.20673).",
  ),
  (
    "topr",
    dict(shaping="topr"),
    "group_mean",
    "A >= 0: -A logp; A < 0: -sg(clip(rho, 0, 1)) A logp on token ratios; the paper's "
    "trajectory ratio is level='seq_prod' (Le Roux et al., TOPR, arXiv 2503.14286).",
  ),
  (
    "sapo",
    dict(shaping="soft_gate", grad="ratio", tau_pos=1.0, tau_neg=1.05, agg="seq_mean_token_mean"),
    "grpo",
    "Soft gate -A sigmoid(tau (rho - 1)) 4 / tau, tau by sign of A, seq-mean (Gao et al., "
    "Qwen, SAPO, arXiv 2511.20347).",
  ),
  (
    "tis",
    dict(correction="truncate", is_cap=2.0),
    "group_mean",
    "REINFORCE with truncated IS weight min(rho, C), C = 2 (Yao et al., TIS; the paper's "
    "form, on pi_old / mu with PPO on pi / pi_old, is tis_old).",
  ),
  (
    "icepop",
    dict(correction="mask", is_low=0.5, is_high=5.0),
    "group_mean",
    "REINFORCE with IS weight rho inside [0.5, 5], zero outside (Ling team, IcePop, arXiv "
    "2510.18855; the paper's form, on pi_old / mu with PPO on pi / pi_old, is icepop_old).",
  ),
  (
    "decoupled_ppo",
    dict(_PPO, ratio="decoupled", correction="is"),
    "group_mean",
    "sg(prox / mu) * PPO-clip(pi / prox); needs proximal_logp (Hilton et al., arXiv 2110.00641).",
  ),
  (
    "m2po",
    dict(_TWO_SIDE, grad="ratio", adaptive="m2po", m2po_budget=0.04),
    "group_mean",
    "Mask tokens with |log rho| > tau, tau the largest keeping E[(log rho)^2] <= 0.04 (M2PO).",
  ),
  (
    "m2po_release",
    dict(_PPO, adaptive="m2po_capped", m2po_budget=0.04, eps_low=0.3, eps_high=0.5),
    "grpo",
    "M2PO as released: PPO clip to [min(e^-tau, 0.7), max(e^tau, 1.5)], tau capping the "
    "harmful tokens' E[min((log rho)^2, tau^2)] at 0.04; GRPO's advantage (Infini-AI-Lab/M2PO).",
  ),
  (
    "bapo",
    dict(_PPO, adaptive="bapo", eps_low=0.4, eps_high=0.2),
    "group_mean",
    "PPO clip with bounds raised per batch from (0.6, 1.2) to at most (0.8, 2.0) until "
    "positive tokens carry >= 40% (BAPO; search details reconstructed).",
  ),
  (
    "minpro",
    dict(_PPO, level="prefix_min"),
    "group_mean",
    "PPO clip on the prefix-minimum ratio min_{s<=t} rho_s (MinPRO; reconstruction).",
  ),
  (
    "oapl",
    dict(level="seq_prod", shaping="regression", grad="ratio", agg="seq_mean_token_mean"),
    "opmd",
    "0.5 (beta log(pi / mu)(y) - A)^2 with A = r - beta log mean exp(r / beta), the 'opmd' "
    "advantage (OAPL; reconstruction).",
  ),
  (
    "opsm",
    dict(_PPO, seq_filter="opsm", opsm_delta=0.1),
    "group_mean",
    "PPO clip; drop sequences with A < 0 and mean(logp_mu - logp) > delta (DeepSeek-V3.2 "
    "off-policy sequence masking; delta reconstructed).",
  ),
  (
    "clip_cov",
    dict(grad="ratio", cov="clip", cov_frac=2e-4),
    "group_mean",
    "-A rho; detach the top 0.02% tokens by cov(logp, A) (Cui et al., arXiv 2505.22617).",
  ),
  (
    "kl_cov",
    dict(grad="ratio", cov="kl", cov_frac=2e-3, cov_coef=1.0),
    "group_mean",
    "-A rho + |logp - logp_mu| on the top 0.2% tokens by cov(logp, A) (arXiv 2505.22617).",
  ),
  (
    "dapo",
    dict(_PPO, eps_low=0.2, eps_high=0.28),
    "grpo",
    "PPO clip (0.2, 0.28), global token-mean (Yu et al., arXiv 2503.14476); group filtering "
    "and the overlong penalty live in the data / reward pipeline.",
  ),
  (
    "gbpo",
    dict(shaping="bounded_target", grad="ratio"),
    "group_mean",
    "|A| (rho - rho*)^2 / (2 eps), rho* = 1 + eps_high if A > 0 else 1 - eps_low: regress "
    "the ratio onto the bounded-ratio optimum (GBPO, Bounded Ratio RL, arXiv 2604.18578; "
    "paper-level reconstruction).",
  ),
  (
    "mhpo",
    dict(shaping="log_bound", grad="ratio", log_bound=0.5, reg="hazard", reg_coef=0.1),
    "group_mean",
    "-A exp(c tanh(log rho / c)), c = 0.5, plus 0.1 x Weibull (k = 2) hazard of the up / down "
    "log-ratio shift (MHPO, arXiv 2603.16929; paper-level reconstruction).",
  ),
  (
    "st_ppo",
    dict(_PPO, level="turn_geo"),
    "group_mean",
    "PPO clip (0.2, 0.2) on the per-turn geometric-mean ratio with the turn-mean advantage, "
    "token-mean (ST-PPO turn-level ratios; pass turn_ids; paper-level reconstruction).",
  ),
)

# The rollout-correction family (docs/science.md s7; formulas and sources in
# `corrections` and `shaping.tv_mask`). Thresholds of tr_mask_* are illustrative.
_CORRECTIONS: tuple[tuple[str, dict, str, str], ...] = (
  (
    "tis_seq",
    dict(correction="truncate", correction_level="seq", is_cap=2.0),
    "group_mean",
    "REINFORCE with sequence TIS weight min(exp(sum_t log(pi / mu)), C), C = 2, on every "
    "token of the row (sequence-level TIS, verl#3694).",
  ),
  (
    "tis_old",
    dict(_PPO, ratio="old", correction="truncate", is_cap=2.0),
    "group_mean",
    "sg(min(pi_old / mu, C)) * PPO-clip(pi / pi_old), C = 2: TIS on the engine-mismatch factor "
    "only; needs old_logp (Yao et al., TIS, 2025).",
  ),
  (
    "icepop_old",
    dict(_PPO, ratio="old", correction="mask", is_low=0.5, is_high=5.0),
    "group_mean",
    "PPO-clip(pi / pi_old) times pi_old / mu inside [0.5, 5], zero outside: IcePop on the "
    "mismatch factor; needs old_logp (Ling team, arXiv 2510.18855).",
  ),
  (
    "mis_token",
    dict(correction="mask", is_low=0.125, is_high=8.0),
    "group_mean",
    "REINFORCE with token IS weight w inside [0.125, 8], zero outside: masked IS with "
    "prime-rl's band (verl#2953 / #3694).",
  ),
  (
    "mis_seq",
    dict(correction="is", reject="seq_any", reject_low=0.125, reject_high=8.0),
    "group_mean",
    "REINFORCE with token IS weight w_t; drop a row if any w_t leaves [0.125, 8] (min/max "
    "rule; verl#3694).",
  ),
  (
    "mis_geo",
    dict(reject="seq_geo", reject_low=0.999, reject_high=1.001, veto_threshold=1e-4),
    "group_mean",
    "REINFORCE; drop a row if exp(mean_t log w_t) leaves [0.999, 1.001] or any w_t < 1e-4 "
    "(geometric sequence masking with veto, trl#4891, verl#3984).",
  ),
  (
    "tr_mask_k3",
    dict(correction="is", trm="k3", trm_stat="max", trm_bound=0.05),
    "group_mean",
    "REINFORCE with token IS weight w_t; drop a row if max_t (w_t - 1 - log w_t) > 0.05 "
    "(trust region masking, arXiv 2512.23075, verl#4544; bound illustrative).",
  ),
  (
    "tr_mask_k1",
    dict(correction="is", trm="k1", trm_stat="mean", trm_bound=1e-3),
    "group_mean",
    "REINFORCE with token IS weight w_t; drop a row if mean_t (-log w_t) > 1e-3 (trust "
    "region masking, k1 mean, arXiv 2512.23075, verl#4544; bound illustrative).",
  ),
  (
    "dppo_tv",
    dict(shaping="mask", mask_kind="tv", weight="ratio", dppo_delta=0.15),
    "group_mean",
    "-A sg(rho M) logp, M drops A > 0 with pi - mu > 0.15 and A < 0 with mu - pi > 0.15 "
    "(DPPO binary TV, Qi et al., arXiv 2602.04879).",
  ),
  (
    "dppo_kl",
    dict(shaping="mask", mask_kind="binary_kl", weight="ratio", dppo_delta=0.05),
    "group_mean",
    "-A sg(rho M) logp, M drops tokens whose binary KL(mu || pi) over {a, not a} > 0.05 on "
    "the side A pushes (DPPO binary KL, Qi et al., arXiv 2602.04879).",
  ),
)

# Presets whose advantages come from a critic (`learn.critic`), and its estimator.
_CRITIC_PRESETS: tuple[tuple[str, dict, str, str], ...] = (
  (
    "ppo_critic",
    _PPO,
    "gae",
    "PPO clip (0.2, 0.2) with a learned critic: GAE(gamma, lambda) token advantages, whitened, "
    "a clipped value loss, and PPO-max's token-level KL and normalised rewards (Zheng et al., "
    "'Secrets of RLHF', arXiv 2307.04964; critic.kl_coef, critic.reward_norm).",
  ),
  (
    "vtrace",
    {},
    "vtrace",
    "-A logp with A the V-trace advantage min(rho_bar, rho)(r + gamma v_s' - V) of a learned "
    "critic, trained to the v_s targets (IMPALA, Espeholt et al., arXiv 1802.01561).",
  ),
  (
    "vtrace_rec",
    _ONE_SIDE,
    "vtrace",
    "V-trace's advantages and critic under REC-OneSide-NoIS's mask: -A sg(M) logp, M drops "
    "tokens whose pi / mu left [0.8, 1.2] on the side A pushes (vtrace with a trust region).",
  ),
  (
    "rec_critic",
    _ONE_SIDE,
    "gae",
    "REC-OneSide-NoIS with a critic baseline: the one-side mask on GAE token advantages "
    "instead of the group's (Yao et al., arXiv 2509.24203; critic as ppo_critic).",
  ),
)

_REGISTRY: dict[str, LossSpec] = {}
_ADVANTAGES: dict[str, str] = {}
_CRITICS: dict[str, str] = {}
_DOCS: dict[str, str] = {}


def register(
  name: str,
  spec: LossSpec,
  description: str = "",
  *,
  advantage: str = "group_mean",
  critic: str = "",
  overwrite: bool = False,
) -> None:
  """Adds a named preset.

  Args:
    name: preset name (snake case).
    spec: the `LossSpec`.
    description: one line for ``describe``.
    advantage: the advantage estimator the preset pairs with by default (one
      of ``advantages.names()``); a run's ``config.advantage.name`` overrides it.
    critic: the critic's estimator the preset pairs with (``gae``, ``vtrace``;
      ``""``: none); a run's ``config.critic.estimator`` overrides it.
    overwrite: allow replacing an existing preset.

  Raises:
    ValueError: the name exists and ``overwrite`` is False, spec is not a
      LossSpec, or the advantage name is unknown.
  """
  if not isinstance(spec, LossSpec):
    raise ValueError(f"spec for {name!r} must be a LossSpec; got {type(spec).__name__}")
  if name in _REGISTRY and not overwrite:
    raise ValueError(f"loss preset {name!r} already registered (pass overwrite=True)")
  if advantage not in advantages.names():
    raise ValueError(
      f"advantage {advantage!r} for loss preset {name!r} is unknown; known: {advantages.names()}"
    )
  if critic not in ("", "gae", "vtrace"):
    raise ValueError(f"critic {critic!r} for loss preset {name!r}: expected '', 'gae' or 'vtrace'")
  _REGISTRY[name] = spec
  _ADVANTAGES[name] = advantage
  _CRITICS[name] = critic
  _DOCS[name] = description


for _name, _fields, _advantage, _doc in _BUILTIN + _CORRECTIONS:
  register(_name, LossSpec(**_fields), _doc, advantage=_advantage)
for _name, _fields, _critic, _doc in _CRITIC_PRESETS:
  register(_name, LossSpec(**_fields), _doc, critic=_critic)


def names() -> list[str]:
  """Every registered preset name, in registration order."""
  return list(_REGISTRY)


def describe(name: str) -> str:
  """One-line summary of a preset (formula and paper)."""
  get_spec(name)
  return _DOCS[name]


def default_advantage(name: str) -> str:
  """The advantage estimator preset ``name`` pairs with when none is configured.

  ``grpo`` (mean / std) for the PPO-clip family that uses it in its paper
  (grpo, ppo, dual_clip, dapo, gspo, gspo_token, gmpo, sapo), ``opmd`` for
  OAPL's regression target, and the plain group mean (REC family, Dr. GRPO)
  otherwise.

  Raises:
    ValueError: unknown preset.
  """
  get_spec(name)
  return _ADVANTAGES[name]


def default_critic(name: str) -> str:
  """The critic's estimator preset ``name`` pairs with (``gae``, ``vtrace``; ``""``: none).

  Raises:
    ValueError: unknown preset.
  """
  get_spec(name)
  return _CRITICS[name]


def get_spec(name: str, **overrides) -> LossSpec:
  """The preset ``name`` with ``overrides`` (any `LossSpec` field) applied.

  Raises:
    ValueError: unknown preset (the message lists the names), unknown
      override, or an invalid value (e.g. ``eps_low < 0``).
  """
  if name not in _REGISTRY:
    near = errors.did_you_mean(name, _REGISTRY)
    hint = f" ({near})" if near else ""
    raise ValueError(f"Unknown loss preset {name!r}{hint}; known presets: {', '.join(_REGISTRY)}")
  spec = _REGISTRY[name]
  return spec.replace(**overrides) if overrides else spec
