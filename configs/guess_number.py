"""Multi-turn: a tiny decoder learns to find a secret number from higher/lower answers.

Run:
  python -m experiments.train --config=configs/guess_number.py --workdir=/tmp/opj_guess

Task "guess_number" (offpolicy_jax.rewards.tasks.agentic): the prompt is
`guess 1-32`; each policy turn is a number, the environment (in the sandboxed
verifier workers) answers `|h` (the secret is higher), `|l` (lower) or `|?`;
a correct guess at turn t ends the episode with reward 1 - 0.05 (t - 1), no
correct guess within 8 turns gives 0. The secret is never in the prompt, so
the policy must use the answers: one row per episode, observation tokens are
in the trajectory (mask 0) and the KV cache, never in the loss. A supervised
warm start on binary-search episodes, then REC-OneSide-NoIS under the default
sawtooth lag. It learns little in 400 steps (greedy success 0.28 -> 0.31;
docs/results/multiturn.md): configs/calculator.py is the multi-turn task that learns
clearly here.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  c = default.base_config()
  c.task = "guess_number"
  c.task_kwargs = ml_collections.ConfigDict({"hi": 32, "max_turns": 8})
  c.multiturn.max_turns = 8
  # A turn is at most "32\n"; an observation "|h\n".
  c.multiturn.turn_tokens = 4
  c.multiturn.observation_tokens = 4
  # BOS + "guess 1-32\n".
  c.max_prompt_len = 12
  # 8 turns of at most 3 policy + 3 observation tokens.
  c.max_new_tokens = 48
  c.total_steps = 400
  # 300 warm-start steps already solve every secret by binary search (greedy 1.0): 60 leave
  # room to learn (greedy 0.28). Sampled at 0.7 like configs/calculator.py.
  c.sft.steps = 60
  c.temperature = 0.7
  c.eval_every = 100
  # The eval split is every secret once.
  c.eval_prompts = 32
  c.reward_timeout = 5.0
  c.lock()
  return c
