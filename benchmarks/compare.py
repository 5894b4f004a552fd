"""One GRPO protocol, timed side by side: offpolicy_jax, google/tunix and TRL.

The protocol (issue 14): one random Qwen3 checkpoint (6 layers, d=512, vocab
4096, 21.1M parameters, float32), GRPO with G=4 prompts x K=8 samples, P=64
prompt tokens of random ids, N=128 new tokens forced (no EOS), temperature 1,
a random reward per response (every group has a non-zero advantage), one
optimizer step per batch, no KL term. This script

1. builds the checkpoint with `models.save_pretrained` in a temporary
   directory, with a word-level `tokenizer.json` whose token `t<i>` is id `i`
   and a `protocol.json` holding the prompt ids, so every system reads the
   same weights and prompts;
2. times our side in this process: `sampling.make_sampler` (generation),
   then group-relative advantages (`advantages.compute("grpo")`) and
   `train_step.make_train_step(..., "grpo")` (train), once per variant;
3. runs each peer whose interpreter is given in a side environment, as a
   subprocess (`benchmarks/peers/tunix_grpo.py`, `benchmarks/peers/trl_grpo.py`,
   the latter also as bare `transformers` generate), on the same checkpoint;
4. interleaves the rounds (ours, tunix, TRL, ours, ...), drops one warm-up
   round per system and prints the medians of `--rounds` rounds, the ratios of
   each of our variants to each peer, and the achieved FLOP/s of each phase
   against a matmul peak measured here.

Columns: "generation s" is the sampler call; "train s" is the rest of the step
(rewards, advantages, log-prob recomputation, backward, optimizer update);
"GRPO s/step" is the whole step; "sampler tok/s" is B * N / generation s.

Model FLOPs (PaLM appendix B, Chowdhery et al., arXiv:2204.02311), for B = G*K
rows of S = P + N tokens, N_mm the matmul parameters (output projection
included, embedding lookup excluded), L layers of n heads of width h:

  forward = B * S * (2 * N_mm + 4 * L * n * h * S),  train = 3 * forward,

the same count for every system (work a plain implementation needs, whatever a
system skips), so FLOP/s ratios equal speed ratios. The peak is the median
FLOP/s of a jitted float32 `jnp` matmul of `--peak_size`.

Side environments (outside the repository; not project dependencies), with
PEER_ENVS any directory:

  python3 -m venv PEER_ENVS/tunix
  PEER_ENVS/tunix/bin/pip install google-tunix "jax[cpu]"
  python3 -m venv PEER_ENVS/trl
  PEER_ENVS/trl/bin/pip install torch trl transformers   # pin a CPU torch wheel

Usage:

  python benchmarks/compare.py --tunix_python PEER_ENVS/tunix/bin/python \\
      --trl_python PEER_ENVS/trl/bin/python [--rounds 3] [--json OUT]
  python benchmarks/compare.py --variants "baseline:;fast:num_micro_batches=2"

`--train_options k=v,...` go to `make_train_step` for every variant;
`--variants "name:k=v,...;name2:..."` adds per-variant options (values are
Python literals, else strings). A peer that is not given is listed as skipped.
"""

import argparse
import ast
import dataclasses
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers import models as tok_models

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offpolicy_jax import advantages, losses, models  # noqa: E402
from offpolicy_jax.learn import train_state, train_step  # noqa: E402
from offpolicy_jax.sampling import sampler as sampling  # noqa: E402
from offpolicy_jax.types import TrainBatch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import roofline  # noqa: E402

# Our rows: "name:options;name:options". Edit to time new optimisations by default.
# "baseline" is the plain train step; "optimized" runs each group's prompt once
# and leaves zero-advantage rows out (both exact; the run layer's defaults).
DEFAULT_VARIANTS = "baseline:;optimized:shared_prefix=True,skip_zero_advantage=True"
PEERS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers")
# (peer system prefix, column) -> speed-up of ours the issue asks for.
TARGETS = {("tunix", "step_s"): 1.5, ("TRL", "step_s"): 2.5, ("tunix", "sampler_tok_s"): 1.3}
_COLUMNS = ("step_s", "generation_s", "train_s", "sampler_tok_s")


@dataclasses.dataclass(frozen=True)
class Protocol:
  """Sizes of the benchmark (the issue's defaults)."""

  layers: int = 6
  hidden: int = 512
  vocab: int = 4096
  prompts: int = 4
  group: int = 8
  prompt_len: int = 64
  new_tokens: int = 128
  learning_rate: float = 1e-6
  # Fraction of groups with equal rewards (zero advantage); our side only, the
  # peer scripts draw every reward at random (the protocol: 0).
  uniform_groups: float = 0.0
  seed: int = 0

  @property
  def rows(self) -> int:
    return self.prompts * self.group


def model_config(p: Protocol) -> models.ModelConfig:
  """Qwen3-style config: heads of width 64, MHA, F = 2.6875 D, tied embeddings."""
  heads = max(1, p.hidden // 64)
  return models.ModelConfig(
    family="qwen3",
    qk_norm=True,
    vocab_size=p.vocab,
    hidden_size=p.hidden,
    intermediate_size=p.hidden * 43 // 16,
    num_layers=p.layers,
    num_heads=heads,
    num_kv_heads=heads,
    head_dim=p.hidden // heads,
    rope_theta=1e6,
    tie_embeddings=True,
    max_position_embeddings=max(512, p.prompt_len + p.new_tokens),
  )


def write_checkpoint(p: Protocol, path: str) -> models.ModelConfig:
  """Random weights, a word-level tokenizer and the prompts, all in `path`."""
  config = model_config(p)
  models.save_pretrained(models.Decoder(config, rngs=nnx.Rngs(p.seed)), path)
  # id 0 <pad>, id 1 <eos>, id i >= 2 "t<i>"; prompts use ids >= 2 only.
  vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, p.vocab)}}
  tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<pad>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.save(os.path.join(path, "tokenizer.json"))
  tok_config = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "pad_token": "<pad>",
    "eos_token": "<eos>",
    "model_max_length": config.max_position_embeddings,
  }
  rng = np.random.default_rng(p.seed)
  prompt_ids = rng.integers(2, p.vocab, (p.prompts, p.prompt_len)).tolist()
  for name, obj in (
    ("tokenizer_config.json", tok_config),
    ("protocol.json", {**dataclasses.asdict(p), "prompt_ids": prompt_ids}),
  ):
    with open(os.path.join(path, name), "w") as f:
      json.dump(obj, f)
  return config


def model_flops(config: models.ModelConfig, p: Protocol) -> dict[str, float]:
  """Model FLOPs of each phase of one GRPO step (see the module docstring)."""
  d, f, n, kv, h = (
    config.hidden_size,
    config.intermediate_size,
    config.num_heads,
    config.num_kv_heads,
    config.head_dim,
  )
  n_mm = config.num_layers * (2 * d * n * h + 2 * d * kv * h + 3 * d * f) + config.vocab_size * d
  s = p.prompt_len + p.new_tokens
  forward = p.rows * s * (2 * n_mm + 4 * config.num_layers * n * h * s)
  return {"generation_s": forward, "train_s": 3 * forward, "step_s": 4 * forward}


def _literal(text: str) -> Any:
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def parse_options(text: str) -> dict[str, Any]:
  """ "k=v,k2=v2" -> {k: literal(v)}; values that are not literals stay strings."""
  out = {}
  for item in filter(None, (s.strip() for s in text.split(","))):
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
      raise ValueError(f"train option {item!r} is not key=value")
    out[key.strip()] = _literal(value.strip())
  return out


def parse_variants(text: str, common: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """ "name:k=v,...;name2:..." -> {name: {**common, k: v}}, names unique."""
  out: dict[str, dict[str, Any]] = {}
  for item in filter(None, (s.strip() for s in text.split(";"))):
    name, _, options = item.partition(":")
    name = name.strip()
    if not name or name in out:
      raise ValueError(f"variant {item!r}: names must be non-empty and unique")
    out[name] = {**common, **parse_options(options)}
  if not out:
    raise ValueError("--variants names no variant")
  return out


def check_train_options(name: str, options: dict[str, Any]) -> None:
  """Raises ValueError naming options `make_train_step` does not take."""
  params = inspect.signature(train_step.make_train_step).parameters
  accepted = {k for k, v in params.items() if v.kind == v.KEYWORD_ONLY}
  if any(v.kind == v.VAR_KEYWORD for v in params.values()):  # forwarded to the loss spec
    accepted |= {f.name for f in dataclasses.fields(losses.get_spec("grpo"))}
  unknown = sorted(set(options) - accepted)
  if unknown:
    raise ValueError(
      f"variant {name!r}: make_train_step takes no option(s) {unknown}; "
      f"accepted: {', '.join(sorted(accepted))}"
    )


def _grpo_batch(out: sampling.SampleOutput, prompts, p: Protocol, key) -> TrainBatch:
  """The train batch of one sampled group, random rewards, GRPO advantages."""
  rewards = jax.random.uniform(key, (p.rows,))
  # The first uniform_groups * G groups get one reward for all K responses: zero advantage.
  flat = jnp.arange(p.rows) < round(p.uniform_groups * p.prompts) * p.group
  rewards = jnp.where(flat, 1.0, rewards)
  adv = advantages.compute("grpo", rewards.reshape(p.prompts, p.group)).reshape(-1)
  return TrainBatch(
    prompt_tokens=jnp.repeat(prompts, p.group, axis=0),
    prompt_mask=jnp.ones((p.rows, p.prompt_len), jnp.float32),
    tokens=out.tokens,
    mask=out.mask,
    behavior_logp=out.logprobs,
    advantages=adv,
    rewards=rewards,
    versions=jnp.zeros(out.tokens.shape, jnp.int32),
    weights=jnp.ones((p.rows,), jnp.float32),
    behavior_kept=out.kept,
    old_logp=out.logprobs,
  )


def make_our_round(path: str, p: Protocol, options: dict[str, Any]) -> Callable[[int], dict]:
  """`round(i) -> row` timing one GRPO step of our engine on the checkpoint in `path`."""
  graphdef, params = nnx.split(models.from_pretrained(path, jnp.float32))
  sampler = sampling.make_sampler(graphdef, max_new_tokens=p.new_tokens, group_size=p.group)
  optimizer = train_state.make_optimizer(p.learning_rate)
  options = {"group_size": p.group, **options}
  if "group_size" not in inspect.signature(train_step.make_train_step).parameters:
    options.pop("group_size")  # an older checkout, for before/after runs
  step = train_step.make_train_step(graphdef, optimizer, "grpo", **options)
  state = train_state.init_train_state(params, optimizer)
  prompts = jnp.asarray(_read_protocol(path)["prompt_ids"], jnp.int32)
  lengths = jnp.full((p.prompts,), p.prompt_len, jnp.int32)
  make_batch = jax.jit(_grpo_batch, static_argnums=2)

  def run_round(i: int) -> dict:
    nonlocal state
    key_sample, key_reward, key_step = jax.random.split(jax.random.key(i), 3)
    t0 = time.perf_counter()
    out = jax.block_until_ready(sampler(state.params, prompts, lengths, key_sample))
    t1 = time.perf_counter()
    state, metrics = step(state, make_batch(out, prompts, p, key_reward), key_step)
    jax.block_until_ready(metrics)
    t2 = time.perf_counter()
    new_tokens = float(out.mask.sum())
    return {
      "step_s": t2 - t0,
      "generation_s": t1 - t0,
      "train_s": t2 - t1,
      "sampler_tok_s": new_tokens / (t1 - t0),
    }

  return run_round


def _read_protocol(path: str) -> dict:
  with open(os.path.join(path, "protocol.json")) as f:
    return json.load(f)


class Peer:
  """A peer script in its own interpreter, one round per "go" line on its stdin.

  The script prints one JSON object per round (`system` and the `_COLUMNS`);
  a dead or failing peer is recorded in `error`, never raised.
  """

  def __init__(self, label: str, argv: list[str], log_path: str):
    self.label, self.system, self.error = label, label, None
    self.log_path = log_path
    self._log = open(log_path, "w")
    self._proc = subprocess.Popen(
      argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True
    )

  def wait_ready(self) -> None:
    """Blocks until the peer has loaded its model (it then idles on stdin)."""
    self._request(None)

  def run_round(self) -> dict | None:
    line = self._request("go")
    if line is not None:
      self.system = line.get("system", self.label)
    return line

  def _request(self, command: str | None) -> dict | None:
    if self.error:
      return None
    try:
      if command:
        self._proc.stdin.write(command + "\n")
        self._proc.stdin.flush()
      return self._readline_json()
    except (OSError, ValueError) as e:
      self.error = f"{type(e).__name__}: {e} (log: {self.log_path})"
      return None

  def _readline_json(self) -> dict:
    while True:
      line = self._proc.stdout.readline()
      if not line:
        tail = _tail(self.log_path)
        raise ValueError(f"exited with code {self._proc.wait()}: {tail}")
      try:
        obj = json.loads(line)
      except ValueError:
        continue  # other output (library banners, summaries) is ignored
      if isinstance(obj, dict):
        return obj

  def close(self) -> None:
    if self._proc.poll() is None:
      self._proc.stdin.close()
      try:
        self._proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        self._proc.kill()
    self._log.close()


def _tail(path: str, lines: int = 3) -> str:
  with open(path, errors="replace") as f:
    return " | ".join(line.strip() for line in f.readlines()[-lines:])


def start_peers(args, path: str, log_dir: str) -> tuple[list[Peer], list[str]]:
  """The peers whose interpreters are given, started on `path`; and the skipped ones."""
  specs = [
    ("tunix GRPOLearner", args.tunix_python, "tunix_grpo.py", []),
    ("TRL GRPOTrainer (torch CPU)", args.trl_python, "trl_grpo.py", []),
    ("transformers generate", args.trl_python, "trl_grpo.py", ["--generate_only"]),
  ]
  peers, skipped = [], []
  for label, python, script, extra in specs:
    if not python:
      skipped.append(label)
      continue
    script_path = os.path.join(PEERS_DIR, script)
    argv = [python, script_path, "--checkpoint", path, "--rounds", str(args.rounds), "--wait"]
    argv += extra
    log = os.path.join(log_dir, f"{script[:-3]}{'_'.join(extra).replace('-', '')}.log")
    peers.append(Peer(label, argv, log))
  return peers, skipped


def interleaved_rounds(systems: dict[str, Callable[[int], dict | None]], rounds: int):
  """{name: [row per round]}: round 0 (warm-up) for all, then 1..rounds, interleaved."""
  results: dict[str, list[dict]] = {name: [] for name in systems}
  for i in range(rounds + 1):
    for name, run_round in systems.items():
      row = run_round(i)
      if row is not None and i > 0:
        results[name].append(row)
      print(f"round {i}{' (warm-up)' if i == 0 else ''} {name}: {_brief(row)}", flush=True)
  return results


def _brief(row: dict | None) -> str:
  if row is None:
    return "failed"
  return ", ".join(f"{k}={row[k]:.3g}" for k in _COLUMNS if row.get(k) is not None)


def medians(rows: list[dict]) -> dict[str, float | None]:
  """Per-column medians over rounds (None for a column a system does not report)."""
  out = {}
  for col in _COLUMNS:
    values = [r[col] for r in rows if r.get(col) is not None]
    out[col] = float(np.median(values)) if values else None
  return out


def ratios(ours: dict, peer: dict) -> dict[str, float | None]:
  """Speed-ups of ours over a peer: peer time / our time, our tok/s / peer tok/s."""
  out = {}
  for col in _COLUMNS:
    a, b = ours.get(col), peer.get(col)
    if a is None or b is None or a <= 0 or b <= 0:
      out[col] = None
    else:
      out[col] = a / b if col == "sampler_tok_s" else b / a
  return out


def _fmt(x: float | None, spec: str) -> str:
  return "-" if x is None else format(x, spec)


def _times_table(rows: list[dict]) -> list[str]:
  lines = [
    "| system | GRPO s/step | generation s | train s | sampler tok/s |",
    "|---|---|---|---|---|",
  ]
  for row in rows:
    m = row["median"]
    if row["status"]:
      lines.append(f"| {row['system']} | {row['status']} | | | |")
      continue
    cells = [_fmt(m[c], ".3g") for c in _COLUMNS[:3]] + [_fmt(m["sampler_tok_s"], ",.0f")]
    lines.append(f"| {row['system']} | {' | '.join(cells)} |")
  return lines


def _ratios_table(speedups: list[dict]) -> list[str]:
  if not speedups:
    return ["No peer ran: no speed-ups."]
  lines = ["Speed-ups of ours (peer time / our time; our tok/s / peer tok/s):", ""]
  lines += ["| ours | vs | GRPO step | generation | train | sampler tok/s | targets |"]
  lines.append("|---|---|---|---|---|---|---|")
  for r in speedups:
    cells = [_fmt(r["ratio"][c], ".2f") + ("x" if r["ratio"][c] else "") for c in _COLUMNS]
    lines.append(f"| {r['ours']} | {r['peer']} | {' | '.join(cells)} | {r['targets'] or '-'} |")
  return lines


def _flops_table(rows: list[dict], peak: float, flops: dict[str, float]) -> list[str]:
  lines = [
    f"Achieved model FLOP/s (fraction of the measured float32 matmul peak, "
    f"{peak / 1e9:.1f} GFLOP/s; model GFLOP per step: generation "
    f"{flops['generation_s'] / 1e9:.3g}, train {flops['train_s'] / 1e9:.3g}):",
    "",
    "| system | generation | train | GRPO step |",
    "|---|---|---|---|",
  ]
  for row in (r for r in rows if not r["status"]):
    cells = []
    for col in ("generation_s", "train_s", "step_s"):
      t = row["median"][col]
      rate = None if t is None else flops[col] / t
      cells.append("-" if rate is None else f"{rate / 1e9:.1f} GFLOP/s ({rate / peak:.0%})")
    lines.append(f"| {row['system']} | {' | '.join(cells)} |")
  return lines


def format_tables(table: dict, peak: float, flops: dict[str, float]) -> str:
  """The three markdown tables: medians, speed-ups, achieved FLOP/s."""
  parts = [
    _times_table(table["rows"]),
    _ratios_table(table["ratios"]),
    _flops_table(table["rows"], peak, flops),
  ]
  return "\n\n".join("\n".join(lines) for lines in parts)


def _targets(peer_system: str, ratio: dict) -> str:
  out = []
  for (prefix, col), target in TARGETS.items():
    if peer_system.startswith(prefix) and ratio[col] is not None:
      verdict = "met" if ratio[col] >= target else "MISSED"
      out.append(f"{col.split('_')[0]} >= {target}x {verdict}")
  return "; ".join(out)


def _row(system: str, rounds: list[dict], status: str | None) -> dict:
  return {"system": system, "median": medians(rounds), "rounds": rounds, "status": status}


def build_table(results: dict[str, list[dict]], ours: list[str], peers: list[Peer], skipped):
  """Rows (medians, raw rounds, status) and the speed-ups of each of our variants."""
  by_label = {peer.label: peer for peer in peers}
  rows = []
  for name, rounds in results.items():
    peer = by_label.get(name)
    status = f"failed: {peer.error}" if peer and peer.error else None if rounds else "no rounds"
    rows.append(_row(peer.system if peer else name, rounds, status))
  rows += [_row(s, [], "skipped (no interpreter given)") for s in skipped]
  ok = [r for r in rows if not r["status"]]
  speedups = []
  for o in (r for r in ok if r["system"] in ours):
    for q in (r for r in ok if r["system"] not in ours):
      ratio = ratios(o["median"], q["median"])
      speedups.append(
        {
          "ours": o["system"],
          "peer": q["system"],
          "ratio": ratio,
          "targets": _targets(q["system"], ratio),
        }
      )
  return {"rows": rows, "ratios": speedups}


def run(args) -> dict:
  """Builds the checkpoint, times every system, prints and returns the tables."""
  p = Protocol(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Protocol)})
  variants = parse_variants(args.variants, parse_options(args.train_options))
  for name, options in variants.items():
    check_train_options(name, options)
  with tempfile.TemporaryDirectory() as path:
    config = write_checkpoint(p, path)
    print(
      f"checkpoint: Qwen3 {p.layers} layers, d={p.hidden}, vocab {p.vocab}, "
      f"{config.num_params() / 1e6:.1f}M parameters, float32; GRPO {p.prompts} prompts x "
      f"{p.group} samples, {p.prompt_len} prompt + {p.new_tokens} new tokens; "
      f"median of {args.rounds} rounds after one warm-up; device {jax.devices()[0].platform}"
      + (f"; {p.uniform_groups:.0%} of our groups zero-advantage" if p.uniform_groups else ""),
      flush=True,
    )
    if args.log_dir:
      os.makedirs(args.log_dir, exist_ok=True)
    peers, skipped = start_peers(args, path, args.log_dir or path)
    try:
      systems = {f"offpolicy_jax {n}": make_our_round(path, p, o) for n, o in variants.items()}
      for peer in peers:
        peer.wait_ready()
        systems[peer.label] = lambda i, peer=peer: peer.run_round()
      results = interleaved_rounds(systems, args.rounds)
    finally:
      for peer in peers:
        peer.close()
  peak = roofline.matmul_peak(args.peak_size)
  flops = model_flops(config, p)
  table = build_table(results, [f"offpolicy_jax {n}" for n in variants], peers, skipped)
  print()
  print(format_tables(table, peak, flops))
  table.update(
    peak_flops=peak,
    model_flops=flops,
    protocol=dataclasses.asdict(p),
    params=config.num_params(),
    variants=variants,
  )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(table, f, indent=2)
  return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  for f in dataclasses.fields(Protocol):
    parser.add_argument(f"--{f.name}", type=type(f.default), default=f.default)
  parser.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up")
  parser.add_argument("--tunix_python", default="", help="python of a google-tunix env")
  parser.add_argument("--trl_python", default="", help="python of a TRL env")
  parser.add_argument("--train_options", default="", help="k=v,... for every variant")
  parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="name:k=v,...;name2:...")
  parser.add_argument("--peak_size", type=int, default=2048, help="matmul size of the peak")
  parser.add_argument("--log_dir", default="", help="where peer logs go (default: temporary)")
  parser.add_argument("--json", default="", help="write the table rows here")
  return parser.parse_args(argv)


if __name__ == "__main__":
  run(parse_args())
