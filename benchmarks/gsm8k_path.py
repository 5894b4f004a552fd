"""The real-model path end to end: GSM8K's config on a random-init preset saved as a HF checkpoint.

Nothing is downloaded. This script

1. writes a Hugging Face directory: the preset's random-init weights
   (`models.save_pretrained`, the preset's own vocabulary and shapes), a
   byte-level BPE `tokenizer.json` trained here on the synthetic problems, and a
   `tokenizer_config.json` with a Qwen chat template and `<|im_end|>` as EOS;
2. writes GSM8K-shaped JSONL (a question, and an answer ending "#### n");
3. runs `configs/gsm8k_qwen25_1p5b.py` on them for `--steps` steps: the run's
   own loading (`models.from_pretrained`, the HF tokenizer, the chat
   template), its sampler, the host math verifier in the sandboxed reward
   workers and its train step, at the shapes given;
4. prints the first step's seconds (compilation included), the median
   seconds of the later steps and their breakdown from the metrics rows
   (`time/sample_s`, `time/reward_s`, `time/train_s`, `time/other_s`).

The config's lag (sync_interval 20) lets the loop sample step t+1 while step
t is scored (prefetch): the device then runs t+1's sampler before t's train
step, so `sample` is near 0 and the sampler's device time shows in `train`.
The step time is the whole step either way.

  python benchmarks/gsm8k_path.py --preset qwen2.5-0.5b --steps 20 [--json out.json]
  python benchmarks/gsm8k_path.py --preset tiny --steps 3 --prompts 2 --group 2 \\
      --new_tokens 8 --micro_batch 4      # reduced sizes, CPU

`benchmarks/accelerator.py --gsm8k_steps N` runs it after its table.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling `flags`

import flags  # noqa: E402

from configs import gsm8k_qwen25_1p5b  # noqa: E402
from offpolicy_jax import errors, models  # noqa: E402
from offpolicy_jax.run import loop, validation  # noqa: E402
from offpolicy_jax.store import metrics_files  # noqa: E402
from offpolicy_jax.study import sweeps  # noqa: E402

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2.5's chat format, without its default system prompt.
CHAT_TEMPLATE = (
  "{%- for message in messages %}"
  "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
  "{%- endfor %}"
  "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
DTYPES = ("float32", "bfloat16")  # the compute dtypes the config takes (`model_dtype`)
PHASES = ("time/sample_s", "time/reward_s", "time/train_s", "time/other_s")


def problems(n: int, seed: int = 0) -> list[dict[str, str]]:
  """`n` GSM8K-shaped rows: a two-step word problem and its worked answer ending "#### n"."""
  import random

  rng = random.Random(seed)
  rows = []
  for _ in range(n):
    a, b, c = rng.randint(2, 60), rng.randint(2, 60), rng.randint(2, 9)
    question = (
      f"Sam has {a} marbles and finds {b} more. He then gives each of his {c} friends "
      f"as many marbles as he has. How many marbles does he give away?"
    )
    answer = f"Sam has {a} + {b} = {a + b} marbles. He gives {c} * {a + b} = {c * (a + b)}.\n"
    rows.append({"question": question, "answer": answer + f"#### {c * (a + b)}"})
  return rows


def write_checkpoint(path: str, preset: str, texts: list[str]) -> models.ModelConfig:
  """A HF directory: `preset`'s random-init weights, a BPE tokenizer of `texts`, a chat template.

  The preset keeps its vocabulary (the Qwen presets' 151,936 rows of logits)
  unless the tokenizer's is larger (the toy presets). Returns the model's config.
  """
  from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
  from tokenizers import models as tok_models

  tok = Tokenizer(tok_models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=1000,
    special_tokens=list(SPECIALS),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  tok.train_from_iterator(texts, trainer)
  config = models.get_config(preset)
  config = models.get_config(preset, vocab_size=max(config.vocab_size, tok.get_vocab_size()))
  os.makedirs(path, exist_ok=True)
  tok.save(os.path.join(path, "tokenizer.json"))
  special = {str(tok.token_to_id(s)): {"content": s, "special": True} for s in SPECIALS}
  tokenizer_config = {
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "chat_template": CHAT_TEMPLATE,
    "added_tokens_decoder": special,
  }
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(tokenizer_config, f)
  models.save_pretrained(models.Decoder(config, rngs=nnx.Rngs(0)), path)
  return config


def run(
  preset: str,
  *,
  steps: int,
  prompts: int,
  group: int,
  prompt_len: int,
  new_tokens: int,
  micro_batch: int,
  dtype: str = "bfloat16",
  workdir: str | None = None,
) -> dict:
  """`steps` steps of the GSM8K config on `preset` (random weights): timings and reward checks.

  The config is checked before anything is written (a wrong size fails at once,
  naming the field); the data then ends in a clear error from the run's own
  checks (e.g. `max_prompt_len` under the longest templated prompt).
  """
  with tempfile.TemporaryDirectory() as tmp:
    hf, data = os.path.join(tmp, "hf"), os.path.join(tmp, "gsm8k.jsonl")
    rows = problems(max(4 * prompts, 64))
    with open(data, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
    cfg = sweeps.apply_overrides(
      gsm8k_qwen25_1p5b.get_config(),
      {
        "model": hf,
        "tokenizer": hf,
        "model_dtype": dtype,
        "task_kwargs.train_path": data,
        "task_kwargs.eval_path": data,
        "total_steps": steps,
        "prompts_per_step": prompts,
        "group_size": group,
        "max_prompt_len": prompt_len,
        "max_new_tokens": new_tokens,
        "train.micro_batch_size": micro_batch,
        "eval_every": 0,
        "eval_prompts": 0,
        "checkpoint_every": 0,
        "progress": False,
        "tensorboard": False,
      },
    )
    # Every check but the checkpoint's own (the preset stands in until it is written).
    validation.validate_config(sweeps.apply_overrides(cfg, {"model": preset, "tokenizer": ""}))
    begin = time.perf_counter()
    texts = [r["question"] + " " + r["answer"] for r in rows] + [
      "<think>add</think><answer>19</answer>"
    ]
    write_checkpoint(hf, preset, texts)
    write_s = time.perf_counter() - begin
    begin = time.perf_counter()
    out = loop.train_and_evaluate(cfg, workdir or os.path.join(tmp, "run"))
    run_s = time.perf_counter() - begin
  train, _ = metrics_files.split_rows(out)
  later = train[1:] or train
  result = {
    "preset": preset,
    "steps": len(train),
    "rows_per_step": prompts * group,
    "write_checkpoint_s": write_s,
    "run_s": run_s,
    "first_step_s": train[0]["step_time_s"],
    "step_s": statistics.median(r["step_time_s"] for r in later),
    "reward_failures": sum(r["reward_failures"] for r in train),
    "compiles": train[-1]["compiles"],
    "sampled_ahead": sum(r.get("time/sampled_ahead", 0) for r in train),
  }
  for phase in PHASES:
    result[phase.removeprefix("time/")] = statistics.median(r.get(phase, 0.0) for r in later)
  return result


def print_result(r: dict) -> None:
  print(
    f"GSM8K config on {r['preset']} (random weights, {r['rows_per_step']} rows per step): "
    f"{r['steps']} steps in {r['run_s']:.1f} s; first step {r['first_step_s']:.1f} s "
    f"(compilation included); {'later steps' if r['steps'] > 1 else 'that step'} "
    f"{r['step_s']:.2f} s = sample {r['sample_s']:.2f} "
    f"+ reward {r['reward_s']:.2f} + train {r['train_s']:.2f} + other {r['other_s']:.2f}; "
    f"{r['reward_failures']} failed rewards; "
    f"checkpoint written in {r['write_checkpoint_s']:.1f} s; "
    f"{r['sampled_ahead']} steps sampled ahead (their sampler's device time is in the previous "
    "step's train)"
  )


SHAPES = ("prompts", "group", "prompt_len", "new_tokens", "micro_batch")


def check_args(
  parser: argparse.ArgumentParser, args: argparse.Namespace, steps: int, presets: tuple[str, ...]
) -> None:
  """Flag errors before any work (`parser.error`: one line, exit 2)."""
  if steps < 1:
    parser.error(f"the steps of the GSM8K run must be >= 1, got {steps}")
  flags.check(parser, args, presets=presets, positive=SHAPES, rows=("prompts", "group"))


def run_and_print(preset: str, steps: int, args: argparse.Namespace) -> dict:
  """`run` at the shapes and dtype of parsed arguments (this script's, or accelerator.py's).

  A config or data error (`errors.UserError`, `ValueError`) ends in one line naming the field.
  """
  shapes = ("prompts", "group", "prompt_len", "new_tokens", "micro_batch", "dtype")
  try:
    result = run(preset, steps=steps, **{name: getattr(args, name) for name in shapes})
  except (errors.UserError, ValueError) as e:
    sys.exit(f"error: {e}")
  print(json.dumps(result), flush=True)
  print_result(result)
  return result


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="qwen2.5-0.5b")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument(
    "--dtype", default="bfloat16", choices=DTYPES, help="compute dtype (parameters float32)"
  )
  parser.add_argument("--prompts", type=int, default=16, help="G")
  parser.add_argument("--group", type=int, default=8, help="K")
  parser.add_argument(
    "--prompt_len", type=int, default=256, help="P (the templated prompts take ~115 tokens)"
  )
  parser.add_argument("--new_tokens", type=int, default=512, help="N")
  parser.add_argument("--micro_batch", type=int, default=32)
  parser.add_argument("--json", default="", help="also write the result here")
  args = parser.parse_args(argv)
  check_args(parser, args, args.steps, (args.preset,))
  result = run_and_print(args.preset, args.steps, args)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "result": result}, f, indent=1)
  return result


if __name__ == "__main__":
  main()
