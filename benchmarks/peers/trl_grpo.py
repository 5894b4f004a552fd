"""TRL's GRPOTrainer (or bare `transformers` generate) on the compare.py protocol.

Runs in a side environment with torch, trl and transformers (see
benchmarks/compare.py), not in this project's. Reads the checkpoint directory
that compare.py writes (config.json, model.safetensors, tokenizer.json and
protocol.json with the prompt ids and sizes) and prints one JSON line per round:
{"system", "round", "step_s", "generation_s", "train_s", "sampler_tok_s"}.
Round 0 is the warm-up.

GRPO step: `GRPOTrainer.train` with G prompts x K generations per step,
exactly N new tokens (`min_new_tokens`), temperature 1, no top-k / top-p,
beta = 0 (no reference model), one iteration, a random reward. A step is timed
from the trainer's `on_step_begin` to its `on_step_end`; generation is the time
spent in the model's `generate` inside it; train is the rest.

With --generate_only it times `model.generate` alone on the same B = G*K rows.

  PEER_ENVS/trl/bin/python benchmarks/peers/trl_grpo.py --checkpoint DIR [--rounds 3]

--wait reads one line from stdin before each round (compare.py interleaves
the systems that way) and prints {"ready": true} once the model is loaded.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch
import transformers


def _emit(obj: dict) -> None:
  print(json.dumps(obj), flush=True)


def _gate(wait: bool) -> None:
  """With --wait, blocks until the driver asks for the next round."""
  if wait and not sys.stdin.readline():
    sys.exit(0)


def _load(path: str):
  with open(os.path.join(path, "protocol.json")) as f:
    protocol = json.load(f)
  tokenizer = transformers.AutoTokenizer.from_pretrained(path)
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  prompts = [" ".join(f"t{i}" for i in ids) for ids in protocol["prompt_ids"]]
  return protocol, tokenizer, model, prompts


def generate_only(args) -> None:
  """Times `generate` on the protocol's batch, B*N new tokens per round."""
  protocol, tokenizer, model, _ = _load(args.checkpoint)
  model.eval()
  k, n = protocol["group"], protocol["new_tokens"]
  ids = torch.tensor(protocol["prompt_ids"], dtype=torch.long).repeat_interleave(k, dim=0)
  kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=True, temperature=1.0, top_p=1.0,
                top_k=0, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
  if args.wait:
    _emit({"ready": True})
  for i in range(args.rounds + 1):
    _gate(args.wait)
    torch.manual_seed(i)
    t0 = time.perf_counter()
    with torch.no_grad():
      out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + n, out.shape
    _emit({"system": f"transformers generate (torch {torch.__version__})", "round": i,
           "step_s": None, "generation_s": dt, "train_s": None,
           "sampler_tok_s": ids.shape[0] * n / dt})  # fmt: skip


class _StepTimer(transformers.TrainerCallback):
  """Times each optimizer step and the `generate` calls inside it; prints a row."""

  def __init__(self, model, wait: bool, system: str):
    self.wait, self.system = wait, system
    self.gen_s = self.gen_tokens = 0.0
    self.round = 0
    generate = model.generate

    def timed_generate(*a, **kw):
      t0 = time.perf_counter()
      out = generate(*a, **kw)
      self.gen_s += time.perf_counter() - t0
      self.gen_tokens += out.shape[0] * (out.shape[1] - kw["input_ids"].shape[1])
      return out

    model.generate = timed_generate

  def on_step_begin(self, args, state, control, **kwargs):
    _gate(self.wait)
    self.gen_s = self.gen_tokens = 0.0
    self.t0 = time.perf_counter()

  def on_step_end(self, args, state, control, **kwargs):
    step = time.perf_counter() - self.t0
    _emit({"system": self.system, "round": self.round, "step_s": step,
           "generation_s": self.gen_s, "train_s": step - self.gen_s,
           "sampler_tok_s": self.gen_tokens / self.gen_s if self.gen_s else None})  # fmt: skip
    self.round += 1


def grpo(args) -> None:
  """`GRPOTrainer.train` for 1 + rounds steps, each on the protocol's G prompts."""
  import datasets
  import trl

  protocol, tokenizer, model, prompts = _load(args.checkpoint)
  g, k, n = protocol["prompts"], protocol["group"], protocol["new_tokens"]
  rng = np.random.default_rng(protocol["seed"])

  def random_reward(completions, **kwargs):
    return rng.uniform(size=len(completions)).tolist()

  with tempfile.TemporaryDirectory() as out_dir:
    config = trl.GRPOConfig(
      output_dir=out_dir,
      use_cpu=True,
      bf16=False,
      learning_rate=protocol["learning_rate"],
      per_device_train_batch_size=g * k,
      gradient_accumulation_steps=1,
      num_generations=k,
      max_completion_length=n,
      generation_kwargs={"min_new_tokens": n},
      temperature=1.0,
      top_p=1.0,
      top_k=0,
      beta=0.0,
      gradient_checkpointing=False,  # on by default; a memory saving this small model needs not
      num_iterations=1,
      max_steps=args.rounds + 1,
      logging_steps=10**6,
      save_strategy="no",
      report_to="none",
      disable_tqdm=True,
      seed=protocol["seed"],
    )
    trainer = trl.GRPOTrainer(
      model=model,
      reward_funcs=random_reward,
      args=config,
      train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
      processing_class=tokenizer,
    )
    system = f"TRL GRPOTrainer (trl {trl.__version__}, torch {torch.__version__} CPU)"
    trainer.add_callback(_StepTimer(trainer.model, args.wait, system))
    if args.wait:
      _emit({"ready": True})
    trainer.train()


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", required=True, help="directory written by compare.py")
  parser.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up")
  parser.add_argument("--wait", action="store_true", help="one stdin line per round")
  parser.add_argument("--generate_only", action="store_true", help="time generate alone")
  args = parser.parse_args()
  (generate_only if args.generate_only else grpo)(args)


if __name__ == "__main__":
  main()
