"""The rewards wing: tasks, and scoring model output where it cannot hurt the trainer.

  scoring      `score_batch`: host rewards in sandboxed verifier workers; answer/format parsing
  verifiers    the pool of killable verifier worker processes (forkserver, JSON replies, timeouts)
  verifier_process  the trainer's handle on one verifier worker process (start, ready, kill)
  verifier_results  what a pool's batches give: RewardResult, Outcome, CallResult, failure kinds
  worker       what runs inside a verifier worker, and the messages on its pipes
  environments multi-turn environments: the protocol, run batched in the verifier workers
  text_episodes  episodes as text: a host policy's episodes, turns split / encoded, replay reward
  sandbox      worker confinement: rlimits, capabilities, Landlock (an allow-list of reads), seccomp
  isolation    untrusted programs in a fresh process per grading; only JSON data comes back
  isolation_wire  values as JSON data (`encode` / `decode`), JSON lines on a program's pipes
  isolation_processes  the template that forks program processes, and a program's process
  answer_gate  the safe-grammar gate for answers a verifier would eval / sympify
  tasks        prompts + template + reward: synthetic, reasoning-gym, GSM8K / MATH, code,
               multi-turn (guess_number, calculator)

May import: the maths modules.
"""

from offpolicy_jax.rewards import (
  answer_gate,
  environments,
  isolation,
  sandbox,
  scoring,
  tasks,
  verifiers,
  worker,
)
from offpolicy_jax.rewards.environments import Environment, EnvResult, EnvRunner
from offpolicy_jax.rewards.scoring import (
  RewardError,
  SandboxedReward,
  extract_answer,
  follows_format,
  score_batch,
  score_with_timeout,
)
from offpolicy_jax.rewards.verifier_results import RewardResult
from offpolicy_jax.rewards.verifiers import VerifierPool, get_pool

__all__ = [
  "EnvResult",
  "EnvRunner",
  "Environment",
  "RewardError",
  "RewardResult",
  "SandboxedReward",
  "VerifierPool",
  "answer_gate",
  "environments",
  "extract_answer",
  "follows_format",
  "get_pool",
  "isolation",
  "sandbox",
  "score_batch",
  "score_with_timeout",
  "scoring",
  "tasks",
  "verifiers",
  "worker",
]
