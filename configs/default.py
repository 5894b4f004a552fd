"""The main job: a tiny decoder learns a synthetic task on CPU under policy lag.

Run:
  python -m experiments.train --config=configs/default.py --workdir=/tmp/opj_default

Task: reverse a string of 2-5 digits ("rev:1234=" -> "4321"), exact-match
reward computed on device. A 150-step supervised warm start gives a starting
greedy accuracy around 0.4, then REC-OneSide-NoIS trains for 1000 steps with a
sawtooth lag (sync_interval 4: the batch of step t comes from parameters up to
3 updates old). About 1-3 minutes on a 2-core CPU (compilation included); the
mean reward goes from about 0.49 in the first fifth of steps to about 0.74 in
the last fifth.
"""

import ml_collections
from ml_collections import config_dict


def base_config() -> ml_collections.ConfigDict:
  """Every field the loop reads, with CPU-toy values; callers lock it."""
  c = ml_collections.ConfigDict()
  # Base seed; every PRNG key of the run is derived from (seed, step).
  c.seed = 0
  # Number of loop steps (one batch of prompts is sampled and trained on per step).
  c.total_steps = 1000
  # Model: a preset name (models.preset_names()) or a local Hugging Face directory.
  c.model = "tiny"
  # Compute dtype of the model ("float32" or "bfloat16").
  c.model_dtype = "float32"
  # Run the decoder blocks as one lax.scan in the training forward (compile time
  # flat in depth; same numbers, same checkpoint layout).
  c.model_scan_layers = False
  # Tokenizer: "" uses the task's built-in character tokenizer; else a local HF directory.
  c.tokenizer = ""
  # Task name for tasks.get_task.
  c.task = "reverse"
  # Keyword arguments for tasks.get_task (e.g. data file paths for text tasks).
  c.task_kwargs = ml_collections.ConfigDict()
  # Prompts are left-padded to this many tokens (static shape).
  c.max_prompt_len = 16
  # Responses are sampled up to this many tokens (static shape).
  c.max_new_tokens = 8
  c.data = ml_collections.ConfigDict()
  # Prompts longer than max_prompt_len: False fails at start-up naming the row
  # (data_checks.validate_data); True keeps their last max_prompt_len tokens (the
  # question and the generation prompt) and counts them in the prompts_truncated metric.
  c.data.truncate_prompts = False
  c.rollout = ml_collections.ConfigDict()
  # Partial rollouts (APRIL): decode at most this many tokens per response per loop
  # step; unfinished responses continue at the next step under the newer parameters
  # (re-prefilled), every token keeping its own version (0 = off: whole responses).
  c.rollout.partial_budget = 0
  # Sampling temperature of the behaviour policy.
  c.temperature = 1.0
  # Nucleus sampling threshold (1.0 = off).
  c.top_p = 1.0
  # Top-k sampling (0 = off).
  c.top_k = 0
  # K: responses sampled per prompt (>= 2 for group-relative advantages).
  c.group_size = 8
  # G: prompts per optimizer step (batch = G * K responses).
  c.prompts_per_step = 8
  # Seconds one host reward call may take in its verifier worker before it is
  # scored 0 (counted in reward_timeouts) and its worker is killed and replaced.
  c.reward_timeout = 5.0
  # Seconds the host rewards of one batch may take in all (0: 2 * reward_timeout).
  c.reward_batch_timeout = 0.0
  # Sandboxed verifier worker processes for host rewards (0: one per CPU).
  c.reward_workers = 0
  # Address-space limit of each verifier worker, in MiB.
  c.reward_memory_mb = 2048
  # "strict": refuse to run verifiers where Landlock/seccomp are unavailable;
  # "warn": run them with what the platform offers and log what is missing.
  c.reward_sandbox = "strict"

  c.loss = ml_collections.ConfigDict()
  # Loss preset name (losses.names()).
  c.loss.name = "rec_oneside_nois"
  # Overrides of the preset; None keeps the preset's value.
  # Lower ratio bound: keep rho >= 1 - eps_low.
  c.loss.eps_low = config_dict.placeholder(float)
  # Upper ratio bound: keep rho <= 1 + eps_high.
  c.loss.eps_high = config_dict.placeholder(float)
  # Ring mask outer lower bound (rec_ring_*).
  c.loss.eps_low_prime = config_dict.placeholder(float)
  # Ring mask outer upper bound (rec_ring_*).
  c.loss.eps_high_prime = config_dict.placeholder(float)
  # Dual-clip constant c for A < 0.
  c.loss.dual_clip_c = config_dict.placeholder(float)
  # Coefficient of the k2 / forward-KL regulariser towards the behaviour policy.
  c.loss.reg_coef = config_dict.placeholder(float)
  # Coefficient of the KL to the reference policy.
  c.loss.kl_coef = config_dict.placeholder(float)
  # Entropy bonus coefficient.
  c.loss.entropy_coef = config_dict.placeholder(float)
  # RED-Weight temperature.
  c.loss.temp = config_dict.placeholder(float)
  # Aggregation: token_mean, seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm.
  c.loss.agg = config_dict.placeholder(str)

  c.advantage = ml_collections.ConfigDict()
  # Advantage estimator (advantages.names()); "" picks the loss preset's default,
  # losses.default_advantage(loss.name): grpo for grpo/dapo-style presets, opmd for
  # oapl, else group_mean.
  c.advantage.name = ""

  c.lag = ml_collections.ConfigDict()
  # "sync": the exact schedule v(t) (offpolicy_jax.lag); "async": a sampler thread runs ahead.
  c.lag.mode = "sync"
  # m: parameters reach the sampler every m loop steps (batches), i.e. every
  # m * train.num_minibatches * train.num_epochs optimizer steps (1 = on-policy).
  c.lag.sync_interval = 4
  # n: the first n steps use version 0; afterwards a constant extra lag of n.
  c.lag.sync_offset = 0
  # Async mode: batches more than this many loop steps old are dropped (0 = no bound).
  c.lag.max_staleness = 0

  c.replay = ml_collections.ConfigDict()
  # Buffer capacity in batches of G groups of K responses (the capacity is G * this groups).
  c.replay.capacity_batches = 2
  # Which groups a step trains on: fifo (oldest first; with max_reuse=1 each group
  # once, the paper's one-pass setting), uniform, staleness (prefers fresh groups)
  # or reward (prefers high mean reward); see offpolicy_jax.replay.
  c.replay.policy = "fifo"
  # Times a group may be trained on before it is retired (0 = unlimited).
  c.replay.max_reuse = 1
  # Softness of the staleness / reward policies: P(group) ~ exp(score / temperature).
  c.replay.temperature = 1.0

  c.train = ml_collections.ConfigDict()
  # Optimizer steps per epoch over each sampled batch (divides G*K). The parameter
  # version counts optimizer steps: with U = num_minibatches * num_epochs a loop
  # step advances it by U, and lag.sync_interval still counts loop steps (batches).
  c.train.num_minibatches = 1
  # Passes over each sampled batch (reshuffled each epoch).
  c.train.num_epochs = 1
  # Rows per gradient-accumulation micro-batch (divides the minibatch of
  # G * K / num_minibatches rows; 0 = the whole minibatch, no accumulation).
  c.train.micro_batch_size = 0
  # Run each group's prompt once and let its K responses attend to it (same
  # log-probs and gradients as K copies, within float tolerance; less work).
  # Applies when every micro-batch holds whole groups; otherwise the plain forward runs.
  c.train.shared_prefix = True
  # Leave rows whose advantages are all 0 out of the forward/backward pass where
  # that is exact for the loss (losses.LossSpec.zero_advantage_inert; counted in
  # the rows_skipped metric).
  c.train.skip_zero_advantage = True

  c.optimizer = ml_collections.ConfigDict()
  # Peak learning rate (AdamW).
  c.optimizer.learning_rate = 3e-4
  # Linear warm-up steps.
  c.optimizer.warmup_steps = 0
  # AdamW beta1.
  c.optimizer.b1 = 0.9
  # AdamW beta2.
  c.optimizer.b2 = 0.99
  # AdamW decoupled weight decay.
  c.optimizer.weight_decay = 0.0
  # Global gradient-norm clip (0 = off).
  c.optimizer.grad_clip = 1.0

  c.mesh = ml_collections.ConfigDict()
  # Data-parallel mesh axis size (-1 fills the remaining devices).
  c.mesh.data = 1
  # Fully-sharded (parameter) axis size.
  c.mesh.fsdp = 1
  # Tensor-parallel axis size.
  c.mesh.tensor = 1
  # Disaggregated mode: devices of the sampler's own mesh (0 = sampler and trainer
  # share the mesh). Each process gives its first sampler_devices / processes local
  # devices to the sampler; data * fsdp * tensor above must then use all the others.
  c.mesh.sampler_devices = 0

  c.sft = ml_collections.ConfigDict()
  # Supervised warm start on the task's reference answers before RL.
  c.sft.enabled = True
  # Supervised steps.
  c.sft.steps = 150
  # Examples per supervised step.
  c.sft.batch_size = 64
  # Supervised learning rate (AdamW).
  c.sft.learning_rate = 3e-3

  # Evaluate every this many steps (0 = only at the end).
  c.eval_every = 200
  # Held-out prompts per evaluation.
  c.eval_prompts = 64
  # Samples per eval prompt for pass@k (k = this; 1 = greedy accuracy only, no pass@k).
  c.eval_samples = 4
  # Save a checkpoint every this many steps (0 = only at the end).
  c.checkpoint_every = 100
  # Loop steps per jitted chunk (device rewards): metrics are fetched and written
  # every gcd(log_every, eval_every, checkpoint_every) steps.
  c.log_every = 10
  # Trace at least this many loop steps, in whole chunks from the second chunk on
  # (compilation is not in it), with jax.profiler into <workdir>/profile,
  # viewable in TensorBoard/XProf; 0 = off.
  c.profile_steps = 0
  # Checkpoints kept.
  c.keep_checkpoints = 2
  # Save checkpoints in a background thread.
  c.async_checkpoint = True
  # Write TensorBoard event files under workdir/tb.
  c.tensorboard = True
  # Weights & Biases project ("" = off; used only if wandb is installed).
  c.wandb_project = ""
  # Show a progress bar.
  c.progress = True
  return c


def get_config() -> ml_collections.ConfigDict:
  """The main job's config (locked: a misspelt override is an error)."""
  c = base_config()
  c.lock()
  return c
