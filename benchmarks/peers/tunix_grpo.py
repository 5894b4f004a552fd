"""google/tunix's GRPOLearner on the compare.py protocol.

Runs in a side environment with google-tunix and a CPU jax (see
benchmarks/compare.py), not in this project's. Reads the checkpoint directory
that compare.py writes (config.json, model.safetensors, tokenizer.json and
protocol.json with the prompt ids and sizes) with tunix's own Qwen3
safetensors loader, and prints one JSON line per round:
{"system", "round", "step_s", "generation_s", "train_s", "sampler_tok_s"}.
Round 0 is the warm-up (compilation).

GRPO step: `GRPOLearner.train` on an `RLCluster` with the actor and the
rollout sharing one model on a 1x1 mesh (the "vanilla" rollout engine),
G prompts x K generations, N new tokens forced (the EOS id is one the model
cannot produce), temperature 1, no top-k / top-p, beta = 0 (no reference
model), one iteration, AdamW, a random reward. Timing wraps the cluster's
`generate` (generation) and `update_actor` (waited on until the new parameters
are ready); a step runs from the start of its generation to the end of its
update.

  PEER_ENVS/tunix/bin/python benchmarks/peers/tunix_grpo.py --checkpoint DIR [--rounds 3]

--wait reads one line from stdin before each round (compare.py interleaves
the systems that way) and prints {"ready": true} once the model is loaded.
"""

import argparse
import importlib.metadata
import json
import os
import sys
import time

import jax
import numpy as np
import optax
import transformers
from flax import nnx
from tunix.models.qwen3 import model as qwen3_model
from tunix.models.qwen3 import params as qwen3_params
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout


def _emit(obj: dict) -> None:
  print(json.dumps(obj), flush=True)


def _read(path: str, name: str) -> dict:
  with open(os.path.join(path, name)) as f:
    return json.load(f)


def load_model(path: str, mesh: jax.sharding.Mesh):
  """Tunix's Qwen3 from the HF config.json and model.safetensors in `path`."""
  hf = _read(path, "config.json")
  config = qwen3_model.ModelConfig(
    num_layers=hf["num_hidden_layers"],
    vocab_size=hf["vocab_size"],
    embed_dim=hf["hidden_size"],
    hidden_dim=hf["intermediate_size"],
    num_heads=hf["num_attention_heads"],
    head_dim=hf["head_dim"],
    num_kv_heads=hf["num_key_value_heads"],
    rope_theta=int(hf["rope_theta"]),
    norm_eps=hf["rms_norm_eps"],
    use_tied_embedding=hf["tie_word_embeddings"],
  )
  return qwen3_params.create_model_from_safe_tensors(path, config, mesh)


def _system_name() -> str:
  tunix = importlib.metadata.version("google-tunix")
  return f"tunix GRPOLearner (tunix {tunix}, jax {jax.__version__})"


class _Timer:
  """Wraps the cluster's generate and update_actor; prints one row per step."""

  def __init__(self, cluster, wait: bool, system: str):
    self.cluster, self.wait, self.system = cluster, wait, system
    self.round, self.start = 0, None
    self.gen_s = self.gen_tokens = self.end = 0.0
    generate, update = cluster.generate, cluster.update_actor

    def timed_generate(*args, **kwargs):
      self.finish_round()
      if self.wait and not sys.stdin.readline():
        sys.exit(0)
      self.start = time.perf_counter()
      out = generate(*args, **kwargs)
      self.gen_s = time.perf_counter() - self.start
      self.gen_tokens = sum(len(t) for t in out.tokens)
      return out

    def timed_update(*args, **kwargs):
      update(*args, **kwargs)
      jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
      self.end = time.perf_counter()

    cluster.generate, cluster.update_actor = timed_generate, timed_update

  def finish_round(self) -> None:
    if self.start is None:
      return
    step = self.end - self.start
    _emit({"system": self.system, "round": self.round, "step_s": step,
           "generation_s": self.gen_s, "train_s": step - self.gen_s,
           "sampler_tok_s": self.gen_tokens / self.gen_s})  # fmt: skip
    self.round, self.start = self.round + 1, None


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", required=True, help="directory written by compare.py")
  parser.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up")
  parser.add_argument("--wait", action="store_true", help="one stdin line per round")
  args = parser.parse_args()
  protocol = _read(args.checkpoint, "protocol.json")
  g, k, p, n = (protocol[x] for x in ("prompts", "group", "prompt_len", "new_tokens"))
  steps = args.rounds + 1

  auto = (jax.sharding.AxisType.Auto,) * 2  # tunix constrains shardings by hand
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=auto)
  model = load_model(args.checkpoint, mesh)
  tokenizer = transformers.AutoTokenizer.from_pretrained(args.checkpoint)
  roles = rl_cluster_lib.Role
  cluster_config = rl_cluster_lib.ClusterConfig(
    role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
    rollout_engine="vanilla",
    offload_to_cpu=False,
    training_config=rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=optax.adamw(protocol["learning_rate"]),
      eval_every_n_steps=10**6,
      max_steps=steps,
      pbar_description=None,
    ),
    rollout_config=base_rollout.RolloutConfig(
      max_tokens_to_generate=n,
      max_prompt_length=p,
      kv_cache_size=p + n + 8,
      temperature=1.0,
      top_p=1.0,
      top_k=None,
      eos_tokens=[protocol["vocab"]],  # outside the vocabulary: never sampled
    ),
  )
  cluster = rl_cluster_lib.RLCluster(
    actor=model, reference=None, tokenizer=tokenizer, cluster_config=cluster_config
  )
  rng = np.random.default_rng(protocol["seed"])

  def random_reward(prompts, completions, **kwargs):
    return rng.uniform(size=len(completions)).tolist()

  learner = grpo_learner.GRPOLearner(
    rl_cluster=cluster,
    reward_fns=random_reward,
    algo_config=grpo_learner.GRPOConfig(num_generations=k, num_iterations=1, beta=0.0),
  )
  prompts = [" ".join(f"t{i}" for i in ids) for ids in protocol["prompt_ids"]]
  assert len(prompts) == g
  timer = _Timer(cluster, args.wait, _system_name())
  if args.wait:
    _emit({"ready": True})
  # A batch is a dict of arrays (tunix repeats each leaf K times along axis 0).
  learner.train([{"prompts": np.array(prompts)} for _ in range(steps)])
  timer.finish_round()


if __name__ == "__main__":
  main()
