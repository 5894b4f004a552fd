"""What a verifier pool's batches give (`rewards.verifiers`): scores, outcomes, failure kinds."""

from typing import Any, NamedTuple

import numpy as np


class RewardResult(NamedTuple):
  """Scores of a batch of responses.

  Attributes:
    scores: float32 [B] rewards (0 where the reward failed).
    failed: bool [B] True where the reward raised, timed out, crashed its
      worker or returned a score that is not finite in float32.
    timed_out: bool [B] the subset of `failed` that hit a timeout.
    seconds: wall-clock time of the batch.
    restarts: workers killed and replaced during the batch.
    errors: the first few failure messages, for logs.
  """

  scores: np.ndarray
  failed: np.ndarray
  timed_out: np.ndarray | None = None
  seconds: float = 0.0
  restarts: int = 0
  errors: tuple[str, ...] = ()


# Why a call of `VerifierPool.call` failed (`Outcome.failure`).
TIMEOUT = "timeout"  # ran past its timeout, or the batch's (its worker was killed)
ERROR = "error"  # raised
GARBAGE = "garbage"  # returned something that is not JSON data, or too large
CRASHED = "crashed"  # its worker died or garbled its pipe (the worker was replaced)
FAILURES = (TIMEOUT, ERROR, GARBAGE, CRASHED)


class Outcome(NamedTuple):
  """What one call of a batch gave.

  Attributes:
    value: the call's value, JSON data parsed in this process (None if it failed).
    failure: "" if the call returned, else one of `FAILURES`.
    error: why it failed (a message for logs), "" if it did not.
  """

  value: Any = None
  failure: str = ""
  error: str = ""


class CallResult(NamedTuple):
  """The outcomes of a batch of calls (`VerifierPool.call`).

  Attributes:
    outcomes: one `Outcome` per row, in the order of the rows.
    seconds: wall-clock time of the batch.
    restarts: workers killed and replaced during the batch.
    errors: the first few failure messages, for logs.
  """

  outcomes: list[Outcome]
  seconds: float = 0.0
  restarts: int = 0
  errors: tuple[str, ...] = ()
