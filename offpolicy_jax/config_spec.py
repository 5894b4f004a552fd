# size: declaration table: one typed attribute per config field, generated from config_schema.
# Generated from offpolicy_jax/config_schema.py; do not edit. Regenerate with:
# python -m offpolicy_jax.config_reference --spec > offpolicy_jax/config_spec.py
"""The config as frozen, typed records: `RunSpec.from_config(config)`, `StudySpec`.

One attribute per declared field at its dotted path (`spec.lag.sync_interval`),
typed from its default, with the field's doc above it. A reader that takes a
spec instead of the ConfigDict has every name it reads checked by mypy, and
cannot change the run's config. `task_kwargs` is a read-only mapping
(`FrozenMapping`: it hashes and pickles, so a spec does too).
Values are taken as the config holds them: `config_schema.check` (and
`run.validation.validate_config`) check them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from offpolicy_jax.config_fields import FrozenMapping, build_record

__all__ = ["FrozenMapping", "RunSpec", "StudySpec"]


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
  """`config.rollout.*`."""

  #: Routing replay for a model with experts (models/moe.py): "record" stores every sampled
  #: token's experts with the batch and reports how often the learner's own routing agrees
  #: (moe/router_agreement); "replay" also routes the learner along them (R3, arXiv:2510.11370),
  #: its router still learning the mixing weights. The static sampler only (no continuous slots,
  #: partial rollouts or multi-turn episodes).
  routing_replay: str

  #: Decode attention reads each row's own cached keys only up to the current step, in spans of
  #: this many slots, at most 3 spans (0 = the whole max_new_tokens cache at every step). Same
  #: numbers (docs/speed.md).
  decode_block: int

  #: Continuous batching (sampling.continuous): this many times group_size rows decode at once
  #: and a row that has ended frees its slot for the next waiting row inside the same compiled
  #: loop, so no row decodes past its end (groups stay whole in the output); worth it when
  #: response lengths vary (EOS). Its draws use per-(prompt, sample, token) keys, so its samples
  #: differ from the static sampler's for the same seed. 0 = the static batch of all
  #: prompts_per_step groups. With rollout.continuous_auto_steps > 0, the number of slots the
  #: run switches to.
  continuous_slots: int

  #: Automatic continuous batching: the run samples with the static batch for this many steps,
  #: measuring its decode waste (sampler/decode_waste: the fraction of decoded row-steps after a
  #: row had ended), then switches to continuous batching with rollout.continuous_slots slots if
  #: the mean waste over those steps exceeds rollout.continuous_waste_threshold
  #: (sampler/continuous in every row; the choice is kept in the checkpoints, so a resumed run
  #: makes the same one). lag.mode='sync' only. 0 = no switch: continuous from the start if
  #: rollout.continuous_slots > 0.
  continuous_auto_steps: int

  #: Mean decode waste of the static batch over the first rollout.continuous_auto_steps steps
  #: above which the run switches to continuous batching.
  continuous_waste_threshold: float

  #: Partial rollouts (APRIL): decode at most this many tokens per response per loop step;
  #: unfinished responses continue at the next step under the newer parameters (re-prefilled),
  #: every token keeping its own version (0 = off: whole responses). With multi-turn episodes:
  #: at most this many policy tokens per trajectory per step (rollout.episode_pool). Under
  #: lag.mode='async' the sampler thread carries the pool.
  partial_budget: int

  #: What the sampler records as the behaviour log-prob mu, and so what the learner scores
  #: (docs/science.md s7; the same without top_k / top_p). "sampled": the log-prob of the
  #: tempered, top-k / top-p truncated and renormalised distribution it drew from; the learner
  #: scores that distribution (the kept set's size is recorded per token), so ratios are 1 at
  #: the behaviour's parameters. Right when the truncated sampler is the policy being trained
  #: and deployed. "full": the untruncated tempered log-prob; the learner scores the full
  #: tempered softmax, and truncation is part of the environment (it filters which tokens are
  #: tried, the policy is the full softmax). Right when the policy will be used without
  #: truncation, or to match trainers that score the full softmax. "mismatched": records as
  #: "sampled" but the learner scores the full tempered softmax, the engine mismatch of a
  #: learner that ignores the sampler's truncation (on-policy ratios Z <= 1): a setting for
  #: studying corrections (docs/off_policyness.md), not for training.
  behavior_logp: str

  #: Compute dtype of the sampler ("" = model_dtype). "bfloat16" with an float32 learner is the
  #: engine mismatch of a bf16 inference engine: the same parameters, other numerics, so the
  #: learner's ratios at the behaviour's parameters are not 1 (behavior_ratio_*, docs/science.md
  #: s7).
  sampler_dtype: str

  #: The learner also scores every sampled token at the sampling parameters (log pi_old: one
  #: more forward pass of each batch), so pi / mu factors into staleness pi / pi_old and engine
  #: mismatch pi_old / mu, both reported in every row and available to losses (docs/science.md
  #: s7). Forced on by a loss that corrects pi_old / mu. False: pi_old = mu.
  score_old: bool


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """`config.data.*`."""

  #: Prompts longer than max_prompt_len: False fails at start-up naming the row
  #: (data_checks.validate_data); True keeps their last max_prompt_len tokens (the question and
  #: the generation prompt) and counts them in the prompts_truncated metric.
  truncate_prompts: bool


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """`config.loss.*`."""

  #: Loss preset name (losses.names()).
  name: str

  #: Lower ratio bound: keep rho >= 1 - eps_low.
  eps_low: float | None

  #: Upper ratio bound: keep rho <= 1 + eps_high.
  eps_high: float | None

  #: Ring mask outer lower bound (rec_ring_*).
  eps_low_prime: float | None

  #: Ring mask outer upper bound (rec_ring_*).
  eps_high_prime: float | None

  #: Dual-clip constant c for A < 0.
  dual_clip_c: float | None

  #: Coefficient of the k2 / forward-KL regulariser towards the behaviour policy.
  reg_coef: float | None

  #: Coefficient of the KL to the reference policy.
  kl_coef: float | None

  #: Entropy bonus coefficient.
  entropy_coef: float | None

  #: RED-Weight temperature.
  temp: float | None

  #: Aggregation: token_mean, seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm.
  agg: str | None


@dataclasses.dataclass(frozen=True)
class AdvantageSpec:
  """`config.advantage.*`."""

  #: Advantage estimator (advantages.names()); "" picks the loss preset's default,
  #: losses.default_advantage(loss.name): grpo for grpo/dapo-style presets, opmd for oapl, else
  #: group_mean.
  name: str


@dataclasses.dataclass(frozen=True)
class CriticSpec:
  """`config.critic.*`."""

  #: Critic (learn.critic): "gae" (PPO with a value head, GAE advantages), "vtrace" (IMPALA
  #: V-trace advantages and targets), "none"; "" picks the loss preset's default,
  #: losses.default_critic(loss.name): gae for ppo_critic and rec_critic, vtrace for vtrace,
  #: else none. A critic adds a value head to the policy's trunk and replaces the group
  #: advantages with its token advantages.
  estimator: str

  #: Discount per policy token.
  gamma: float

  #: GAE's lambda, or V-trace's trace lambda.
  lam: float

  #: Weight of the value loss (a token mean) against the policy loss.
  value_coef: float

  #: gae: clip range of the value loss around the values the step starts from (0 = off).
  value_clip: float

  #: vtrace: truncation of the importance weights of the TD errors (and of the policy gradient);
  #: >= critic.c_bar.
  rho_bar: float

  #: vtrace: truncation of the traces; <= critic.rho_bar.
  c_bar: float

  #: gae: whiten the token advantages over the batch's valid tokens.
  whiten: bool

  #: Per-token KL penalty in the critic's rewards: every policy token pays -kl_coef (log mu -
  #: log pi_ref) against the run's starting parameters (learn.critic; PPO for language models'
  #: token-level KL; 0 = none). Keeps the reference parameters. None: the loss preset's recipe
  #: (run.critic_settings.RECIPES: 0.05 for ppo_critic), else 0.
  kl_coef: float | None

  #: Normalise and clip the rows' rewards by their running mean and standard deviation over the
  #: run before the critic's returns ("Secrets of RLHF" eq. 18; learn.critic, kept in the
  #: checkpoints). None: the loss preset's recipe (on for ppo_critic), else off. It cannot go
  #: with per-turn rewards, prompt values or the doubly robust OPE estimators (they read the
  #: values as rewards): there the recipe's stays off and True is refused.
  reward_norm: bool | None

  #: A value warm start: the first this many loop steps train the critic alone (its value head
  #: on a frozen trunk, or a separate critic) while the policy's gradients and updates are zero,
  #: so it samples and learns nothing until the critic has seen that many batches ("Secrets of
  #: RLHF" pretrains its critic). 0 = none.
  warmup_steps: int

  #: delta of critic.reward_norm's clipping: normalised rewards are kept in [-delta, delta].
  reward_clip: float

  #: Prompt values (V_0, rollout.prompt_filter): read this many candidate prompts per prompt
  #: sampled and keep, of each run of them, the one the critic's value at the prompt predicts
  #: least likely to give a group of equal rewards; 1 = off (every prompt read is sampled).
  #: Needs a critic.
  prompt_pool: int

  #: The reward of a wrong response, for critic.prompt_pool's predicted success rate.
  prompt_wrong: float

  #: The reward of a right response (> critic.prompt_wrong), for critic.prompt_pool.
  prompt_right: float

  #: The value head's own AdamW learning rate, as a multiple of optimizer.learning_rate (the
  #: same schedule); the shared trunk follows the policy's optimizer. A separate critic
  #: (critic.model) trains wholly at this rate.
  lr_scale: float

  #: The critic's own model (models.value): "" a value head on the policy's trunk; "policy" a
  #: separate critic of the policy's architecture starting as a copy of the policy's starting
  #: (warm-started) weights, its head at zero (the critic of "Secrets of RLHF"); or a preset
  #: name or Hugging Face directory / repo id of the policy's vocabulary, fresh from the seed or
  #: loaded (its value head from value_head.safetensors, else zero). A separate critic has its
  #: own forward, gradient clipping and checkpointed state; not with adapters (lora.rank).
  model: str


@dataclasses.dataclass(frozen=True)
class LagSpec:
  """`config.lag.*`."""

  #: "sync": the exact schedule v(t) (offpolicy_jax.lag); "async": a sampler thread runs ahead.
  mode: str

  #: m: parameters reach the sampler every m loop steps (batches), i.e. every m *
  #: train.num_minibatches * train.num_epochs optimizer steps (1 = on-policy).
  sync_interval: int

  #: n: the first n steps use version 0; afterwards a constant extra lag of n.
  sync_offset: int

  #: Async mode: batches more than this many loop steps old are dropped (0 = no bound). With
  #: partial rollouts, 0 or at least ceil(max_new_tokens / rollout.partial_budget).
  max_staleness: int

  #: Async mode: sampler threads, each with a batch in flight; each thread after the first has
  #: verifier workers of its own (reward_workers each), so one batch's environment and tool
  #: waits overlap another's decoding. More threads mean staler batches. 1 with partial
  #: rollouts.
  sampler_threads: int


@dataclasses.dataclass(frozen=True)
class ReplaySpec:
  """`config.replay.*`."""

  #: Buffer capacity in batches of G groups of K responses (the capacity is G * this groups; at
  #: least ceil(max_new_tokens / rollout.partial_budget) with partial rollouts).
  capacity_batches: int

  #: Which groups a step trains on: fifo (oldest first; with max_reuse=1 each group once, the
  #: paper's one-pass setting), uniform, staleness (prefers fresh groups) or reward (prefers
  #: high mean reward); see offpolicy_jax.learn.replay.
  policy: str

  #: Times a group may be trained on before it is retired (0 = unlimited).
  max_reuse: int

  #: Softness of the staleness / reward policies: P(group) ~ exp(score / temperature).
  temperature: float


@dataclasses.dataclass(frozen=True)
class TrainSpec:
  """`config.train.*`."""

  #: Optimizer steps per epoch over each sampled batch (divides G*K). The parameter version
  #: counts optimizer steps: with U = num_minibatches * num_epochs a loop step advances it by U,
  #: and lag.sync_interval still counts loop steps (batches).
  num_minibatches: int

  #: Passes over each sampled batch (reshuffled each epoch).
  num_epochs: int

  #: Rows per gradient-accumulation micro-batch (divides the minibatch of G * K /
  #: num_minibatches rows; 0 = the whole minibatch, no accumulation).
  micro_batch_size: int

  #: Run each group's prompt once and let its K responses attend to it (same log-probs and
  #: gradients as K copies, within float tolerance; less work). Applies when every micro-batch
  #: holds whole groups; otherwise the plain forward runs.
  shared_prefix: bool

  #: Leave rows whose advantages are all 0 out of the forward/backward pass where that is exact
  #: for the loss (losses.LossSpec.zero_advantage_inert; counted in the rows_skipped metric).
  skip_zero_advantage: bool


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  """`config.optimizer.*`."""

  #: Peak learning rate (AdamW).
  learning_rate: float

  #: Linear warm-up steps.
  warmup_steps: int

  #: AdamW beta1.
  b1: float

  #: AdamW beta2.
  b2: float

  #: AdamW decoupled weight decay.
  weight_decay: float

  #: Global gradient-norm clip (0 = off).
  grad_clip: float

  #: Dtype of both Adam moments between steps (bfloat16: half the optimizer memory; the update
  #: is computed in float32; keep b2 <= 0.99, whose increments bfloat16 resolves).
  moment_dtype: str


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """`config.lora.*`."""

  #: Rank r of low-rank adapters on the decoder's projections (0 = off: full fine-tuning). With
  #: r > 0 only the adapters train; snapshots, the reference and proximal policies and the
  #: sampler's copies hold adapters, the frozen base is held once (docs/lora.md).
  rank: int

  #: Adapter scale numerator: the update is (alpha / r) x A B (PEFT's lora_alpha).
  alpha: float

  #: Comma-separated projections that get adapters.
  targets: str

  #: Dropout p on each adapter's input, (alpha / r) dropout(x) A B (PEFT's lora_dropout), in the
  #: train step's current-policy forward only (never the sampler, the old / behaviour scoring,
  #: the reference or evaluation); needs lora.rank > 0.
  dropout: float


@dataclasses.dataclass(frozen=True)
class MultiturnSpec:
  """`config.multiturn.*`."""

  #: Multi-turn episodes (docs/multiturn.md): at most this many policy turns per trajectory,
  #: each answered by the task's environment in the sandboxed workers (0 = single-turn; needs a
  #: task with an environment).
  max_turns: int

  #: Token budget of one policy turn (0 = max_new_tokens); max_new_tokens bounds the whole
  #: trajectory, policy and observation tokens together.
  turn_tokens: int

  #: Longest observation kept in a trajectory, in tokens (longer ones are cut and counted).
  observation_tokens: int

  #: Credit of multi-turn trajectories: 'trajectory' (the summed reward, group-relative over the
  #: K trajectories of a prompt) or 'turn' (each turn's tokens get the discounted sum of the
  #: group-relative rewards paid after it and later turns; advantages.per_turn; with a critic,
  #: each turn's reward is paid on its last token and the critic credits it).
  credit: str

  #: Per-turn discount of multiturn.credit = 'turn'.
  gamma: float


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """`config.mesh.*`."""

  #: Data-parallel mesh axis size (-1 fills the remaining devices).
  data: int

  #: Fully-sharded (parameter) axis size.
  fsdp: int

  #: Tensor-parallel axis size.
  tensor: int

  #: Disaggregated mode: devices of the sampler's own mesh (0 = sampler and trainer share the
  #: mesh). Each process gives its first sampler_devices / processes local devices to the
  #: sampler; data * fsdp * tensor above must then use all the others.
  sampler_devices: int


@dataclasses.dataclass(frozen=True)
class SftSpec:
  """`config.sft.*`."""

  #: Supervised warm start on the task's reference answers before RL, of a preset's random
  #: initialisation (a model loaded with weights skips it unless sft.on_loaded_model).
  enabled: bool

  #: Warm-start a model loaded with weights too (config.model an HF directory or repo id, e.g.
  #: an earlier run's export): by default such a model starts RL as it is, since the warm start
  #: would overwrite what it learned.
  on_loaded_model: bool

  #: Supervised steps.
  steps: int

  #: Examples per supervised step.
  batch_size: int

  #: Supervised learning rate (AdamW).
  learning_rate: float

  #: Fraction of warm-start examples whose demonstration is the task's distractor answer
  #: (Task.distractor: reverse shows the digits unreversed), a fixed draw per example: a warm
  #: start that imitates a mix of right and wrong behaviour, which RL has to sort out.
  distractor: float


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """A run's config (`config_schema.RUN_FIELDS`)."""

  #: Base seed; every PRNG key of the run is derived from (seed, step).
  seed: int

  #: Number of loop steps (one batch of prompts is sampled and trained on per step).
  total_steps: int

  #: Model: a preset name (models.preset_names()) or a local Hugging Face directory.
  model: str

  #: Compute dtype of the model ("float32" or "bfloat16").
  model_dtype: str

  #: Stack the decoder blocks' parameters over layers and run them as one lax.scan in the
  #: training and scoring forward (compile time flat in depth; the same numbers; HF and PEFT
  #: files are per layer either way; a run's checkpoints are read in either layout, a resume
  #: with this field changed converting them). None: stacked for models of 0.4B parameters and
  #: more (models.ModelConfig.scan_layers).
  model_scan_layers: bool | None

  #: With stacked blocks, the samplers' prefill and decode steps run as one lax.scan too (their
  #: compile time flat in depth, the decode slower on the CPU: docs/results/compile_time.md);
  #: False: the samplers decode per layer. No effect on blocks stored per layer.
  model_scan_decode: bool

  #: Rematerialise each decoder block in the training backward pass (jax.checkpoint): the train
  #: step keeps each block's input instead of its intermediates and recomputes them, about one
  #: more forward per step (same numbers up to float rounding, same checkpoint layout; may
  #: change on resume).
  model_remat: bool

  #: Attention implementation: "xla" (ours: einsums over the head-major KV cache, the fastest on
  #: CPU) or "dot_product" (jax.nn.dot_product_attention, which JAX lowers to cuDNN flash
  #: attention on GPU). The same numbers within float tolerance.
  model_attention: str

  #: Coefficient of the load-balancing auxiliary loss of a model with experts (the Switch loss,
  #: transformers' router_aux_loss_coef; models/moe.py), added to the policy loss weighted like
  #: it; 0 turns it off. A dense model ignores it.
  model_router_aux_coef: float

  #: Tokenizer: "" uses the task's built-in character tokenizer; else a local HF directory.
  tokenizer: str

  #: Task name for tasks.get_task.
  task: str

  #: Keyword arguments for tasks.get_task (e.g. data file paths for text tasks).
  task_kwargs: Mapping[str, Any]

  #: Prompts are left-padded to this many tokens (static shape).
  max_prompt_len: int

  #: Responses are sampled up to this many tokens (static shape).
  max_new_tokens: int

  #: Sampling temperature of the behaviour policy.
  temperature: float

  #: Nucleus sampling threshold (1.0 = off).
  top_p: float

  #: Top-k sampling (0 = off).
  top_k: int

  #: K: responses sampled per prompt (>= 2 for group-relative advantages).
  group_size: int

  #: G: prompts per optimizer step (batch = G * K responses).
  prompts_per_step: int

  #: Seconds one host reward call may take in its verifier worker before it is scored 0 (counted
  #: in reward_timeouts) and its worker is killed and replaced.
  reward_timeout: float

  #: Seconds the host rewards of one batch may take in all (0: 2 * reward_timeout).
  reward_batch_timeout: float

  #: Sandboxed verifier worker processes for host rewards (0: one per CPU).
  reward_workers: int

  #: Address-space limit of each verifier worker, in MiB.
  reward_memory_mb: int

  #: "strict": refuse to run verifiers where Landlock/seccomp are unavailable; "warn": run them
  #: with what the platform offers and log what is missing.
  reward_sandbox: str

  #: Evaluate every this many steps (0 = only at the end).
  eval_every: int

  #: Held-out prompts per evaluation.
  eval_prompts: int

  #: Samples per eval prompt for pass@k (k = this; 1 = greedy accuracy only, no pass@k).
  eval_samples: int

  #: Off-policy estimators (ope.names(), comma-separated; "" = off) of the current policy's
  #: expected reward from the replay buffer's rows, logged as ope/* in every eval row
  #: (learn.buffer_ope, docs/ope.md); the doubly robust dr and wdr need a critic
  #: (critic.estimator).
  eval_ope: str

  #: Save a checkpoint every this many steps (0 = only at the end).
  checkpoint_every: int

  #: Loop steps per jitted chunk (device rewards): metrics are fetched and written every
  #: gcd(log_every, eval_every, checkpoint_every) steps.
  log_every: int

  #: Trace at least this many loop steps, in whole chunks from the second chunk on (compilation
  #: is not in it), with jax.profiler into <workdir>/profile, viewable in TensorBoard/XProf; 0 =
  #: off.
  profile_steps: int

  #: Checkpoints kept.
  keep_checkpoints: int

  #: Save checkpoints in a background thread.
  async_checkpoint: bool

  #: Write TensorBoard event files under workdir/tb.
  tensorboard: bool

  #: Weights & Biases project ("" = off; used only if wandb is installed).
  wandb_project: str

  #: Show a progress bar.
  progress: bool

  rollout: RolloutSpec

  data: DataSpec

  loss: LossSpec

  advantage: AdvantageSpec

  critic: CriticSpec

  lag: LagSpec

  replay: ReplaySpec

  train: TrainSpec

  optimizer: OptimizerSpec

  lora: LoraSpec

  multiturn: MultiturnSpec

  mesh: MeshSpec

  sft: SftSpec

  @classmethod
  def from_config(cls, config: Any) -> RunSpec:
    """The spec of a run config (a ConfigDict or nested dict with every declared field)."""
    return build_record(cls, config, _BLOCKS)


@dataclasses.dataclass(frozen=True)
class StudySpec:
  """A study's own fields, `config.study.*` (`STUDY_FIELDS`)."""

  #: Methods: name=loss_preset[+advantage], comma-separated (no value: the preset of that name
  #: with its default advantage).
  methods: str

  #: Lag schedules: name=m/n (sync_interval / sync_offset, docs/science.md section 5) or
  #: name=offline, comma-separated.
  lags: str

  #: Seeds per cell (seed, seed + 1, ...): each has its own warm start and prompt order.
  seeds: int

  #: Seeds per vmapped program (0: every seed of a cell at once; 1 for large models).
  vmap_seeds: int

  #: Held-out prompts per sampler call (0: all at once).
  eval_batch: int

  #: A run's final accuracy is the mean of its last `eval_last` evaluations (in the report; a
  #: cell keeps every evaluation).
  eval_last: int

  #: Every cell is compared with this one on the same seeds: <method>@<lag>.
  baseline: str

  #: Level of the report's verdicts: `better`/`worse` when the Holm-adjusted (over the grid's
  #: comparisons) paired sign-flip permutation p-value is <= alpha (study.stats).
  alpha: float

  #: Declared in advance: a difference in accuracy shown (two one-sided t tests, Holm-adjusted)
  #: to lie within +-margin is marked equivalent in the report (0: no equivalence verdicts).
  equivalence_margin: float

  #: A/A calibration: lags at which the baseline method runs a second time with other random
  #: streams on the same warm starts and prompts ('all', '' for none, or lag names, comma-
  #: separated); the report gives the false-verdict rate of these pairs.
  aa_lags: str

  #: Off-policy estimators (ope.names(), comma-separated; "" = off) a cell runs on each seed's
  #: replay buffer at every evaluation, beside the truth they estimate: the mean reward of
  #: eval_samples fresh samples at the training temperature on eval_prompts prompts of the
  #: training split, the buffer's own (more sampling). The report gives each estimator's error
  #: and interval coverage by lag (docs/ope.md).
  ope: str

  #: The bandit study: SGD steps.
  bandit_steps: int

  #: The bandit study: arms sampled per step.
  bandit_group_size: int

  #: The bandit study: learning rate.
  bandit_lr: float

  @classmethod
  def from_config(cls, config: Any) -> StudySpec:
    """The spec of the `study` block of a study config."""
    study = config.study if hasattr(config, "study") else config["study"]
    return build_record(cls, study, _BLOCKS)


# (class, attribute) -> the record of a nested block.
_BLOCKS: dict[tuple[str, str], Any] = {
  ("RunSpec", "rollout"): RolloutSpec,
  ("RunSpec", "data"): DataSpec,
  ("RunSpec", "loss"): LossSpec,
  ("RunSpec", "advantage"): AdvantageSpec,
  ("RunSpec", "critic"): CriticSpec,
  ("RunSpec", "lag"): LagSpec,
  ("RunSpec", "replay"): ReplaySpec,
  ("RunSpec", "train"): TrainSpec,
  ("RunSpec", "optimizer"): OptimizerSpec,
  ("RunSpec", "lora"): LoraSpec,
  ("RunSpec", "multiturn"): MultiturnSpec,
  ("RunSpec", "mesh"): MeshSpec,
  ("RunSpec", "sft"): SftSpec,
}
