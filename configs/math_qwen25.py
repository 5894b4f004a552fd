r"""MATH with Qwen2.5-1.5B-Instruct (math-verify grading), lag 20.

  python -m experiments.train --config=configs/math_qwen25.py --workdir=DIR \
      --config.model=/ckpt/Qwen2.5-1.5B-Instruct \
      --config.task_kwargs.train_path=/data/math/train.jsonl \
      --config.task_kwargs.eval_path=/data/math/test.jsonl
"""

import ml_collections

from configs import gsm8k_qwen25_1p5b


def get_config() -> ml_collections.ConfigDict:
  """The GSM8K setting with the MATH task, longer responses and a MATH-500 style eval."""
  c = gsm8k_qwen25_1p5b.get_config()
  c.unlock()
  c.task = "math"
  c.task_kwargs.train_path = "data/math/train.jsonl"
  c.task_kwargs.eval_path = "data/math/test.jsonl"
  c.max_new_tokens = 2048
  c.eval_prompts = 500
  c.lock()
  return c
