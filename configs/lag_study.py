"""The lag study of arXiv:2509.24203: methods x lag schedules x seeds, with statistics.

  python -m experiments.study --config=configs/lag_study.py --workdir=/tmp/lag_study

writes `study.md` (tables with 95% t intervals, verdicts against GRPO
on-policy from paired sign-flip permutation tests with Holm's correction and
equivalence tests against `study.equivalence_margin`,
learning speed within each lag, the A/A calibration's false-verdict rate;
docs/lag_and_study.md), `study.csv` (one row per run and metric) and plots
(`curves_<lag>.png`, `final.png`); killed and rerun, it runs the missing cells
only. Every run with a given seed starts from the same supervised warm start
and reads the same prompts; the seeds of a cell run together under `jax.vmap`.

Cost on a 2-core CPU (toy scale): the `reverse` task with the tiny decoder,
8 prompts x 8 samples, 200 steps per run, 12 seeds per cell (why:
`c.study.seeds` below); the 12 warm starts take about 3 minutes and a cell of
12 seeds about a minute, so the default grid is 8 methods (`METHODS`) x 5
lags plus GRPO's A/A twin at the 5 lags, 45 cells (its measured time is in
docs/results/lag_study.md); `:toy_full` runs all 16 methods. The step count is
enough for lag to separate the methods (REINFORCE collapses within 50 steps
of stale data) and, from the distractor warm start, for on-policy GRPO to
gain +0.181 greedy accuracy over 12 seeds, 95% t interval [+0.082, +0.280]
(the mean of the per-seed gains and its Student t interval, as the report
computes every interval: `study.stats.interval`; data in
experiments/results/lag_study_default/study.csv). 640 held-out
prompts put the standard error of one run's greedy accuracy at most 0.0198
(sqrt(0.25 / 640)); a run's final accuracy averages its last two evaluations
(steps 150 and 200).

`--config=configs/lag_study.py:gsm8k` swaps in the GSM8K / Qwen2.5 setting of
configs/gsm8k_qwen25_1p5b.py (for a GPU/TPU, with a local checkpoint): the same
grid and code, host-scored rewards in the sandboxed verifier workers.

The async setting is simulated exactly, as in the paper: `stale32` trains
every batch on data from the version 32 optimizer steps old, the steady state
of an asynchronous sampler running 32 steps ahead (`lag.mode=async` is a real
sampler thread whose staleness depends on timing, so its seeds would not be
paired). The M2PO paper's staleness 256 would need runs much longer than 200
steps to differ from `offline`.

`python -m experiments.sweep --config=configs/lag_study.py --workdir=DIR`
still runs the grid's first seed as separate single runs (`get_sweep`).
"""

import ml_collections

from configs import default
from offpolicy_jax import config_schema

# Methods: name=loss_preset[+advantage] (no value: the preset of that name with its default
# advantage). RED-Drop is REINFORCE with the red_drop advantage.
# The default grid: the methods whose claims the paper makes (REINFORCE collapses under lag;
# REC-OneSide-NoIS learns like GRPO; wide clipping learns faster under lag; OPMD, AsymRE and
# RED work). 8 methods x 5 lags x 12 seeds + the A/A twin fit the 60-minute budget here (42 min
# 33 s); all 16 do not (65-74 minutes, measured), so the rest run in the `toy_full` scale
# (docs/results/lag_study.md).
METHODS = ",".join(
  (
    "reinforce",
    "grpo",
    "rec_oneside_nois",
    "rec_oneside_nois_wide",
    "opmd",
    "asymre",
    "red_drop=reinforce+red_drop",
    "red_weight",
  )
)
ALL_METHODS = ",".join(
  (
    METHODS,
    "rec_oneside_is",
    "rec_twoside_nois",
    "rec_ring_nois",
    "cispo",
    "m2po",
    "bapo",
    "topr",
    "decoupled_ppo",
  )
)
# Lag schedules: name=m/n (sync_interval / sync_offset, docs/science.md section 5) or offline;
# a "+engine" suffix adds an engine-mismatch setting (study.grid.ENGINES: bf16, topk5, topp8).
LAGS = "onpolicy=1/0,interval20=20/0,offset10=1/10,stale32=1/32,offline=offline"

# `deep`: the staleness axis to 256 updates (M2PO, arXiv 2510.01161, reports stable training
# at 256 stale updates) over 600 steps, so that 256 is under half the run: sync interval 256
# (the behaviour parameters lag up to 255 updates; they are refreshed at steps 256 and 512)
# against on-policy. A cell of 12 seeds x 600 steps takes about 6 minutes here, so the grid
# that fits the 60-minute budget is 4 methods x 2 lags; `deep_full` is the whole axis (sync
# intervals 20 / 64, the constant lag 256 of `const256` (every batch 256 updates old after a
# 256-step fill; 257 snapshots per seed) and offline, every batch from the warm start) with
# decoupled PPO and the two corrections that held up best in the mismatch study (tis_old,
# icepop_old: docs/results/off_policyness.md) and GRPO's A/A twin at every lag, 40 cells,
# about 4 hours here (docs/results/lag_study.md).
DEEP_METHODS = "grpo,reinforce,rec_oneside_nois,m2po"
DEEP_LAGS = "onpolicy=1/0,interval256=256/0"
DEEP_FULL_METHODS = f"{DEEP_METHODS},decoupled_ppo,tis_old,icepop_old"
DEEP_FULL_LAGS = "onpolicy=1/0,interval20=20/0,interval64=64/0,const256=1/256,offline=offline"
# `const256`: M2PO's setting (arXiv 2510.01161: every batch 256 updates behind the policy it
# trains): the constant lag 1/256 (after a 256-step fill, v(t) = t - 257), 600 steps like
# `deep`, GRPO against M2PO (as its paper describes it, and as released: `m2po_release`),
# REC-OneSide-NoIS and decoupled PPO at that lag, GRPO's A/A twin there too. On-policy
# cells are the `deep` grid's (the same warm starts and seeds). Each seed holds 257
# parameter snapshots (`lag.snapshot_capacity`).
CONST_METHODS = "grpo,m2po,rec_oneside_nois,decoupled_ppo,m2po_release"
CONST_LAGS = "const256=1/256"
# `lr`: learning-rate sensitivity of the REINFORCE collapse and of wide vs narrow clipping,
# on-policy and offline (18 cells).
LR_METHODS = ",".join(
  f"{name}_lr{tag}={preset};optimizer.learning_rate={lr}"
  for name, preset in (
    ("reinforce", "reinforce"),
    ("narrow", "rec_oneside_nois"),
    ("wide", "rec_oneside_nois_wide"),
  )
  for tag, lr in (("1e-4", "1e-4"), ("3e-4", "3e-4"), ("1e-3", "1e-3"))
)


# `bits`: the core grid on a task that is not string reversal (issue: "a task that is not the
# toy"): reasoning-gym's count_bits (the ones in a 16-bit binary number, its own verifier in
# the sandboxed workers, a warm start on true answers only), GRPO / REINFORCE /
# REC-OneSide-NoIS / M2PO x on-policy / interval 20 / constant lag 256 / offline, then
# decoupled PPO and M2PO as released (`m2po_release`) for the M2PO comparison at the constant
# lag on a second task (docs/results/m2po.md), 12 seeds of their own (1000..1011), GRPO's A/A
# twin at every lag.
BITS_METHODS = "grpo,reinforce,rec_oneside_nois,m2po,decoupled_ppo,m2po_release"
BITS_LAGS = "onpolicy=1/0,interval20=20/0,const256=1/256,offline=offline"


TOY_SCALES = ("toy", "toy_full", "deep", "deep_full", "const256", "lr", "reuse", "moe", "critic")
TOY_SCALES += ("ope", "critic_const256")
# `critic`: does a learned critic help under lag (docs/results/critic.md)? PPO with a critic
# and GAE (`ppo_critic`), IMPALA's V-trace (`vtrace`) and REC-OneSide-NoIS on the critic's
# advantages (`rec_critic`), and V-trace under REC's mask (`vtrace_rec`, added after the first
# five: does a trust region rescue V-trace?), and ReMax's greedy baseline (`remax`, added
# last: a baseline that needs neither a critic nor the group's mean; `remax_rec` under REC's
# mask) against the group
# baselines GRPO and REC-OneSide-NoIS, on-policy /
# sync interval 20 / 64 / offline (200 steps: an interval of 256 would be offline), 12 seeds.
CRITIC_METHODS = "grpo,rec_oneside_nois,ppo_critic,vtrace,rec_critic,vtrace_rec,remax,remax_rec"
CRITIC_LAGS = "onpolicy=1/0,interval20=20/0,interval64=64/0,offline=offline"
# `spell_critic`: the critic grid's second task (reasoning-gym spell_backward, scored in the
# sandboxed workers, as `spell`): the critic methods that did not collapse on the default task
# against the group baselines, on-policy / interval 20 / 64 / offline (the critic grid's lags;
# interval 64 added after the others had run), 12 seeds, with GRPO's A/A twin at every lag.
SPELL_CRITIC_METHODS = "grpo,rec_oneside_nois,ppo_critic,rec_critic,vtrace_rec"
# `spell_critic_const256`: the same methods at the constant lag 1/256 (`const256`), 600 steps.
SPELL_CRITIC_SCALES = ("spell_critic", "spell_critic_const256")
# `critic_const256`: the critic grid at 256 stale updates in M2PO's sense (the constant lag
# 1/256 of `const256`, 600 steps): the critic methods that did not collapse at interval 64
# against the group baselines, GRPO's A/A twin there too, 12 seeds; compared with GRPO at
# the same lag (the critic grid's 200 steps would be all fill at this lag).
CRITIC_CONST_METHODS = "grpo,rec_oneside_nois,ppo_critic,rec_critic,vtrace_rec"
# `ope`: off-policy evaluation from the replay buffer against the truth by lag (docs/ope.md):
# the critic methods, so that the doubly robust estimators have values, 12 seeds.
OPE_ESTIMATES = "is,wis,pdwis,dr,wdr"
# `moe`: routing replay (docs/models.md, arXiv 2510.11370) on the tiny mixture of experts
# (tiny-moe: 4 experts, top-2): each method with the sampler's routing recorded only
# (`rollout.routing_replay=record`: the learner routes by its own router, rows report how often
# it agrees) and replayed (`_r3`), x on-policy / sync interval 20 / 64 / offline, 8 seeds.
# Does replay matter more as lag grows? (docs/results/routing_replay.md)
MOE_METHODS = ",".join(
  f"{name}{tag}={name};rollout.routing_replay={mode}"
  for name in ("grpo", "rec_oneside_nois", "m2po")
  for tag, mode in (("", "record"), ("_r3", "replay"))
)
MOE_LAGS = "onpolicy=1/0,interval20=20/0,interval64=64/0,offline=offline"
# `reuse`: what data reuse buys in sampled tokens (docs/what_lag_buys.md): GRPO on-policy
# with 1, 2 and 4 optimizer steps per sampled batch (train.num_epochs: each batch reused
# that many times), evaluated every 20 steps so that the tokens to the threshold resolve.
REUSE_METHODS = "grpo,grpo_reuse2=grpo;train.num_epochs=2,grpo_reuse4=grpo;train.num_epochs=4"


def get_config(scale: str = "toy") -> ml_collections.ConfigDict:
  """The shared base of every run plus the grid (`study`)."""
  if scale in TOY_SCALES:  # toy_full: every method (ALL_METHODS); deep, lr: below
    c = default.base_config()
    c.total_steps = 200
    # A warm start on imperfect demonstrations, so that learning shows within 200 steps:
    # 300 supervised steps of which 40% of the examples show the distractor answer (the
    # digits copied, not reversed). Greedy accuracy starts near 0.29 and on-policy GRPO
    # ends near 0.47 (12 seeds: a gain of +0.181, 95% t interval [+0.082, +0.280]; 4 seeds:
    # +0.33; docs/results/lag_study.md). With the
    # single run's 150 clean steps, GRPO gained +0.01 in 200 steps, and no learning rate,
    # batch size, temperature or length range tried changed that (the same doc).
    c.sft.steps = 300
    c.sft.distractor = 0.4
    c.task_kwargs.num_eval = 640
    c.eval_prompts = 640
  elif scale == "gsm8k":
    from configs import gsm8k_qwen25_1p5b

    c = gsm8k_qwen25_1p5b.get_config()
    c.unlock()
    c.total_steps = 300
  elif scale == "code":  # programs scored in the sandboxed workers (configs/code.py)
    from configs import code

    c = code.get_config()
    c.unlock()
    # A longer warm start than the single run's: held-out accuracy starts near 0.3.
    c.sft.steps = 300
    c.total_steps = 200
    c.eval_prompts = 256  # the whole held-out set of the task
  elif scale in ("spell", "spell_critic", "spell_critic_const256"):  # reasoning-gym, sandboxed
    c = default.base_config()
    c.task = "reasoning_gym:spell_backward"
    # The word alone as a raw prompt in the character alphabet (docs/rewards_and_security.md);
    # the verifier ignores case and gives partial credit (the matching leading letters).
    c.task_kwargs = {
      "prompt_format": "{metadata[word]}",
      "instruction": "",
      "chat": False,
      "lowercase": True,
      "distractor_format": "{metadata[word]}",
      "eval_size": 640,
      # Words of 3-5 letters: with up to 10 the warm start's greedy accuracy is 0.045 and
      # on-policy GRPO trades exact answers for the partial credit of leading letters
      # (0.007 at step 200, 4 seeds); with up to 5, 0.37 -> 0.58 (4 seeds).
      "max_word_len": 5,
    }
    c.max_prompt_len = 8  # BOS + the longest word
    c.max_new_tokens = 8  # the reversed word + EOS
    c.total_steps = 200
    c.sft.steps = 300
    c.sft.distractor = 0.4  # as the toy grid: some warm-start answers are the word unreversed
    c.eval_prompts = 640
  elif scale == "bits":  # reasoning-gym count_bits (arithmetic), sandboxed workers
    c = default.base_config()
    c.task = "reasoning_gym:count_bits"
    # The number in binary as a raw prompt in the character alphabet: "11011001=" -> "5".
    c.task_kwargs = {
      "prompt_format": "{metadata[binary]}=",
      "instruction": "",
      "chat": False,
      "eval_size": 640,
      "min_n": 1,
      "max_n": 2**16 - 1,
    }
    c.max_prompt_len = 18  # BOS + 16 bits + "="
    c.max_new_tokens = 3  # the count + EOS
    # A short warm start on true answers only (no distractor): greedy accuracy starts near
    # 0.5 (0.40-0.69 over 4 pilot seeds); with 300 steps it starts at 0.99 (12-bit numbers:
    # 0.99, 150 steps 0.92) and there is nothing left to learn.
    c.sft.steps = 50
    c.total_steps = 400  # the constant lag 256 trains 144 steps 256 versions behind
    c.eval_prompts = 640
    c.seed = 1000  # seeds 1000.. : warm starts of their own, shared with no other grid
  elif scale == "calculator":  # multi-turn tool use (configs/calculator.py, docs/multiturn.md)
    from configs import calculator

    c = calculator.get_config()
    c.unlock()
  else:
    raise ValueError(
      f"configs/lag_study.py: unknown scale {scale!r} "
      "(toy, toy_full, deep, deep_full, const256, lr, reuse, moe, critic, critic_const256, ope, "
      "gsm8k, code, spell, "
      "spell_critic, spell_critic_const256, bits or calculator)"
    )
  c.eval_every = 50
  # pass@k of the final parameters, k samples per prompt at the training temperature.
  c.eval_samples = 4
  c.checkpoint_every = 0
  c.progress = False
  c.tensorboard = False
  # `config.study`: the grid and how it runs (config_schema.STUDY_FIELDS: roles and docs).
  config_schema.config_dict(config_schema.STUDY_FIELDS, into=c)
  c.study.methods = METHODS if scale == "toy" else ALL_METHODS
  c.study.lags = LAGS
  if scale in ("calculator", "code", "spell", "bits", *SPELL_CRITIC_SCALES):  # host rewards
    c.study.methods = "grpo,rec_oneside_nois,reinforce"
    c.study.lags = "onpolicy=1/0,interval20=20/0,offline=offline"
  if scale in SPELL_CRITIC_SCALES:
    c.study.methods = SPELL_CRITIC_METHODS
    c.study.lags = CRITIC_LAGS if scale == "spell_critic" else CONST_LAGS
  # 12 seeds: enough for the report's verdicts (sign-flip permutation tests, Holm-corrected
  # over the grid's comparisons at alpha 0.05) to be anything but `~` in the full grid too:
  # the smallest two-sided p-value of n seeds is 2 / 2^n, and Holm's first step needs
  # p <= 0.05 / 79 = 0.00063 over the full grid's 79 comparisons (0.05 / 39 = 0.0013 over
  # the default's 39; n = 10: 0.0020, n = 12: 0.00049). study.stats.needed_seeds.
  c.study.seeds = 12
  c.study.alpha = 0.05
  # Equivalence: a method is "equivalent to GRPO on-policy" only when two one-sided tests show
  # its mean final-accuracy difference within +-0.03 (declared here, before the runs: about
  # 1.5 standard errors of one run's accuracy on the 640 held-out prompts, sqrt(0.25/640)).
  c.study.equivalence_margin = 0.03
  # A/A calibration at every lag: GRPO runs twice with independent random streams on the
  # same warm starts; study.md reports how often the tests call the two different.
  c.study.aa_lags = "all"
  # One seed per vmapped program and 64 held-out prompts per sampler call for large models.
  small = (*TOY_SCALES, "code", "spell", "bits", *SPELL_CRITIC_SCALES)
  c.study.vmap_seeds = 0 if scale in small else 1
  c.study.eval_batch = 0 if scale in small else 64
  # 9 cells x 5 seeds in under an hour on a 2-core CPU (docs/results/lag_study.md).
  if scale == "spell":
    c.study.aa_lags = ""  # the A/A calibration at 12 seeds is the default grid's
  if scale == "code":
    c.study.seeds = 5
    c.study.aa_lags = ""
    c.eval_samples = 1  # greedy only: every sampled program is one more sandboxed process
  if scale in ("deep", "deep_full", "const256", "critic_const256", "spell_critic_const256"):
    c.total_steps = 600
    c.eval_every = 20  # learning-speed claims need the curve, not five points
    c.rollout.score_old = True  # the *_old corrections weigh by pi_old / mu
    c.study.methods = DEEP_METHODS if scale == "deep" else DEEP_FULL_METHODS
    c.study.lags = DEEP_LAGS if scale == "deep" else DEEP_FULL_LAGS
    # `deep`: the A/A calibration at 12 seeds is the default grid's (docs/results/lag_study.md).
    c.study.aa_lags = "all" if scale == "deep_full" else ""
  if scale in ("const256", "critic_const256", "spell_critic_const256"):
    c.study.methods, c.study.lags = CONST_METHODS, CONST_LAGS
    c.study.baseline = "grpo@const256"
    c.study.aa_lags = "all"
  if scale == "critic_const256":
    c.study.methods = CRITIC_CONST_METHODS
  if scale == "spell_critic_const256":
    c.study.methods = SPELL_CRITIC_METHODS
    c.eval_every = 100  # each evaluation grades 640 prompts x 5 samples in the sandbox
  if scale == "moe":
    c.model = "tiny-moe"
    c.study.methods = MOE_METHODS
    c.study.lags = MOE_LAGS
    c.study.seeds = 8
  if scale == "lr":
    c.eval_every = 20
    c.study.methods = LR_METHODS
    # On-policy and offline (the strongest lag): with interval 20 as well, its first cells
    # (167-249 s each beside other work) put the 27 cells at 80-90 minutes, over the hour.
    c.study.lags = "onpolicy=1/0,offline=offline"
    c.study.baseline = "narrow_lr3e-4@onpolicy"
    c.study.aa_lags = "all"  # the baseline's A/A twin, on-policy and offline
  if scale in ("critic", "ope"):
    c.study.methods = CRITIC_METHODS if scale == "critic" else "ppo_critic,vtrace"
    c.study.lags = CRITIC_LAGS
  if scale in ("critic", "ope", "critic_const256", *SPELL_CRITIC_SCALES):
    # The committed grids ran before `ppo_critic` took PPO-max's KL penalty and reward
    # normalisation (run.critic_settings.RECIPES): their critics pay no KL and see raw rewards.
    c.critic.kl_coef = 0.0
    c.critic.reward_norm = False
  if scale == "ope":
    c.study.ope = OPE_ESTIMATES
    c.study.baseline = "ppo_critic@onpolicy"
  if scale == "reuse":
    c.eval_every = 20
    c.eval_samples = 1  # greedy accuracy only
    c.study.methods = REUSE_METHODS
    c.study.lags = "onpolicy=1/0"
    c.study.seeds = 8
  if scale == "bits":
    c.study.methods, c.study.lags = BITS_METHODS, BITS_LAGS
    c.eval_every = 40  # ten points on each curve
  c.lock()
  return c


def get_sweep() -> list[dict]:
  """Single runs of the grid (`experiments.sweep`): one seed, `name` names the subdirectory."""
  c = get_config()
  from offpolicy_jax.study import grid as study_grid  # here: reading the config needs no JAX

  lags = study_grid.parse_lags(c.study.lags, c.total_steps)
  engines = study_grid.parse_engines(c.study.lags)
  runs = []
  for method, overrides in study_grid.parse_methods(c.study.methods).items():
    for lag, (m, n) in lags.items():
      runs.append(
        {
          "name": f"{method}-{lag}",
          **overrides,
          **engines.get(lag, {}),
          "lag.sync_interval": m,
          "lag.sync_offset": n,
        }
      )
  return runs
