# size: declaration table: every metric a run's rows can hold, declared once
"""Every metric a run writes, declared once: its group, when rows hold it, its unit and meaning.

A metric is declared here and nowhere else:

- `docs/metrics.md`'s key tables are generated from `GROUPS`
  (`python -m offpolicy_jax.metric_names` prints them; a test compares);
- its TensorBoard tag is `<group>/<key>` (`store.metrics.tb_tag`; a key with a
  "/" keeps its own prefix, which is its group);
- a loss's metric combines over micro-batches and optimizer steps by its
  declared `reduction` (`learn.micro_batch_loss`; undeclared: a mean weighted
  by the loss's tokens), so no name suffix decides it;
- `study="csv"` records its mean over a run's steps in each study run's
  record and `study.csv`; `study="table"` also tabulates it in `study.md`
  (`study.cell`, `study.report_tables`).

A metric born in a notebook (a new loss's diagnostic) is declared with
`register("offpolicy", Metric("my_ratio_max", "loss.name=mine", "ratio", "...",
reduction=MAX, study="table"))`: the same places pick it up. Keys that are not
declared one by one (a loss's own diagnostics) find their group by the
prefixes of `PATTERNS`, else `DEFAULT_GROUP`.
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import NamedTuple

MEAN, SUM, MAX, MIN = "mean", "sum", "max", "min"
REDUCTIONS = (MEAN, SUM, MAX, MIN)
STUDY = ("", "csv", "table")


@dataclasses.dataclass(frozen=True)
class Metric:
  """One row key (module docstring).

  Attributes:
    name: the key as rows hold it.
    present: which rows hold it: "default" (every row of the default run), or
      the setting that adds it.
    unit: its unit.
    doc: what it measures and how to read it (Markdown).
    reduction: how values of micro-batches and optimizer steps combine (`REDUCTIONS`).
    study: "" (not recorded by a study), "csv" or "table" (module docstring).
  """

  name: str
  present: str
  unit: str
  doc: str
  reduction: str = MEAN
  study: str = ""

  def __post_init__(self):
    if self.reduction not in REDUCTIONS:
      raise ValueError(f"metric {self.name}: reduction {self.reduction!r} not in {REDUCTIONS}")
    if self.study not in STUDY:
      raise ValueError(f"metric {self.name}: study {self.study!r} not in {STUDY}")


class Group(NamedTuple):
  """A TensorBoard group and section of docs/metrics.md: its title, intro and metrics."""

  title: str
  intro: str
  metrics: tuple[Metric, ...]


M = Metric

GROUPS: dict[str, Group] = {
  "train": Group(
    "the learning signal",
    "",
    (
      M(
        "reward_mean",
        "default",
        "reward",
        "Mean reward of the batch's responses (the task's reward: 0 or 1 for exact-match tasks). "
        "The main curve: it should rise.",
      ),
      M(
        "reward_std",
        "default",
        "reward",
        "Standard deviation of those rewards over the batch (not within groups).",
      ),
      M(
        "accuracy",
        "default",
        "fraction",
        "Fraction of the batch's responses with reward > 0.5: the sampled solve rate (greedy "
        "accuracy is `eval/accuracy`).",
      ),
      M(
        "response_len",
        "default",
        "tokens",
        "Mean response length of the batch's rows (policy tokens only in multi-turn runs).",
      ),
      M(
        "response_tokens",
        "default",
        "tokens",
        "Response tokens of the batch's rows; `tokens_per_s` divides it by the step time.",
      ),
      M(
        "sampled_tokens",
        "default",
        "tokens",
        "Response tokens of the rows this step's rollout finished and buffered (policy tokens "
        "only; partial rollouts: the groups emitted this step). What `cost/sampled_tokens` sums.",
      ),
      M(
        "sampled_prompt_tokens",
        "default",
        "tokens",
        "Prompt tokens of those rows' groups, one prefill per group.",
      ),
      M(
        "groups_all_equal",
        "default",
        "fraction",
        "Fraction of the batch's groups (prompts) whose K rewards are all equal: their "
        "group-relative advantages are 0 and they teach nothing. Near 1: the task is too easy or "
        "too hard for the policy.",
      ),
      M(
        "adv_abs_mean",
        "default",
        "advantage",
        "Mean absolute advantage per row (per-token advantages: the row's mean): the size of the "
        "learning signal; 0 when every group is all-equal. With a critic it is still the "
        "group's, which the critic's token advantages replace in the loss (`critic/*`).",
      ),
      M(
        "loss",
        "default",
        "loss",
        "The policy loss, `loss_sum / loss_count` (regularisers included). Group-relative "
        "advantages average 0, so it hovers near 0 and its value does not track progress; watch "
        "for spikes.",
      ),
      M(
        "loss_count",
        "default",
        "tokens or rows",
        "The loss's denominator under `loss.agg`: weighted valid tokens for `token_mean`, "
        "sequences for the `seq_mean_*` modes.",
      ),
      M(
        "entropy",
        "default",
        "nats",
        "Mean entropy of pi's next-token distribution (at the sampling temperature) over the "
        "response tokens. A fast fall is entropy collapse: the policy stops exploring.",
      ),
      M(
        "grad_norm",
        "default",
        "L2 norm",
        "Global norm of the gradient (after dividing by `loss_count`, before the "
        "`optimizer.grad_clip` clip), mean over optimizer steps. Spikes precede instability; 0 "
        "when nothing moved the loss.",
      ),
      M(
        "tokens",
        "default",
        "tokens",
        "Response tokens the optimizer steps ran the loss over, summed over minibatches and epochs"
        " (fillers included).",
      ),
      M(
        "rows_skipped",
        "default",
        "rows",
        "Rows left out of the forward/backward pass because all their advantages are 0 "
        "(`train.skip_zero_advantage`, exact for losses where such rows cannot move the loss), "
        "summed over optimizer steps. Saved work; not lost data.",
      ),
      M(
        "reg",
        "`loss.reg` set",
        "loss",
        "Mean per-token value of the loss's regulariser penalty.",
      ),
      M(
        "kl_ref",
        "`loss.kl_coef` > 0",
        "nats",
        "Mean per-token KL(pi \\|\\| reference) estimate (`loss.kl_kind`) the loss penalises.",
      ),
      M(
        "cov_selected_frac",
        "`loss.cov` set",
        "fraction",
        "Fraction of tokens Clip-Cov / KL-Cov selected.",
      ),
    ),
  ),
  "offpolicy": Group(
    "how far the batch is from the policy being trained",
    "",
    (
      M(
        "version",
        "default",
        "optimizer steps",
        "The trainer's parameter version after this step: optimizer steps taken so far (skipped "
        "ones included).",
      ),
      M(
        "behavior_version",
        "default",
        "optimizer steps",
        "Version of the parameters that sampled the batch, `v(t) * U` "
        "([docs/science.md](science.md) s5); async mode: the oldest token's version.",
      ),
      M(
        "staleness_mean",
        "default",
        "optimizer steps",
        "Mean over tokens of the trainer's version at the start of the step minus the version that"
        " sampled the token: optimizer steps between the sampling parameters and the ones being "
        "updated. 0 on-policy; the default sawtooth lag (`lag.sync_interval=4`) cycles 0, 1, 2, 3.",
      ),
      M(
        "staleness_max",
        "default",
        "optimizer steps",
        "The largest token staleness in the batch.",
        reduction=MAX,
      ),
      M(
        "ratio_mean",
        "default",
        "ratio",
        "Mean over tokens of the loss's trust-region ratio rho = pi / anchor (the anchor is mu by "
        "default, `loss.ratio`; pi_old or the proximal parameters otherwise). 1 on-policy at the "
        "first optimizer step.",
      ),
      M(
        "ratio_min",
        "default",
        "ratio",
        "Smallest token ratio (over micro-batches and optimizer steps).",
        reduction=MIN,
      ),
      M(
        "ratio_max",
        "default",
        "ratio",
        "Largest token ratio. Far above 1 + `loss.eps_high`: the batch is far off-policy.",
        reduction=MAX,
      ),
      M(
        "clip_frac_pos",
        "default",
        "fraction",
        "The same over tokens with a positive advantage.",
      ),
      M(
        "clip_frac_neg",
        "default",
        "fraction",
        "The same over tokens with a negative advantage.",
      ),
      M(
        "ess",
        "default",
        "fraction",
        "Normalised effective sample size `E[w]^2 / E[w^2]` of the token weights w = pi / mu: 1 "
        "when all weights are equal (on-policy), towards 0 when few tokens carry the weight.",
      ),
      M(
        "kl_k1",
        "default",
        "nats",
        "KL(mu \\|\\| pi) estimated by the loss from the sampled tokens, k1 = mean of log mu - log "
        "pi: unbiased but noisy, can be negative. Equals `behavior_kl_k1`.",
      ),
      M(
        "kl_k3",
        "default",
        "nats",
        "The k3 estimate, mean of `exp(u) - 1 - u` with u = log pi - log mu: never negative, low "
        "variance; the one to plot. Equals `behavior_kl_k3`.",
      ),
      M(
        "behavior_kl_k1",
        "default",
        "nats",
        "KL(mu \\|\\| pi), k1 estimate (`offpolicy_jax/learn/diagnostics.py`): the whole gap "
        "between sampler and trainer.",
      ),
      M(
        "behavior_kl_k2",
        "default",
        "nats",
        "The same, k2 = mean of u^2 / 2.",
      ),
      M(
        "behavior_kl_k3",
        "default",
        "nats",
        "The same, k3 estimate.",
        study="csv",
      ),
      M(
        "behavior_ratio_p1",
        "default",
        "ratio",
        "1st percentile (nearest rank) of the token ratios pi / mu.",
      ),
      M(
        "behavior_ratio_p50",
        "default",
        "ratio",
        "Median of pi / mu (1 on-policy).",
      ),
      M(
        "behavior_ratio_p99",
        "default",
        "ratio",
        "99th percentile of pi / mu.",
      ),
      M(
        "behavior_ratio_tail_low",
        "default",
        "fraction",
        "Fraction of tokens with pi / mu below 0.5.",
      ),
      M(
        "behavior_ratio_tail_high",
        "default",
        "fraction",
        "Fraction of tokens with pi / mu above 2.",
      ),
      M(
        "staleness_kl_k1",
        "default",
        "nats",
        "KL(pi_old \\|\\| pi), k1 estimate: the part of the gap due to staleness and the update in "
        "progress. Without `rollout.score_old` (default) pi_old = mu and it equals "
        "`behavior_kl_k1`.",
      ),
      M(
        "staleness_kl_k2",
        "default",
        "nats",
        "The same, k2 estimate.",
      ),
      M(
        "staleness_kl_k3",
        "default",
        "nats",
        "The same, k3 estimate.",
        study="table",
      ),
      M(
        "mismatch_kl_k1",
        "default",
        "nats",
        "KL(mu \\|\\| pi_old), k1 estimate over the whole batch: the engine mismatch, what the "
        "sampler's numerics or truncation add at the same parameters. 0 without "
        "`rollout.score_old`.",
      ),
      M(
        "mismatch_kl_k2",
        "default",
        "nats",
        "The same, k2 estimate.",
      ),
      M(
        "mismatch_kl_k3",
        "default",
        "nats",
        "The same, k3 estimate.",
        study="table",
      ),
      M(
        "clip_frac",
        "default",
        "fraction",
        "Fraction of tokens whose gradient the loss zeroed or bounded (clip, mask, or a "
        "correction's drop or truncation). It grows with staleness; near 1 the step learns little.",
        study="table",
      ),
      M(
        "mismatch_ratio_p1",
        "default",
        "ratio",
        "1st percentile of the token ratios pi_old / mu (1 without `rollout.score_old`).",
      ),
      M(
        "mismatch_ratio_p50",
        "default",
        "ratio",
        "Median of pi_old / mu.",
      ),
      M(
        "mismatch_ratio_p99",
        "default",
        "ratio",
        "99th percentile of pi_old / mu.",
      ),
      M(
        "mismatch_ratio_tail_low",
        "default",
        "fraction",
        "Fraction of tokens with pi_old / mu below 0.5.",
      ),
      M(
        "mismatch_ratio_tail_high",
        "default",
        "fraction",
        "Fraction of tokens with pi_old / mu above 2.",
      ),
      M(
        "replay_selected",
        "default",
        "groups",
        "Groups the replay buffer had eligible for this step's batch: `prompts_per_step` when it "
        "had enough; fewer means the batch was padded with weight-0 fillers.",
      ),
      M(
        "behavior_ratio_mean",
        "`loss.ratio` not `behavior`",
        "ratio",
        "Mean of pi / mu over tokens (then `ratio_*` is about the loss's anchor, not mu).",
      ),
      M(
        "behavior_ratio_min",
        "`loss.ratio` not `behavior`",
        "ratio",
        "Smallest token pi / mu.",
        reduction=MIN,
      ),
      M(
        "behavior_ratio_max",
        "`loss.ratio` not `behavior`",
        "ratio",
        "Largest token pi / mu.",
        reduction=MAX,
      ),
      M(
        "corr_token_masked_frac",
        "a rollout correction",
        "fraction",
        "Fraction of valid tokens any correction zeroed ([docs/losses.md](losses.md)).",
        study="table",
      ),
      M(
        "corr_seq_masked_frac",
        "a rollout correction",
        "fraction",
        "Fraction of rows with every valid token zeroed by a correction.",
        study="table",
      ),
      M(
        "corr_token_truncated_frac",
        "a rollout correction",
        "fraction",
        "Fraction of tokens whose weight TIS truncated.",
        study="csv",
      ),
      M(
        "corr_seq_truncated_frac",
        "a rollout correction",
        "fraction",
        "Fraction of rows with at least one token whose weight TIS truncated.",
      ),
      M(
        "corr_<m>_token_frac",
        "a rollout correction",
        "fraction",
        "Per active mechanism `m` (`band`, `reject`, `veto`, `trm`, `opsm`): tokens it dropped; "
        "`corr_<m>_seq_frac`: rows.",
      ),
      M(
        "corr_weight_mean",
        "a rollout correction",
        "weight",
        "Mean correction weight.",
      ),
      M(
        "corr_kl_k1",
        "a rollout correction",
        "nats",
        "KL(mu \\|\\| pi_x) over valid tokens (x the corrected ratio's numerator); `corr_kl_k3` "
        "the k3 estimate, `corr_kl_k1_kept` / `corr_kl_k3_kept` over the kept tokens only.",
      ),
      M(
        "opsm_drop_frac",
        "`loss.seq_filter=opsm`",
        "fraction",
        "Fraction of tokens the OPSM sequence filter dropped.",
      ),
      M(
        "m2po_tau",
        "`loss.adaptive=m2po`",
        "log-ratio",
        "The adaptive band half-width tau (band `[e^-tau, e^tau]`).",
      ),
      M(
        "bapo_low",
        "`loss.adaptive=bapo`",
        "ratio",
        "BAPO's adapted lower bound; `bapo_high` the upper one.",
      ),
      M(
        "partial_emitted_groups",
        "partial rollouts",
        "groups",
        "Finished groups handed to the replay buffer this step "
        "([docs/lag_and_study.md](lag_and_study.md#partial-rollouts)).",
      ),
      M(
        "partial_inflight_groups",
        "partial rollouts",
        "groups",
        "Groups left unfinished in the pool.",
      ),
      M(
        "partial_mixed_rows",
        "partial rollouts",
        "fraction",
        "Fraction of emitted rows whose tokens come from more than one parameter version.",
      ),
      M(
        "partial_dropped_prompts",
        "partial rollouts",
        "groups",
        "Groups refused for want of a slot (0 by construction).",
      ),
      M(
        "async_dropped_batches",
        "`lag.mode=async`",
        "batches",
        "Running total of sampled batches dropped for exceeding `lag.max_staleness`.",
      ),
      M(
        "async_dropped_tokens",
        "`lag.mode=async`",
        "tokens",
        "Response tokens of the batches dropped since the previous step (counted in "
        "`cost/sampled_tokens`).",
      ),
      M(
        "async_sampler_busy_s",
        "`lag.mode=async`",
        "seconds",
        "The sampler's sampling seconds since the previous step, dropped batches included (what "
        "`time/run_sampler_busy_s` sums in async runs); with `lag.sampler_threads` > 1, the "
        "seconds in which at least one thread was sampling.",
      ),
    ),
  ),
  "speed": Group(
    "time and throughput",
    "",
    (
      M(
        "step_time_s",
        "default",
        "seconds",
        "Wall time of one loop step: the chunk's time (from the end of the previous chunk's row "
        "writing to the end of its own work; evaluations and checkpoints excluded) divided by its "
        "steps. The first chunk includes compilation.",
      ),
      M(
        "tokens_per_s",
        "default",
        "tokens/s",
        "`response_tokens / step_time_s`: the batch's response tokens per second of step.",
      ),
      M(
        "compiles",
        "default",
        "count",
        "XLA compilations in this process since the loop started (the warm start's excluded, "
        "evaluations' included). It rises in the first chunks and then stays flat; a count that "
        "keeps rising means something recompiles.",
      ),
      M(
        "reward_time_s",
        "default",
        "seconds",
        "Time the host reward took to score the step's responses (0 with a device reward; "
        "multi-turn: the episodes' time). With several processes, the slowest one's, and "
        "`reward_time_s/process<i>` each one's.",
      ),
      M(
        "reshard_time_s",
        "disaggregated sampler",
        "seconds",
        "Time from the trainer's parameters being ready to the copy being on the sampler's devices"
        " ([docs/scaling_out.md](scaling_out.md)).",
      ),
      M(
        "reshard_bytes",
        "disaggregated sampler",
        "bytes",
        "Size of that copy.",
      ),
    ),
  ),
  "health": Group(
    "counts that stay 0 in a healthy run",
    "",
    (
      M(
        "skipped",
        "default",
        "optimizer steps",
        "Optimizer steps of this loop step that were skipped (parameters and optimizer state kept)"
        " because the batch had no valid token or something was not finite.",
      ),
      M(
        "nonfinite",
        "default",
        "optimizer steps",
        "Of those, the ones where the loss, gradient norm, new parameters or optimizer state were "
        "not finite.",
      ),
      M(
        "num_skipped",
        "default",
        "optimizer steps",
        "Running total of skipped optimizer steps in the run (kept across resumes).",
      ),
      M(
        "reward_failures",
        "default",
        "responses",
        "Responses whose reward raised, timed out, crashed its worker or was not finite; they "
        "score 0 ([docs/rewards_and_security.md](rewards_and_security.md)). Always 0 with a device"
        " reward.",
      ),
      M(
        "reward_timeouts",
        "default",
        "responses",
        "The failures that hit a timeout.",
      ),
      M(
        "reward_worker_restarts",
        "default",
        "workers",
        "Verifier workers killed and replaced during the step.",
      ),
      M(
        "prompts_truncated",
        "default",
        "prompts",
        "Prompts of this step cut to their last `max_prompt_len` tokens "
        "(`data.truncate_prompts=True`; otherwise a too-long prompt fails at start-up).",
      ),
    ),
  ),
  "time": Group(
    "where a step's time goes",
    "The phases are wall times per step; `time/other_s` is the rest of `step_time_s`. A host step "
    "(a host reward, multi-turn episodes, a disaggregated sampler) runs two jitted halves around "
    "the scoring and logs `time/sample_s`, `time/reward_s` and `time/train_s` instead of "
    "`time/device_s`.",
    (
      M(
        "time/device_s",
        "default",
        "seconds",
        "Device-reward runs: the jitted chunk (sampling, reward, learning, and the metrics' "
        "transfer) per step.",
      ),
      M(
        "time/other_s",
        "default",
        "seconds",
        "`step_time_s` minus the other `time/` keys: the host's share (reading prompts, writing "
        "rows).",
      ),
      M(
        "time/run_wall_s",
        "default",
        "seconds",
        "The run's wall time up to the end of this step, every command's counted: a resumed run "
        "goes on from its checkpoint's count (time a killed command spent after its last "
        "checkpoint is not counted: the resume runs those steps again). Includes start-up, the "
        "warm start, compilation, evaluations and checkpoints. Cumulative, so not one of the "
        "phases that add up to `step_time_s`; the end-of-run summary's wall time is the last "
        "row's.",
      ),
      M(
        "time/sample_s",
        "host step, async",
        "seconds",
        "Sampling (waiting for the rollout); async mode: the sampler thread's time for this batch,"
        " overlapped with training. Near 0 when the rollout was sampled ahead "
        "(`time/sampled_ahead`).",
      ),
      M(
        "time/reward_s",
        "host step",
        "seconds",
        "Scoring in the sandboxed workers.",
      ),
      M(
        "time/train_s",
        "host step, async",
        "seconds",
        "Packing and the optimizer steps. When the next step's rollout was sampled ahead during "
        "this one, the device runs it first, so its sampling time is in here.",
      ),
      M(
        "time/sampled_ahead",
        "host step",
        "0 or 1",
        "1: this step's rollout was dispatched during the previous step, while its rewards were "
        "scored (the lag schedule and the rollout allow it; not into a checkpoint or a signal). "
        "The step time is the whole step's either way; only the split between `time/sample_s` and "
        "the previous `time/train_s` moves.",
      ),
      M(
        "time/wait_s",
        "`lag.mode=async`",
        "seconds",
        "The trainer's wait for the sampler thread's next batch: high means sampling is the "
        "bottleneck.",
      ),
      M(
        "time/run_device_busy_s",
        "default",
        "seconds",
        "Sum of `time/device_s`: fused steps, busy time of both sides.",
      ),
      M(
        "time/run_sampler_busy_s",
        "default",
        "seconds",
        "Sum of `time/sample_s` (host steps: until the rollout was ready) or, async, of "
        "`async_sampler_busy_s`.",
      ),
      M(
        "time/run_learner_busy_s",
        "default",
        "seconds",
        "Sum of `time/train_s`.",
      ),
      M(
        "time/run_sampler_idle_s",
        "default",
        "seconds",
        "`time/run_wall_s` minus the sampler's busy seconds (its own and the fused steps'): the "
        "sampler's bubble, start-up, evaluations and checkpoints included.",
      ),
      M(
        "time/run_learner_idle_s",
        "default",
        "seconds",
        "The same for the learner.",
      ),
      M(
        "time/run_reward_wait_s",
        "default",
        "seconds",
        "Sum of `time/reward_s`: host steps waiting for their rewards after the rollout (async: "
        "inside the producer's sampling).",
      ),
      M(
        "time/run_environment_s",
        "default",
        "seconds",
        "Sum of `episode/env_s`: episode environments answering.",
      ),
      M(
        "time/run_sync_s",
        "default",
        "seconds",
        "Sum of `reshard_time_s`: parameters moving to a disaggregated sampler.",
      ),
    ),
  ),
  "cost": Group(
    "what the run has spent so far",
    "Running totals over the whole run (`offpolicy_jax/step/costs.py`), every command's: each "
    "checkpoint records them and a resume goes on from there, so steps run again after a crash "
    "count once, and a resumed run writes the same token totals as an uninterrupted one. The "
    "sampler and the learner are the two sides; each side's seconds are busy or idle (`busy + idle"
    " = time/run_wall_s`). A step that is one fused program (a device reward, whole responses) "
    "samples and learns in it, so its device time is busy time of both sides. The seconds are the "
    "`time/run_` keys (above); the end-of-run summary prints the last row's totals.",
    (
      M(
        "cost/sampled_tokens",
        "default",
        "tokens",
        "Sum of `sampled_tokens` (and `async_dropped_tokens`): what the samples-to-accuracy of a "
        "method is counted in.",
      ),
      M(
        "cost/sampled_prompt_tokens",
        "default",
        "tokens",
        "Sum of `sampled_prompt_tokens`.",
      ),
      M(
        "cost/trained_tokens",
        "default",
        "tokens",
        "Sum of `tokens`: every optimizer step's tokens (a batch reused by replay or several "
        "epochs counts each time).",
      ),
    ),
  ),
  "sampler": Group(
    "static or continuous batching",
    "",
    (
      M(
        "sampler/decode_waste",
        "default",
        "fraction",
        "Share of the static batch's decoded row-steps that came after a row had ended: `1 - sum "
        "of lengths / (rows x longest length)`, from the lengths whichever sampler ran. High: "
        "continuous batching would pay ([docs/speed.md](speed.md)).",
      ),
      M(
        "sampler/continuous",
        "default",
        "0/1",
        "1 if the step sampled with continuous batching (`rollout.continuous_slots`).",
      ),
      M(
        "sampler/auto_waste",
        "`rollout.continuous_auto_steps`",
        "fraction",
        "Row W only: the mean decode waste over steps 1..W that the automatic choice was made on "
        "([docs/run_layer.md](run_layer.md#the-loop-metrics-rows-profiles-checkpoints)).",
      ),
    ),
  ),
  "episode": Group(
    "multi-turn runs",
    "Every row of a multi-turn run ([docs/multiturn.md](multiturn.md)), over the step's finished "
    "trajectories.",
    (
      M(
        "episode/turns",
        "multi-turn",
        "turns",
        "Mean turns per trajectory.",
      ),
      M(
        "episode/solved",
        "multi-turn",
        "fraction",
        "Fraction of trajectories with reward > 0.5.",
      ),
      M(
        "episode/tool_calls",
        "multi-turn",
        "calls",
        "Tool calls per trajectory.",
      ),
      M(
        "episode/tool_calls_per_solved",
        "multi-turn",
        "calls",
        "Mean tool calls of the solved trajectories (0 if none).",
      ),
      M(
        "episode/observation_tokens",
        "multi-turn",
        "tokens",
        "Environment observation tokens per trajectory.",
      ),
      M(
        "episode/observations_cut",
        "multi-turn",
        "observations",
        "Observations cut to their token budget.",
      ),
      M(
        "episode/env_failures",
        "multi-turn",
        "calls",
        "Environment calls that failed (the episode ends with reward 0).",
      ),
      M(
        "episode/env_s",
        "multi-turn",
        "seconds",
        "Time the environments took to answer this step's turns (in the verifier workers), part of"
        " the step's sampling time.",
      ),
      M(
        "episode/parameter_updates",
        "multi-turn, `lag.mode=async`",
        "versions",
        "Times newer parameters took over the batch's episodes in flight.",
      ),
    ),
  ),
  "eval": Group(
    "evaluation rows",
    "On the first `eval_prompts` prompts of the task's eval split, with the trainer's current "
    "parameters. `experiments.eval` computes the same for a saved checkpoint.",
    (
      M(
        "eval/accuracy",
        "default",
        "fraction",
        "Greedy accuracy: fraction of prompts whose greedy response has reward > 0.5. The held-out"
        " number to report.",
      ),
      M(
        "eval/reward_mean",
        "default",
        "reward",
        "Mean reward of the greedy responses.",
      ),
      M(
        "eval/response_len",
        "default",
        "tokens",
        "Mean length of the greedy responses.",
      ),
      M(
        "eval/reward_failures",
        "default",
        "responses",
        "Greedy responses whose reward failed (scored 0).",
      ),
      M(
        "eval/pass@K",
        "default",
        "fraction",
        "K = `eval_samples` (4 by default; none when 1): fraction of prompts with at least one of "
        "K sampled responses (training temperature) correct.",
      ),
      M(
        "eval/sample_accuracy",
        "default",
        "fraction",
        "Mean fraction of the K samples that are correct: the sampled solve rate.",
      ),
      M(
        "eval/sample_reward",
        "default",
        "reward",
        "Mean reward of the K samples at the training temperature: the current policy's "
        "expected reward, what the off-policy estimates `ope/*` estimate (docs/ope.md).",
      ),
      M(
        "eval/turns",
        "multi-turn",
        "turns",
        "Mean turns of the greedy episodes.",
      ),
      M(
        "eval/tool_calls_per_solved",
        "multi-turn",
        "calls",
        "Tool calls per solved greedy episode.",
      ),
    ),
  ),
  "ope": Group(
    "the current policy's worth from the replay buffer",
    "In eval rows when `eval_ope` names estimators (default: is, wis, pdwis) and the replay "
    "buffer holds rows (not at step 0): the trainer's current policy's expected training "
    "reward estimated from the buffer's lagged rows with the off-policy estimators of "
    "docs/ope.md, without sampling.",
    (
      M(
        "ope/is",
        "default",
        "reward",
        "Ordinary importance sampling: the current policy's expected reward estimated from the "
        "replay buffer's rows, nothing sampled (`learn.buffer_ope`, docs/ope.md). In an on-policy"
        " run, compare with the next step's `reward_mean`.",
      ),
      M(
        "ope/is_low",
        "default",
        "reward",
        "Lower end of the 95% interval of `ope/is`.",
      ),
      M(
        "ope/is_high",
        "default",
        "reward",
        "Upper end of the 95% interval of `ope/is`.",
      ),
      M(
        "ope/is_ess",
        "default",
        "rows",
        "Kish's effective sample size of `ope/is`'s sequence weights: near `ope/rows` the buffer "
        "is close to on-policy; far below it, the estimate rests on a few rows.",
      ),
      M(
        "ope/wis",
        "default",
        "reward",
        "Weighted (self-normalised) importance sampling of the same value: biased, lower variance.",
      ),
      M(
        "ope/wis_low",
        "default",
        "reward",
        "Lower end of the 95% interval of `ope/wis`.",
      ),
      M(
        "ope/wis_high",
        "default",
        "reward",
        "Upper end of the 95% interval of `ope/wis`.",
      ),
      M(
        "ope/wis_ess",
        "default",
        "rows",
        "Kish's effective sample size of `ope/wis`'s sequence weights: near `ope/rows` the buffer"
        " is close to on-policy; far below it, the estimate rests on a few rows.",
      ),
      M(
        "ope/pdis",
        "`eval_ope` names it",
        "reward",
        "Per-decision importance sampling of the same value (each token's reward weighted by its "
        "prefix's ratio).",
      ),
      M(
        "ope/pdis_low",
        "`eval_ope` names it",
        "reward",
        "Lower end of the 95% interval of `ope/pdis`.",
      ),
      M(
        "ope/pdis_high",
        "`eval_ope` names it",
        "reward",
        "Upper end of the 95% interval of `ope/pdis`.",
      ),
      M(
        "ope/pdis_ess",
        "`eval_ope` names it",
        "rows",
        "Kish's effective sample size of `ope/pdis`'s sequence weights: near `ope/rows` the "
        "buffer is close to on-policy; far below it, the estimate rests on a few rows.",
      ),
      M(
        "ope/pdwis",
        "default",
        "reward",
        "Per-decision weighted importance sampling of the same value.",
      ),
      M(
        "ope/pdwis_low",
        "default",
        "reward",
        "Lower end of the 95% interval of `ope/pdwis`.",
      ),
      M(
        "ope/pdwis_high",
        "default",
        "reward",
        "Upper end of the 95% interval of `ope/pdwis`.",
      ),
      M(
        "ope/pdwis_ess",
        "default",
        "rows",
        "Kish's effective sample size of `ope/pdwis`'s sequence weights: near `ope/rows` the "
        "buffer is close to on-policy; far below it, the estimate rests on a few rows.",
      ),
      M(
        "ope/rows",
        "default",
        "rows",
        "Rows of the replay buffer the estimates used (valid rows with a valid token).",
      ),
      M(
        "ope/behavior_reward",
        "default",
        "reward",
        "Mean reward of those rows: what the policies that sampled them earned. The estimates "
        "correct it for the gap to the current policy.",
      ),
      M(
        "ope/staleness_mean",
        "default",
        "optimizer steps",
        "Mean over the rows' valid tokens of the current version minus the token's version: how "
        "stale the data the estimates rest on is.",
      ),
    ),
  ),
  "moe": Group(
    "mixtures of experts",
    "Rows of a model with experts (`num_experts` > 0, e.g. `--config.model=tiny-moe`; "
    "[models.md](models.md#mixtures-of-experts)), from the train step's forward passes over "
    "each micro-batch's real prompt and response tokens, every block's routing counted.",
    (
      M(
        "moe/aux_loss",
        "model with experts",
        "loss",
        "The load-balancing loss E * sum_e f_e P_e (`models.moe.RouterStats.loss`; f_e: share "
        "of tokens with expert e among their k, P_e: mean router probability): k when the load "
        "is balanced, up to E when every token takes the same experts. "
        "`model_router_aux_coef` times it joins the loss. Under routing replay f_e counts the "
        "replayed (recorded) experts.",
        study="csv",
      ),
      M(
        "moe/max_load",
        "model with experts",
        "ratio",
        "The busiest expert's share of a block's chosen slots times E, the largest over the "
        "blocks and the step's micro-batches: 1 when balanced, E/k when one expert is in every "
        "token's k.",
        reduction=MAX,
      ),
      M(
        "moe/router_agreement",
        "rollout.routing_replay record or replay",
        "fraction",
        "Share of (token, block) pairs whose experts under the learner's own router are the ones "
        "the sampler recorded: 1 on-policy in float32; it falls with lag (routing drift) and "
        "with an engine mismatch (a bf16 sampler). Under replay the learner routes along the "
        "record anyway; this says how far its own router has moved.",
        study="table",
      ),
      M(
        "moe/router_agreement_min",
        "rollout.routing_replay record or replay",
        "fraction",
        "The lowest block's agreement, the lowest over the step's micro-batches: the block "
        "whose routing drifted most.",
        reduction=MIN,
        study="csv",
      ),
    ),
  ),
  "critic": Group(
    "the critic",
    "Rows of a run with a critic (`critic.estimator` gae or vtrace, or a loss preset that "
    "pairs with one: `ppo_critic`, `vtrace`, `rec_critic`; [losses.md](losses.md#critics)): "
    "the value head "
    "on the policy's trunk, from the train step's forward passes over each micro-batch's valid "
    "response tokens, weighted like the loss.",
    (
      M(
        "critic/value_loss",
        "critic",
        "loss",
        "1/2 (V - R)^2 per token, PPO-clipped around the call's starting values under gae "
        "(`learn.critic`); `critic.value_coef` times its token mean joins the loss.",
        study="csv",
      ),
      M(
        "critic/explained_variance",
        "critic",
        "fraction",
        "1 - Var(R - V) / Var(R) over the step's valid tokens, R the value targets (GAE's "
        "lambda-returns, V-trace's v_s): 1 is a perfect critic, 0 no better than the mean "
        "return, below 0 worse. Under gae with one update per batch V is the critic before it "
        "saw the batch: a prediction. A step whose returns hardly vary gives a noisy ratio: "
        "over a run, pool the variances (`learn.critic.pooled_explained_variance`; the "
        "end-of-run summary does).",
      ),
      M(
        "critic/return_var",
        "critic",
        "reward^2",
        "Var(R) of the value targets over the step's valid tokens. A study records its run "
        "mean, so a run's pooled explained variance is 1 - error_var / return_var there.",
        study="csv",
      ),
      M(
        "critic/error_var",
        "critic",
        "reward^2",
        "Var(R - V) over the step's valid tokens: what the critic leaves unexplained.",
        study="csv",
      ),
      M("critic/value_mean", "critic", "reward", "Mean V(s_t) over valid tokens."),
      M("critic/return_mean", "critic", "reward", "Mean value target R over valid tokens."),
      M(
        "critic/value_clipfrac",
        "critic",
        "fraction",
        "Share of valid tokens whose clipped value error is the larger (the clip binds); 0 "
        "without clipping and under vtrace.",
      ),
      M(
        "critic/ref_kl",
        "critic.kl_coef > 0",
        "nats",
        "Mean over valid tokens of log mu - log pi_ref: the behaviour's k1 estimate of its KL to "
        "the reference policy, which the critic's rewards pay times critic.kl_coef.",
      ),
      M(
        "critic/warmup",
        "critic.warmup_steps > 0",
        "flag",
        "1 while the step is in the critic's warm-up (the policy's gradients and updates "
        "zero), else 0.",
        reduction=MAX,
      ),
      M(
        "critic/reward_norm_mean",
        "critic.reward_norm",
        "reward",
        "The running mean of the rows' rewards over the run, this step's included, that the "
        "critic's rewards are normalised by.",
      ),
      M(
        "critic/reward_norm_std",
        "critic.reward_norm",
        "reward",
        "The running standard deviation of the rows' rewards over the run, this step's "
        "included, that the critic's rewards are divided by (while it is <= 1e-6 every "
        "normalised reward is 0).",
      ),
    ),
  ),
  "v0": Group(
    "prompt values",
    "Rows of a run that chooses its prompts by the critic's values (`critic.prompt_pool` > 1, "
    "`rollout.prompt_filter`): of each run of `critic.prompt_pool` candidate prompts it samples "
    "the one whose value at the prompt, V_0, predicts the group least likely to have equal "
    "rewards; with p the predicted success rate, P(all equal) = p^K + (1 - p)^K.",
    (
      M(
        "v0/predicted_all_equal",
        "critic.prompt_pool > 1",
        "fraction",
        "P(all equal) averaged over the step's sampled prompts: what the critic's values "
        "predict of the measured `groups_all_equal`, were each prompt's K draws independent "
        "at its own p. A critic that cannot yet tell prompts apart gives every prompt p near "
        "the mean reward, and predicts far fewer equal groups than are measured: the gap reads "
        "how well V_0 separates easy, hard and in-between prompts, not a bug.",
        study="csv",
      ),
      M(
        "v0/predicted_all_equal_pool",
        "critic.prompt_pool > 1",
        "fraction",
        "P(all equal) averaged over all the step's candidates: what sampling them unchosen "
        "would have given, predicted; its gap to `v0/predicted_all_equal` is what the choice "
        "expects to save.",
      ),
      M(
        "v0/value_mean",
        "critic.prompt_pool > 1",
        "reward",
        "Mean V_0 of the step's sampled prompts, read beside `reward_mean`.",
      ),
    ),
  ),
}

# TensorBoard groups of the keys not declared one by one (a name ending in "*" is a prefix).
PATTERNS: dict[str, tuple[str, ...]] = {
  "offpolicy": (
    "staleness_*",
    "behavior_*",
    "mismatch_*",
    "ratio_*",
    "clip_frac*",
    "kl_k*",
    "corr_*",
    "opsm_*",
    "m2po_*",
    "bapo_*",
    "replay_*",
    "partial_*",
    "async_*",
  ),
  "speed": ("reshard_*",),
}
# Everything else: reward, accuracy, lengths, advantages, loss, entropy, gradient norm.
DEFAULT_GROUP = "train"

_BY_NAME: dict[str, tuple[str, Metric]] = {}


def register(group: str, metric: Metric) -> Metric:
  """Declares `metric` in `group` (a new group gets a section of its own).

  Raises:
    ValueError: a key with a "/" outside its own prefix's group, or a name
      declared before with a different declaration.
  """
  prefix = metric.name.partition("/")[0] if "/" in metric.name else None
  if prefix is not None and prefix != group:
    raise ValueError(f"metric {metric.name}: a key with a '/' belongs to group {prefix!r}")
  known = _BY_NAME.get(metric.name)
  if known is not None and known != (group, metric):
    raise ValueError(f"metric {metric.name}: declared before as {known}")
  if group not in GROUPS:
    GROUPS[group] = Group(group, "", ())
  if known is None:
    g = GROUPS[group]
    GROUPS[group] = g._replace(metrics=(*g.metrics, metric))
    _BY_NAME[metric.name] = (group, metric)
  return metric


for _group, _g in GROUPS.items():
  for _m in _g.metrics:
    if _m.name in _BY_NAME:
      raise ValueError(f"metric {_m.name} is declared twice")
    _BY_NAME[_m.name] = (_group, _m)


def get(name: str) -> Metric | None:
  """The declaration of key `name`, or None."""
  found = _BY_NAME.get(name)
  return None if found is None else found[1]


def group_of(key: str) -> str:
  """The group of a row key: its declaration's, its "/" prefix, `PATTERNS`, or `DEFAULT_GROUP`."""
  if key in _BY_NAME:
    return _BY_NAME[key][0]
  if "/" in key:
    return key.partition("/")[0]
  for group, names in PATTERNS.items():
    if any(key == n or (n.endswith("*") and key.startswith(n[:-1])) for n in names):
      return group
  return DEFAULT_GROUP


def reduction(key: str) -> str:
  """How values of `key` combine over micro-batches and steps (`MEAN` when undeclared)."""
  m = get(key)
  return MEAN if m is None else m.reduction


def study_metrics(tables_only: bool = False) -> tuple[str, ...]:
  """The keys a study records per run (`study="csv"` or `"table"`), or only those it tabulates."""
  wanted = ("table",) if tables_only else ("csv", "table")
  return tuple(name for name, (_, m) in _BY_NAME.items() if m.study in wanted)


def reference_markdown() -> str:
  """The key tables of docs/metrics.md, one section per group."""
  lines = []
  for group, g in GROUPS.items():
    lines += ["", f"### `{group}/`: {g.title}", ""]
    if g.intro:
      lines += [textwrap.fill(g.intro, 78, break_on_hyphens=False, break_long_words=False), ""]
    lines += ["| key | in | unit | what it measures, how to read it |", "|---|---|---|---|"]
    lines += [f"| `{m.name}` | {m.present} | {m.unit} | {m.doc} |" for m in g.metrics]
  return "\n".join(lines[1:]) + "\n"


if __name__ == "__main__":
  print(reference_markdown(), end="")
