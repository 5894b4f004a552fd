# size: declaration table: RUN_FIELDS and STUDY_FIELDS declare every config field once
# (default, role, doc, check), about 310 of its lines; the rest is the readers.
"""The experiment config: every field once, with its default, role, check and doc.

`configs/default.py` builds its ConfigDict from `RUN_FIELDS` (`config_dict`),
so ml_collections stays the command line (`--config.lag.sync_interval=8`), and
the doc of a `Field` is that field's one comment. A field's role says what
changing it changes; every reader asks the role instead of keeping a list:

  role            compiled  kept on resume  study cell  fields
  PROGRAM         yes       yes             yes         model, task, shapes, loss, train, optimizer
  NUMBERS         no        yes             yes         seed, lag, replay, sft; the study's grid
  CONTROL         no        no              yes         total_steps, evaluation
  PLACEMENT       yes       no              no          mesh, reward workers
  NO_CELL_EFFECT  no        no              no          checkpoints, logging, writers; how a study
                                                        batches its work, its report

- compiled: the cached compiled part of a run (`run.components.compile_key`)
  is built from it; the fields that are not compiled are the run's plain
  settings (`Components.run`, a `config_spec.RunSpec`, at their dotted names).
- kept on resume: `store.workdir.check_config` refuses a resume that changes it.
- study cell: a finished study cell depends on it, so `study.runner` refuses
  to resume a study that changes it.

CONTROL is run control a study cell records (length, evaluation); PLACEMENT is
where and how the compiled part runs (the mesh, the reward workers it holds).

The roles, `Field` and the checks of a value alone (`Int`, `Float`, `Choice`,
`Bool`, `Str`, `Names`) are `config_fields`; they run first in
`run.validation.validate_config`, and the checks against registries, files or
other fields stay there.

The bottom wing, so `store.workdir` (below `run`) reads the roles too. The study's
fields (`config.study.*`) are `STUDY_FIELDS`. `python -m offpolicy_jax.config_reference
> docs/config.md` renders all of them as the config reference.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import ml_collections
from ml_collections import config_dict as _config_dict

from offpolicy_jax import errors
from offpolicy_jax.config_fields import (
  CONTROL,
  NO_CELL_EFFECT,
  NUMBERS,
  PLACEMENT,
  PROGRAM,
  Bool,
  Choice,
  Field,
  Float,
  Int,
  Names,
  Role,
  Str,
)

_F = Field
_POS = Int(1)
# `ope.names()` (`learn.buffer_ope`; a test compares them); dr and wdr need a critic.
OPE_ESTIMATORS = ("is", "wis", "pdis", "pdwis", "dr", "wdr")
_NONNEG = Int(0)
_OVERRIDE = Float(0, none_ok=True)

RUN_FIELDS: tuple[Field, ...] = (
  _F("seed", 0, NUMBERS, "Base seed; every PRNG key of the run is derived from (seed, step).",
     Int(0, 2**31)),
  _F("total_steps", 1000, CONTROL,
     "Number of loop steps (one batch of prompts is sampled and trained on per step).", _POS),
  _F("model", "tiny", PROGRAM,
     "Model: a preset name (models.preset_names()) or a local Hugging Face directory.", Str(),
     warm_start=True),
  _F("model_dtype", "float32", PROGRAM, 'Compute dtype of the model ("float32" or "bfloat16").',
     Choice(("float32", "bfloat16")), warm_start=True),
  _F("model_scan_layers", None, PROGRAM,
     "Stack the decoder blocks' parameters over layers and run them as one lax.scan in the "
     "training and scoring forward (compile time flat in depth; the same numbers; HF and PEFT "
     "files are per layer either way; a run's checkpoints are read in either layout, a resume "
     "with this field changed converting them). "
     "None: stacked for models of 0.4B parameters and more (models.ModelConfig.scan_layers).",
     Bool(none_ok=True), bool),
  _F("model_scan_decode", False, PROGRAM,
     "With stacked blocks, the samplers' prefill and decode steps run as one lax.scan too "
     "(their compile time flat in depth, the decode slower on the CPU: "
     "docs/results/compile_time.md); False: the samplers decode per layer. No effect on blocks "
     "stored per layer.", Bool()),
  _F("model_remat", False, PLACEMENT,
     "Rematerialise each decoder block in the training backward pass (jax.checkpoint): the "
     "train step keeps each block's input instead of its intermediates and recomputes them, "
     "about one more forward per step (same numbers up to float rounding, same checkpoint "
     "layout; may change on resume).", Bool()),
  _F("model_attention", "xla", PROGRAM,
     "Attention implementation: \"xla\" (ours: einsums over the head-major KV cache, the "
     "fastest on CPU) or \"dot_product\" (jax.nn.dot_product_attention, which JAX lowers to "
     "cuDNN flash attention on GPU). The same numbers within float tolerance.",
     Choice(("xla", "dot_product"))),
  _F("model_router_aux_coef", 0.001, PROGRAM,
     "Coefficient of the load-balancing auxiliary loss of a model with experts (the Switch "
     "loss, transformers' router_aux_loss_coef; models/moe.py), added to the policy loss "
     "weighted like it; 0 turns it off. A dense model ignores it.", Float(0)),
  _F("rollout.routing_replay", "off", PROGRAM,
     "Routing replay for a model with experts (models/moe.py): \"record\" stores every "
     "sampled token's experts with the batch and reports how often the learner's own routing "
     "agrees (moe/router_agreement); \"replay\" also routes the learner along them (R3, "
     "arXiv:2510.11370), its router still learning the mixing weights. The static sampler "
     "only (no continuous slots, partial rollouts or multi-turn episodes).",
     Choice(("off", "record", "replay"))),
  _F("rollout.decode_block", 32, PROGRAM,
     "Decode attention reads each row's own cached keys only up to the current step, in spans "
     "of this many slots, at most 3 spans (0 = the whole max_new_tokens cache at every step). "
     "Same numbers (docs/speed.md).",
     Int(0, note=" (0 = whole cache)")),
  _F("rollout.continuous_slots", 0, PROGRAM,
     "Continuous batching (sampling.continuous): this many times group_size rows "
     "decode at once and a row that has ended frees its slot for the next waiting row inside "
     "the same compiled loop, so no row decodes past its end (groups stay whole in the "
     "output); worth it when response lengths vary (EOS). Its draws use "
     "per-(prompt, sample, token) keys, so its samples differ from the static sampler's for the "
     "same seed. 0 = the static batch of all prompts_per_step groups. With "
     "rollout.continuous_auto_steps > 0, the number of slots the run switches to.",
     Int(0, note=" (0 = static batch)")),
  _F("rollout.continuous_auto_steps", 0, PROGRAM,
     "Automatic continuous batching: the run samples with the static batch for this many "
     "steps, measuring its decode waste (sampler/decode_waste: the fraction of decoded "
     "row-steps after a row had ended), then switches to continuous batching with "
     "rollout.continuous_slots slots if the mean waste over those steps exceeds "
     "rollout.continuous_waste_threshold (sampler/continuous in every row; the choice is "
     "kept in the checkpoints, so a resumed run makes the same one). lag.mode='sync' only. "
     "0 = no switch: continuous from the start if rollout.continuous_slots > 0.",
     Int(0, note=" (0 = off)")),
  _F("rollout.continuous_waste_threshold", 0.5, NUMBERS,
     "Mean decode waste of the static batch over the first rollout.continuous_auto_steps "
     "steps above which the run switches to continuous batching.",
     Float(0.0, 1.0, lo_open=True, hi_open=True)),
  _F("tokenizer", "", PROGRAM,
     "Tokenizer: \"\" uses the task's built-in character tokenizer; else a local HF directory.",
     Str(), warm_start=True),
  _F("task", "reverse", PROGRAM, "Task name for tasks.get_task.", Str(), warm_start=True),
  _F("task_kwargs", {}, PROGRAM,
     "Keyword arguments for tasks.get_task (e.g. data file paths for text tasks).",
     warm_start=True),
  _F("max_prompt_len", 16, PROGRAM,
     "Prompts are left-padded to this many tokens (static shape).", _POS, warm_start=True),
  _F("max_new_tokens", 8, PROGRAM,
     "Responses are sampled up to this many tokens (static shape).", _POS, warm_start=True),
  _F("data.truncate_prompts", False, PROGRAM,
     "Prompts longer than max_prompt_len: False fails at start-up naming the row "
     "(data_checks.validate_data); True keeps their last max_prompt_len tokens (the question "
     "and the generation prompt) and counts them in the prompts_truncated metric.", Bool(),
     warm_start=True),
  _F("rollout.partial_budget", 0, PROGRAM,
     "Partial rollouts (APRIL): decode at most this many tokens per response per loop step; "
     "unfinished responses continue at the next step under the newer parameters (re-prefilled), "
     "every token keeping its own version (0 = off: whole responses). With multi-turn episodes: "
     "at most this many policy tokens per trajectory per step (rollout.episode_pool). Under "
     "lag.mode='async' the sampler thread carries the pool.",
     Int(0, note=" (0 = off)")),
  _F("temperature", 1.0, PROGRAM, "Sampling temperature of the behaviour policy.",
     Float(0, lo_open=True)),
  _F("top_p", 1.0, PROGRAM, "Nucleus sampling threshold (1.0 = off).",
     Float(0, 1, lo_open=True)),
  _F("top_k", 0, PROGRAM, "Top-k sampling (0 = off).", Int(0, note=" (0 = off)")),
  _F("rollout.behavior_logp", "sampled", PROGRAM,
     "What the sampler records as the behaviour log-prob mu, and so what the learner scores "
     "(docs/science.md s7; the same without top_k / top_p). \"sampled\": the log-prob of the "
     "tempered, top-k / top-p truncated and renormalised distribution it drew from; the learner "
     "scores that distribution (the kept set's size is recorded per token), so ratios are 1 at "
     "the behaviour's parameters. Right when the truncated sampler is the policy being trained "
     "and deployed. \"full\": the untruncated tempered log-prob; the learner scores the full "
     "tempered softmax, and truncation is part of the environment (it filters which tokens are "
     "tried, the policy is the full softmax). Right when the policy will be used without "
     "truncation, or to match trainers that score the full softmax. \"mismatched\": records "
     "as \"sampled\" but the learner scores the full tempered softmax, the engine mismatch of "
     "a learner that ignores the sampler's truncation (on-policy ratios Z <= 1): a setting for "
     "studying corrections (docs/off_policyness.md), not for training.",
     Choice(("sampled", "full", "mismatched"))),
  _F("rollout.sampler_dtype", "", PROGRAM,
     "Compute dtype of the sampler (\"\" = model_dtype). \"bfloat16\" with an float32 learner "
     "is the engine mismatch of a bf16 inference engine: the same parameters, other numerics, "
     "so the learner's ratios at the behaviour's parameters are not 1 (behavior_ratio_*, "
     "docs/science.md s7).", Choice(("", "float32", "bfloat16")), warm_start=True),
  _F("rollout.score_old", False, PROGRAM,
     "The learner also scores every sampled token at the sampling parameters (log pi_old: one "
     "more forward pass of each batch), so pi / mu factors into staleness pi / pi_old and "
     "engine mismatch pi_old / mu, both reported in every row and available to losses "
     "(docs/science.md s7). Forced on by a loss that corrects pi_old / mu. False: pi_old = mu.",
     Bool()),
  _F("group_size", 8, PROGRAM,
     "K: responses sampled per prompt (>= 2 for group-relative advantages).",
     Int(2, note=" (group-relative advantages)")),
  _F("prompts_per_step", 8, PROGRAM, "G: prompts per optimizer step (batch = G * K responses).",
     _POS),
  _F("reward_timeout", 5.0, PLACEMENT,
     "Seconds one host reward call may take in its verifier worker before it is scored 0 "
     "(counted in reward_timeouts) and its worker is killed and replaced.",
     Float(0, lo_open=True, unit="seconds")),
  _F("reward_batch_timeout", 0.0, PLACEMENT,
     "Seconds the host rewards of one batch may take in all (0: 2 * reward_timeout).",
     Float(0, lo_open=True, unit="seconds", note=" (or 0: 2 * reward_timeout)", also=(0,))),
  _F("reward_workers", 0, PLACEMENT,
     "Sandboxed verifier worker processes for host rewards (0: one per CPU).",
     Int(0, note=" (0 = one per CPU)")),
  _F("reward_memory_mb", 2048, PLACEMENT,
     "Address-space limit of each verifier worker, in MiB.", Int(256)),
  _F("reward_sandbox", "strict", PLACEMENT,
     '"strict": refuse to run verifiers where Landlock/seccomp are unavailable; "warn": run '
     "them with what the platform offers and log what is missing.",
     Choice(("strict", "warn"))),
  # Loss: a preset and its overrides (None keeps the preset's value).
  _F("loss.name", "rec_oneside_nois", PROGRAM, "Loss preset name (losses.names())."),
  _F("loss.eps_low", None, PROGRAM, "Lower ratio bound: keep rho >= 1 - eps_low.", _OVERRIDE,
     float),
  _F("loss.eps_high", None, PROGRAM, "Upper ratio bound: keep rho <= 1 + eps_high.", _OVERRIDE,
     float),
  _F("loss.eps_low_prime", None, PROGRAM, "Ring mask outer lower bound (rec_ring_*).",
     _OVERRIDE, float),
  _F("loss.eps_high_prime", None, PROGRAM, "Ring mask outer upper bound (rec_ring_*).",
     _OVERRIDE, float),
  _F("loss.dual_clip_c", None, PROGRAM, "Dual-clip constant c for A < 0.", _OVERRIDE, float),
  _F("loss.reg_coef", None, PROGRAM,
     "Coefficient of the k2 / forward-KL regulariser towards the behaviour policy.", _OVERRIDE,
     float),
  _F("loss.kl_coef", None, PROGRAM, "Coefficient of the KL to the reference policy.", _OVERRIDE,
     float),
  _F("loss.entropy_coef", None, PROGRAM, "Entropy bonus coefficient.", _OVERRIDE, float),
  _F("loss.temp", None, PROGRAM, "RED-Weight temperature.", _OVERRIDE, float),
  _F("loss.agg", None, PROGRAM,
     "Aggregation: token_mean, seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm.",
     Str(none_ok=True), str),
  _F("advantage.name", "", PROGRAM,
     'Advantage estimator (advantages.names()); "" picks the loss preset\'s default, '
     "losses.default_advantage(loss.name): grpo for grpo/dapo-style presets, opmd for oapl, "
     "else group_mean.", Str()),
  _F("critic.estimator", "", PROGRAM,
     'Critic (learn.critic): "gae" (PPO with a value head, GAE advantages), "vtrace" (IMPALA '
     'V-trace advantages and targets), "none"; "" picks the loss preset\'s default, '
     "losses.default_critic(loss.name): gae for ppo_critic and rec_critic, vtrace for vtrace, "
     "else none. A critic adds a value head to the policy's trunk and replaces the group "
     "advantages with its token advantages.", Choice(("", "none", "gae", "vtrace"))),
  _F("critic.gamma", 1.0, PROGRAM, "Discount per policy token.", Float(0, 1)),
  _F("critic.lam", 0.95, PROGRAM, "GAE's lambda, or V-trace's trace lambda.", Float(0, 1)),
  _F("critic.value_coef", 0.5, PROGRAM,
     "Weight of the value loss (a token mean) against the policy loss.", Float(0, lo_open=True)),
  _F("critic.value_clip", 0.2, PROGRAM,
     "gae: clip range of the value loss around the values the step starts from (0 = off).",
     Float(0)),
  _F("critic.rho_bar", 1.0, PROGRAM,
     "vtrace: truncation of the importance weights of the TD errors (and of the policy "
     "gradient); >= critic.c_bar.", Float(0, lo_open=True)),
  _F("critic.c_bar", 1.0, PROGRAM, "vtrace: truncation of the traces; <= critic.rho_bar.",
     Float(0, lo_open=True)),
  _F("critic.whiten", True, PROGRAM,
     "gae: whiten the token advantages over the batch's valid tokens.", Bool()),
  _F("critic.kl_coef", None, PROGRAM,
     "Per-token KL penalty in the critic's rewards: every policy token pays -kl_coef (log mu - "
     "log pi_ref) against the run's starting parameters (learn.critic; PPO for language "
     "models' token-level KL; 0 = none). Keeps the reference parameters. None: the loss "
     "preset's recipe (run.critic_settings.RECIPES: 0.05 for ppo_critic), else 0.",
     Float(0, none_ok=True), float),
  _F("critic.reward_norm", None, PROGRAM,
     "Normalise and clip the rows' rewards by their running mean and standard deviation over "
     "the run before the critic's returns (\"Secrets of RLHF\" eq. 18; learn.critic, kept in "
     "the checkpoints). None: the loss preset's recipe (on for ppo_critic), else off. It "
     "cannot go with per-turn rewards, prompt values or the doubly robust OPE estimators "
     "(they read the values as rewards): there the recipe's stays off and True is refused.",
     Bool(none_ok=True), bool),
  _F("critic.warmup_steps", 0, PROGRAM,
     "A value warm start: the first this many loop steps train the critic alone (its value "
     "head on a frozen trunk, or a separate critic) while the policy's gradients and updates "
     "are zero, so it samples and learns nothing until the critic has seen that many batches "
     '("Secrets of RLHF" pretrains its critic). 0 = none.', Int(0, note=" (0 = none)")),
  _F("critic.reward_clip", 5.0, PROGRAM,
     "delta of critic.reward_norm's clipping: normalised rewards are kept in [-delta, delta].",
     Float(0, lo_open=True)),
  _F("critic.prompt_pool", 1, PROGRAM,
     "Prompt values (V_0, rollout.prompt_filter): read this many candidate prompts per prompt "
     "sampled and keep, of each run of them, the one the critic's value at the prompt predicts "
     "least likely to give a group of equal rewards; 1 = off (every prompt read is sampled). "
     "Needs a critic.", _POS),
  _F("critic.prompt_wrong", 0.0, PROGRAM,
     "The reward of a wrong response, for critic.prompt_pool's predicted success rate.",
     Float(-math.inf)),
  _F("critic.prompt_right", 1.0, PROGRAM,
     "The reward of a right response (> critic.prompt_wrong), for critic.prompt_pool.",
     Float(-math.inf)),
  _F("critic.lr_scale", 10.0, PROGRAM,
     "The value head's own AdamW learning rate, as a multiple of optimizer.learning_rate (the "
     "same schedule); the shared trunk follows the policy's optimizer. A separate critic "
     "(critic.model) trains wholly at this rate.", Float(0, lo_open=True)),
  _F("critic.model", "", PROGRAM,
     'The critic\'s own model (models.value): "" a value head on the policy\'s trunk; '
     '"policy" a separate critic of the policy\'s architecture starting as a copy of the '
     "policy's starting (warm-started) weights, its head at zero (the critic of \"Secrets of "
     'RLHF\"); or a preset name or Hugging Face directory / repo id of the policy\'s '
     "vocabulary, fresh from the seed or loaded (its value head from value_head.safetensors, "
     "else zero). A separate critic has its own forward, gradient clipping and checkpointed "
     "state; not with adapters (lora.rank).", Str()),
  _F("lag.mode", "sync", NUMBERS,
     '"sync": the exact schedule v(t) (offpolicy_jax.lag); "async": a sampler thread runs ahead.',
     Choice(("sync", "async"))),
  _F("lag.sync_interval", 4, NUMBERS,
     "m: parameters reach the sampler every m loop steps (batches), i.e. every "
     "m * train.num_minibatches * train.num_epochs optimizer steps (1 = on-policy).",
     _POS),
  _F("lag.sync_offset", 0, NUMBERS,
     "n: the first n steps use version 0; afterwards a constant extra lag of n.", _NONNEG),
  _F("lag.max_staleness", 0, NUMBERS,
     "Async mode: batches more than this many loop steps old are dropped (0 = no bound). "
     "With partial rollouts, 0 or at least ceil(max_new_tokens / rollout.partial_budget).",
     Int(0, note=" (0 = no bound)")),
  _F("lag.sampler_threads", 1, NUMBERS,
     "Async mode: sampler threads, each with a batch in flight; each thread after the first "
     "has verifier workers of its own (reward_workers each), so one batch's environment and "
     "tool waits overlap another's decoding. More threads mean staler batches. 1 with partial "
     "rollouts.", _POS),
  _F("replay.capacity_batches", 2, NUMBERS,
     "Buffer capacity in batches of G groups of K responses (the capacity is G * this groups; "
     "at least ceil(max_new_tokens / rollout.partial_budget) with partial rollouts).",
     _POS),
  _F("replay.policy", "fifo", NUMBERS,
     "Which groups a step trains on: fifo (oldest first; with max_reuse=1 each group once, the "
     "paper's one-pass setting), uniform, staleness (prefers fresh groups) or reward (prefers "
     "high mean reward); see offpolicy_jax.learn.replay."),
  _F("replay.max_reuse", 1, NUMBERS,
     "Times a group may be trained on before it is retired (0 = unlimited).",
     Int(0, note=" (0 = unlimited)")),
  _F("replay.temperature", 1.0, NUMBERS,
     "Softness of the staleness / reward policies: P(group) ~ exp(score / temperature).",
     Float(0, lo_open=True)),
  _F("train.num_minibatches", 1, PROGRAM,
     "Optimizer steps per epoch over each sampled batch (divides G*K). The parameter version "
     "counts optimizer steps: with U = num_minibatches * num_epochs a loop step advances it by "
     "U, and lag.sync_interval still counts loop steps (batches).", _POS),
  _F("train.num_epochs", 1, PROGRAM,
     "Passes over each sampled batch (reshuffled each epoch).", _POS),
  _F("train.micro_batch_size", 0, PROGRAM,
     "Rows per gradient-accumulation micro-batch (divides the minibatch of "
     "G * K / num_minibatches rows; 0 = the whole minibatch, no accumulation).",
     Int(0, note=" (0 = the whole minibatch)")),
  _F("train.shared_prefix", True, PROGRAM,
     "Run each group's prompt once and let its K responses attend to it (same log-probs and "
     "gradients as K copies, within float tolerance; less work). Applies when every "
     "micro-batch holds whole groups; otherwise the plain forward runs.", Bool()),
  _F("train.skip_zero_advantage", True, PROGRAM,
     "Leave rows whose advantages are all 0 out of the forward/backward pass where that is "
     "exact for the loss (losses.LossSpec.zero_advantage_inert; counted in the rows_skipped "
     "metric).", Bool()),
  _F("optimizer.learning_rate", 3e-4, PROGRAM, "Peak learning rate (AdamW).", Float(0)),
  _F("optimizer.warmup_steps", 0, PROGRAM, "Linear warm-up steps.", _NONNEG),
  _F("optimizer.b1", 0.9, PROGRAM, "AdamW beta1.", Float(0, 1, hi_open=True)),
  _F("optimizer.b2", 0.99, PROGRAM, "AdamW beta2.", Float(0, 1, hi_open=True)),
  _F("optimizer.weight_decay", 0.0, PROGRAM, "AdamW decoupled weight decay.", Float(0)),
  _F("optimizer.grad_clip", 1.0, PROGRAM, "Global gradient-norm clip (0 = off).", Float(0)),
  _F("optimizer.moment_dtype", "float32", PROGRAM,
     "Dtype of both Adam moments between steps (bfloat16: half the optimizer memory; the "
     "update is computed in float32; keep b2 <= 0.99, whose increments bfloat16 resolves).",
     Choice(("float32", "bfloat16"))),
  _F("lora.rank", 0, PROGRAM,
     "Rank r of low-rank adapters on the decoder's projections (0 = off: full fine-tuning). "
     "With r > 0 only the adapters train; snapshots, the reference and proximal policies and "
     "the sampler's copies hold adapters, the frozen base is held once (docs/lora.md).",
     Int(0, note=" (0 = off)"), warm_start=True),
  _F("lora.alpha", 32.0, PROGRAM,
     "Adapter scale numerator: the update is (alpha / r) x A B (PEFT's lora_alpha).",
     Float(0, lo_open=True), warm_start=True),
  _F("lora.targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", PROGRAM,
     "Comma-separated projections that get adapters.",
     Names(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
     warm_start=True),
  _F("lora.dropout", 0.0, PROGRAM,
     "Dropout p on each adapter's input, (alpha / r) dropout(x) A B (PEFT's lora_dropout), in "
     "the train step's current-policy forward only (never the sampler, the old / behaviour "
     "scoring, the reference or evaluation); needs lora.rank > 0.",
     Float(0, 1, hi_open=True)),
  _F("multiturn.max_turns", 0, PROGRAM,
     "Multi-turn episodes (docs/multiturn.md): at most this many policy turns per trajectory, "
     "each answered by the task's environment in the sandboxed workers (0 = single-turn; "
     "needs a task with an environment).", Int(0, note=" (0 = single-turn)")),
  _F("multiturn.turn_tokens", 0, PROGRAM,
     "Token budget of one policy turn (0 = max_new_tokens); max_new_tokens bounds the whole "
     "trajectory, policy and observation tokens together.", Int(0, note=" (0 = max_new_tokens)")),
  _F("multiturn.observation_tokens", 16, PROGRAM,
     "Longest observation kept in a trajectory, in tokens (longer ones are cut and counted).",
     _POS),
  _F("multiturn.credit", "trajectory", PROGRAM,
     "Credit of multi-turn trajectories: 'trajectory' (the summed reward, group-relative over "
     "the K trajectories of a prompt) or 'turn' (each turn's tokens get the discounted sum of "
     "the group-relative rewards paid after it and later turns; advantages.per_turn; with a "
     "critic, each turn's reward is paid on its last token and the critic credits it).",
     Choice(("trajectory", "turn"))),
  _F("multiturn.gamma", 1.0, PROGRAM,
     "Per-turn discount of multiturn.credit = 'turn'.", Float(0, 1)),
  _F("mesh.data", 1, PLACEMENT, "Data-parallel mesh axis size (-1 fills the remaining devices).",
     Int(1, note=" or -1", also=(-1,)), warm_start=True),
  _F("mesh.fsdp", 1, PLACEMENT, "Fully-sharded (parameter) axis size.",
     Int(1, note=" or -1", also=(-1,)), warm_start=True),
  _F("mesh.tensor", 1, PLACEMENT, "Tensor-parallel axis size.",
     Int(1, note=" or -1", also=(-1,)), warm_start=True),
  _F("mesh.sampler_devices", 0, PLACEMENT,
     "Disaggregated mode: devices of the sampler's own mesh (0 = sampler and trainer share the "
     "mesh). Each process gives its first sampler_devices / processes local devices to the "
     "sampler; data * fsdp * tensor above must then use all the others.",
     Int(0, note=" (0 = the sampler shares the trainer's mesh)"), warm_start=True),
  _F("sft.enabled", True, NUMBERS,
     "Supervised warm start on the task's reference answers before RL, of a preset's random "
     "initialisation (a model loaded with weights skips it unless sft.on_loaded_model).", Bool()),
  _F("sft.on_loaded_model", False, NUMBERS,
     "Warm-start a model loaded with weights too (config.model an HF directory or repo id, e.g. "
     "an earlier run's export): by default such a model starts RL as it is, since the warm "
     "start would overwrite what it learned.", Bool()),
  _F("sft.steps", 150, NUMBERS, "Supervised steps."),
  _F("sft.batch_size", 64, NUMBERS, "Examples per supervised step."),
  _F("sft.learning_rate", 3e-3, NUMBERS, "Supervised learning rate (AdamW).", Float(0)),
  _F("sft.distractor", 0.0, NUMBERS,
     "Fraction of warm-start examples whose demonstration is the task's distractor answer "
     "(Task.distractor: reverse shows the digits unreversed), a fixed draw per example: a "
     "warm start that imitates a mix of right and wrong behaviour, which RL has to sort out.",
     Float(0, 1, hi_open=True)),
  _F("eval_every", 200, CONTROL, "Evaluate every this many steps (0 = only at the end).",
     _NONNEG),
  _F("eval_prompts", 64, CONTROL, "Held-out prompts per evaluation.", _NONNEG),
  _F("eval_samples", 4, CONTROL,
     "Samples per eval prompt for pass@k (k = this; 1 = greedy accuracy only, no pass@k).",
     Int(1, note=" (1 = greedy accuracy only, no pass@k)")),
  _F("eval_ope", "is,wis,pdwis", CONTROL,
     "Off-policy estimators (ope.names(), comma-separated; \"\" = off) of the current "
     "policy's expected reward from the replay buffer's rows, logged as ope/* in every eval "
     "row (learn.buffer_ope, docs/ope.md); the doubly robust dr and wdr need a critic "
     "(critic.estimator).", Names(OPE_ESTIMATORS, empty_ok=True)),
  _F("checkpoint_every", 100, NO_CELL_EFFECT,
     "Save a checkpoint every this many steps (0 = only at the end).", _NONNEG),
  _F("log_every", 10, NO_CELL_EFFECT,
     "Loop steps per jitted chunk (device rewards): metrics are fetched and written every "
     "gcd(log_every, eval_every, checkpoint_every) steps.", _POS),
  _F("profile_steps", 0, NO_CELL_EFFECT,
     "Trace at least this many loop steps, in whole chunks from the second chunk on "
     "(compilation is not in it), with jax.profiler into <workdir>/profile, viewable in "
     "TensorBoard/XProf; 0 = off.", _NONNEG),
  _F("keep_checkpoints", 2, NO_CELL_EFFECT, "Checkpoints kept.", _POS),
  _F("async_checkpoint", True, NO_CELL_EFFECT, "Save checkpoints in a background thread.",
     Bool()),
  _F("tensorboard", True, NO_CELL_EFFECT, "Write TensorBoard event files under workdir/tb.",
     Bool()),
  _F("wandb_project", "", NO_CELL_EFFECT,
     'Weights & Biases project ("" = off; used only if wandb is installed).', Str()),
  _F("progress", True, NO_CELL_EFFECT, "Show a progress bar.", Bool()),
)  # fmt: skip

# `config.study` of a study config (configs/lag_study.py; study.grid reads it).
STUDY_FIELDS: tuple[Field, ...] = (
  _F("study.methods", "grpo", NUMBERS,
     "Methods: name=loss_preset[+advantage], comma-separated (no value: the preset of that "
     "name with its default advantage).", Str()),
  _F("study.lags", "onpolicy=1/0", NUMBERS,
     "Lag schedules: name=m/n (sync_interval / sync_offset, docs/science.md section 5) or "
     "name=offline, comma-separated.", Str()),
  _F("study.seeds", 5, NUMBERS,
     "Seeds per cell (seed, seed + 1, ...): each has its own warm start and prompt order.",
     Int(2, note=" (intervals need two)")),
  _F("study.vmap_seeds", 0, NO_CELL_EFFECT,
     "Seeds per vmapped program (0: every seed of a cell at once; 1 for large models).",
     _NONNEG),
  _F("study.eval_batch", 0, NO_CELL_EFFECT,
     "Held-out prompts per sampler call (0: all at once).", _NONNEG),
  _F("study.eval_last", 2, NO_CELL_EFFECT,
     "A run's final accuracy is the mean of its last `eval_last` evaluations (in the report; "
     "a cell keeps every evaluation).", _POS),
  _F("study.baseline", "grpo@onpolicy", NO_CELL_EFFECT,
     "Every cell is compared with this one on the same seeds: <method>@<lag>.", Str()),
  _F("study.alpha", 0.05, NO_CELL_EFFECT,
     "Level of the report's verdicts: `better`/`worse` when the Holm-adjusted (over the "
     "grid's comparisons) paired sign-flip permutation p-value is <= alpha (study.stats).",
     Float(0, 1, lo_open=True, hi_open=True)),
  _F("study.equivalence_margin", 0.03, NO_CELL_EFFECT,
     "Declared in advance: a difference in accuracy shown (two one-sided t tests, "
     "Holm-adjusted) to lie within +-margin is marked equivalent in the report (0: no "
     "equivalence verdicts).", Float(0)),
  _F("study.aa_lags", "all", NO_CELL_EFFECT,
     "A/A calibration: lags at which the baseline method runs a second time with other "
     "random streams on the same warm starts and prompts ('all', '' for none, or lag "
     "names, comma-separated); the report gives the false-verdict rate of these pairs.",
     Str()),
  _F("study.ope", "", NUMBERS,
     "Off-policy estimators (ope.names(), comma-separated; \"\" = off) a cell runs on each "
     "seed's replay buffer at every evaluation, beside the truth they estimate: the mean "
     "reward of eval_samples fresh samples at the training temperature on eval_prompts "
     "prompts of the training split, the buffer's own (more sampling). The report gives each "
     "estimator's error and interval coverage by lag (docs/ope.md).",
     Names(OPE_ESTIMATORS, empty_ok=True)),
  _F("study.bandit_steps", 300, NO_CELL_EFFECT, "The bandit study: SGD steps.", _POS),
  _F("study.bandit_group_size", 8, NO_CELL_EFFECT, "The bandit study: arms sampled per step.",
     _POS),
  _F("study.bandit_lr", 1.0, NO_CELL_EFFECT, "The bandit study: learning rate.",
     Float(0, lo_open=True)),
)  # fmt: skip

# Fields no longer in the schema, with the value that meant what their absence means now:
# a run recorded with that value resumes without a config change.
RETIRED: dict[str, Any] = {"optimizer.micro_batches": 1}

_BY_NAME = {f.name: f for f in (*RUN_FIELDS, *STUDY_FIELDS)}


# ----------------------------------------------------------------- readers


def config_dict(
  fields: Iterable[Field] = RUN_FIELDS, into: ml_collections.ConfigDict | None = None
) -> ml_collections.ConfigDict:
  """A ConfigDict of `fields` at their defaults (added to `into`, unlocked, if given)."""
  c = ml_collections.ConfigDict() if into is None else into
  for f in fields:
    *parents, leaf = f.name.split(".")
    node = c
    for p in parents:
      if p not in node:
        node[p] = ml_collections.ConfigDict()
      node = node[p]
    if isinstance(f.default, dict):
      node[leaf] = ml_collections.ConfigDict(f.default)
    elif f.default is None:
      node[leaf] = _config_dict.placeholder(f.value_type)
    else:
      node[leaf] = f.default
  return c


def get(config: Any, name: str) -> Any:
  """The value of the dotted field `name` in a ConfigDict or nested dict."""
  for part in name.split("."):
    config = config[part]
  return config


def field(name: str) -> Field | None:
  """The declared field `name`, or the one whose free keys hold it (task_kwargs.x), or None."""
  parts = name.split(".")
  for i in range(len(parts), 0, -1):
    f = _BY_NAME.get(".".join(parts[:i]))
    if f is not None:
      return f
  return None


def role_of(name: str) -> Role:
  """The role of the dotted field `name`; an undeclared field is taken to change everything."""
  f = field(name)
  return PROGRAM if f is None else f.role


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """`{dotted leaf name: value}` of a nested mapping (an empty mapping is a leaf)."""
  out: dict[str, Any] = {}
  for k, v in d.items():
    if isinstance(v, Mapping) and v:
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def check(config: Any, fields: Iterable[Field] = RUN_FIELDS) -> None:
  """Runs the declared check of every field in `fields`.

  Raises:
    ValueError: `config.<field>: <complaint>` for the first field that fails.
  """
  for f in fields:
    if f.check is not None:
      complaint = f.check(get(config, f.name))
      if complaint:
        raise errors.ConfigError(f"config.{f.name}: {complaint}")
