"""Any reasoning-gym dataset as a task, scored with the dataset's own verifier."""

from offpolicy_jax import rewards
from offpolicy_jax.tasks.base import INSTRUCTION, Example, ListSource, Task


def make_task(
  dataset_name: str,
  *,
  seed: int = 0,
  train_size: int = 10000,
  eval_size: int = 200,
  instruction: str = INSTRUCTION,
  **dataset_kwargs,
) -> Task:
  """`reasoning_gym.create_dataset(dataset_name, seed=, size=, **dataset_kwargs)`.

  Training examples use `seed`, evaluation examples `seed + 1` (procedurally
  generated; reasoning-gym does not guarantee the two are disjoint). The reward
  is `dataset.score_answer(answer, entry=example)` in [0, 1], where `answer` is
  the content of the last `<answer>...</answer>` block of the response, or the
  whole stripped response if there is none.

  Args:
    dataset_name: a reasoning-gym dataset name, e.g. "basic_arithmetic".
    seed: generation seed.
    train_size: number of training examples.
    eval_size: number of evaluation examples.
    instruction: appended to every question.
    **dataset_kwargs: the dataset's own config fields.

  Returns:
    The Task (chat-templated prompts, host reward only).
  """
  import reasoning_gym

  try:
    train = reasoning_gym.create_dataset(dataset_name, seed=seed, size=train_size, **dataset_kwargs)
    evals = reasoning_gym.create_dataset(
      dataset_name, seed=seed + 1, size=eval_size, **dataset_kwargs
    )
  except (KeyError, ValueError, TypeError) as e:
    raise ValueError(f"reasoning_gym dataset {dataset_name!r}: {e}") from e

  def reward(example: Example, text: str) -> float:
    return float(train.score_answer(rewards.extract_answer(text), entry=example))

  return Task(
    name=f"reasoning_gym:{dataset_name}",
    train_source=ListSource([train[i] for i in range(len(train))]),
    eval_source=ListSource([evals[i] for i in range(len(evals))]),
    prompt=lambda ex: ex["question"] + instruction,
    reward=reward,
    use_chat_template=True,
  )
