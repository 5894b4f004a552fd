"""Multi-turn tool use: a tiny decoder learns to call a calculator it cannot do without.

Run:
  python -m experiments.train --config=configs/calculator.py --workdir=/tmp/opj_calc

Task "calculator" (offpolicy_jax.rewards.tasks.agentic): the prompt is a
3-digit times 2-digit product, `123*45=?`. A policy turn is either a tool call
`<calc>123*45</calc>`, which the environment (in the sandboxed verifier
workers, parsed with `ast`, never evaluated as code) answers with its value
`|5535`, or a final answer `=5535`, which ends the episode with reward 1 if it
is right. The tiny model cannot multiply in its head, so reward comes only
from calling the tool with the right expression and copying its answer. A
short supervised warm start on one-call episodes leaves it far from perfect
(it miscopies the tool's value into its answer), then REC-OneSide-NoIS under
the default sawtooth lag, sampling at temperature 0.7;
`episode/tool_calls_per_solved` and `eval/tool_calls_per_solved` report tool
use (docs/multiturn.md).

Variant `configs/calculator.py:latency`: the tool answers after a log-normal
delay (median 200 ms, shape 1.0, at most 2 s), like a real tool or search call,
so a step that waits for its episodes waits on the slowest calls. Compare
`--config.lag.mode=sync` with `--config.lag.mode=async` on it: the rows'
`time/run_*` keys say where the wall clock went (docs/metrics.md).
"""

import ml_collections

from configs import default


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  if variant not in ("", "latency"):
    raise ValueError(f"configs/calculator.py: unknown variant {variant!r} (known: latency)")
  c = default.base_config()
  c.task = "calculator"
  c.task_kwargs = ml_collections.ConfigDict({"kind": "mul", "max_turns": 3})
  if variant == "latency":
    c.task_kwargs.tool_latency_ms = 200.0
    c.task_kwargs.tool_latency_sigma = 1.0
    c.task_kwargs.tool_latency_max_ms = 2000.0
    # Sleeping workers cost no CPU: one per CPU (the default) queues a step's 64 calls, and
    # those still queued after reward_timeout fail (about 15 of 64 per step, and the run
    # learnt nothing); 32 keep them in flight together (docs/lag_and_study.md).
    c.reward_workers = 32
  c.multiturn.max_turns = 3
  # The longest turn: "<calc>123*45</calc>\n" (20 characters).
  c.multiturn.turn_tokens = 24
  c.multiturn.observation_tokens = 8
  # BOS + "123*45=?\n".
  c.max_prompt_len = 12
  c.max_new_tokens = 64
  c.total_steps = 300
  c.sft.steps = 220
  c.eval_every = 100
  c.eval_prompts = 64
  # Sampled at temperature 1 the warm start copies a 4-5 digit value right in
  # about 2% of episodes, too rare a reward to learn from in 300 steps (its
  # greedy accuracy fell from 0.52 to 0.00); at 0.7 about 6%, and it learns
  # (docs/results/multiturn.md).
  c.temperature = 0.7
  c.reward_timeout = 5.0
  c.lock()
  return c
