r"""The paper's GSM8K setting: Qwen2.5-1.5B-Instruct, K=8, 96 prompts/step, lag 20.

For a TPU/GPU host with the weights and data on local disk (nothing is
downloaded):

  python -m experiments.train --config=configs/gsm8k_qwen25_1p5b.py --workdir=DIR \
      --config.model=/ckpt/Qwen2.5-1.5B-Instruct \
      --config.task_kwargs.train_path=/data/gsm8k/train.jsonl \
      --config.task_kwargs.eval_path=/data/gsm8k/test.jsonl

Variants: `--config.lag.sync_interval=1` (on-policy), `--config.lag.sync_offset=10
--config.lag.sync_interval=1` (constant lag 10), `--config.loss.name=grpo`.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  """GSM8K with REC-OneSide-NoIS under a sawtooth lag of 20 (sync_interval 20)."""
  c = default.base_config()
  c.total_steps = 500
  # Local Hugging Face directory of Qwen2.5-1.5B-Instruct (config.json + safetensors).
  c.model = "checkpoints/Qwen2.5-1.5B-Instruct"
  c.model_dtype = "bfloat16"
  # The blocks are stored stacked over layers and the train step and the scorer run them as
  # one lax.scan: one block compiled, not 28 (docs/speed.md, "Compile time"); the default
  # for a model of this size, said here so that its runs keep it.
  c.model_scan_layers = True
  # Each block is rematerialised in the backward pass: the train step keeps block inputs, not
  # every intermediate (`python -m experiments.plan --config=configs/gsm8k_qwen25_1p5b.py
  # --devices=v5e-8`: fits in 16 GiB with it, not without).
  c.model_remat = True
  # Same directory: tokenizer.json + chat template.
  c.tokenizer = "checkpoints/Qwen2.5-1.5B-Instruct"
  c.task = "gsm8k"
  c.task_kwargs = ml_collections.ConfigDict(
    {
      # GSM8K train split, JSONL or Parquet with question/answer fields.
      "train_path": "data/gsm8k/train.jsonl",
      # GSM8K test split.
      "eval_path": "data/gsm8k/test.jsonl",
    }
  )
  c.max_prompt_len = 512
  c.max_new_tokens = 1024
  c.temperature = 1.0
  c.group_size = 8
  c.prompts_per_step = 96
  c.reward_timeout = 10.0
  c.loss.name = "rec_oneside_nois"
  c.lag.sync_interval = 20
  c.lag.sync_offset = 0
  c.replay.capacity_batches = 1
  # Gradient accumulation: 16 micro-batches of 48 rows per minibatch of 96 * 8 = 768 rows.
  c.train.micro_batch_size = 48
  c.optimizer.learning_rate = 1e-6
  c.optimizer.b2 = 0.999
  c.optimizer.weight_decay = 0.01
  # Fill every device with fully-sharded data parallelism.
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 1
  c.sft.enabled = False
  c.eval_every = 50
  c.eval_prompts = 1319
  c.eval_samples = 1
  c.checkpoint_every = 50
  c.keep_checkpoints = 3
  c.lock()
  return c
