"""The code task at toy scale: a tiny decoder writes Python programs, scored by running them.

Run:
  python -m experiments.train --config=configs/code.py --workdir=/tmp/opj_code

Task "code" (offpolicy_jax.rewards.tasks.code): the prompt shows three calls of a hidden
function of two digits, `f(2,3)=5 f(4,1)=5 f(0,7)=7`, and the response is a
one-line program `def f(a,b):return a+b`. The reward runs the program against
six hidden calls inside a sandboxed verifier worker and gives the fraction
that return the right int (programs that fail to compile, raise, loop, fork,
write files or open sockets score 0). A short supervised warm start on
reference programs, then REC-OneSide-NoIS under the default sawtooth lag.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  c = default.base_config()
  c.task = "code"
  c.total_steps = 300
  # BOS + the longest prompt (33 characters).
  c.max_prompt_len = 36
  # The longest reference program (28 characters) + EOS, with room to spare.
  c.max_new_tokens = 32
  # Programs run in the workers in well under a second; a hung one is killed.
  c.reward_timeout = 2.0
  c.sft.steps = 150
  c.eval_every = 100
  c.lock()
  return c
