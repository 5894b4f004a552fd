"""A seeded grid of methods x lag schedules, run with `jax.vmap` over seeds.

Every cell (method, lag) runs all seeds at once: the run states of the seeds
are stacked on a leading axis and one jitted `vmap(rl_step.rl_steps)` advances
them together, evaluating every `config.eval_every` steps with a vmapped
greedy sampler on `config.eval_prompts` held-out prompts. Runs with the same
seed share the warm start (`sft.warm_start`, computed once per seed) and the
prompt stream, so they are paired (`study.stats`). The lag schedule is a traced
argument and every cell has the same number of snapshot slots, so the lags of
one method share one compiled program.

Finished cells go to `workdir/cells/<method>@<lag>.json` (atomically); a rerun
skips them, so an interrupted study resumes (`study.report` makes the tables),
unless a field a finished cell depends on has changed (`config_schema`: every
field whose role reaches a study cell; not how seeds are batched, the report's
settings, checkpoints, logging, the mesh or the reward workers).

A/A calibration: for every lag of `config.study.aa_lags` the baseline method
runs a second time as the cell `aa-<method>@<lag>`, from the same warm starts
on the same prompts, with every other random stream (sampling, advantages,
replay, training) drawn from seed + `AA_STREAM_OFFSET` instead of seed. The
two runs differ only by chance, so `study.report` counts how often its tests
call them different (`study.stats`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from offpolicy_jax import advantages, config_schema, lag, losses
from offpolicy_jax.rollout import host_step, pipeline, programs, rl_step
from offpolicy_jax.run import components, evaluation, sft
from offpolicy_jax.store import workdir
from offpolicy_jax.study import sweeps

CELLS_DIR = "cells"
CONFIG_FILE = "study_config.json"
# The A/A twin of the baseline method is the method `AA_PREFIX + method`.
AA_PREFIX = "aa-"
# Added to each seed for the A/A twin's random streams (not its warm start or prompts).
AA_STREAM_OFFSET = 1_000_000


@dataclasses.dataclass(frozen=True)
class Grid:
  """What a study runs: methods (config overrides) x lags (m, n) x seeds."""

  methods: Mapping[str, Mapping[str, Any]]
  lags: Mapping[str, tuple[int, int]]
  seeds: tuple[int, ...]
  eval_last: int
  baseline: tuple[str, str]
  vmap_seeds: int = 0  # seeds per vmapped program (0: all)
  eval_batch: int = 0  # held-out prompts per sampler call (0: all at once)
  # Engine-mismatch overrides of a lag entry (`ENGINES`, "name=m/n+engine"); none: exact.
  engines: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
  # Lags at which the baseline method runs again as its A/A twin (`aa_method`).
  aa_lags: tuple[str, ...] = ()

  @property
  def aa_method(self) -> str:
    """The name of the baseline method's A/A twin (cells `aa-<method>@<lag>`)."""
    return AA_PREFIX + self.baseline[0]

  def cells(self) -> list[tuple[str, str]]:
    """Every cell: methods x lags, then the A/A twins."""
    cells = [(m, g) for m in self.methods for g in self.lags]
    return cells + [(self.aa_method, g) for g in self.aa_lags]


def _parse_pairs(field: str, spec: str) -> list[tuple[str, str]]:
  pairs = []
  for item in (s.strip() for s in spec.split(",")):
    if not item:
      continue
    name, _, value = item.partition("=")
    if not name.isidentifier() and not name.replace("-", "_").isidentifier():
      raise ValueError(f"config.study.{field}: {name!r} is not a name (letters, digits, _ and -)")
    pairs.append((name, value or name))
  if not pairs:
    raise ValueError(f"config.study.{field} is empty")
  names = [n for n, _ in pairs]
  if len(set(names)) != len(names):
    raise ValueError(f"config.study.{field}: duplicate names in {names}")
  return pairs


def parse_methods(spec: str) -> dict[str, dict[str, str]]:
  """`"grpo,red_drop=reinforce+red_drop"` -> {name: {loss.name, advantage.name}} overrides."""
  out = {}
  for name, value in _parse_pairs("methods", spec):
    loss, _, adv = value.partition("+")
    out[name] = {"loss.name": loss} | ({"advantage.name": adv} if adv else {})
  return out


# Engine-mismatch settings a lag entry can carry ("bf16_onpolicy=1/0+bf16"): the
# sampler's numerics or truncation differ from the learner's at the same
# parameters (docs/off_policyness.md). `rollout.score_old` reports both factors.
ENGINES: dict[str, dict[str, Any]] = {
  "bf16": {"rollout.sampler_dtype": "bfloat16", "rollout.score_old": True},
  "topk5": {"top_k": 5, "rollout.behavior_logp": "mismatched", "rollout.score_old": True},
  "topp8": {"top_p": 0.8, "rollout.behavior_logp": "mismatched", "rollout.score_old": True},
}


# Off-policy diagnostics a run's record keeps (means over its steps; docs/off_policyness.md).
OFF_POLICY_METRICS = (
  "behavior_kl_k3",
  "staleness_kl_k3",
  "mismatch_kl_k3",
  "clip_frac",
  "corr_token_masked_frac",
  "corr_seq_masked_frac",
  "corr_token_truncated_frac",
)


def parse_engines(spec: str) -> dict[str, dict[str, Any]]:
  """The `ENGINES` overrides of the lag entries of `spec` that name one (`name=m/n+engine`)."""
  out = {}
  for name, value in _parse_pairs("lags", spec):
    engine = value.partition("+")[2]
    if not engine:
      continue
    if engine not in ENGINES:
      raise ValueError(
        f"config.study.lags: {name}={value!r} names an unknown engine setting {engine!r} "
        f"(one of {sorted(ENGINES)})"
      )
    out[name] = ENGINES[engine]
  return out


def parse_lags(spec: str, total_steps: int) -> dict[str, tuple[int, int]]:
  """`"onpolicy=1/0,interval20=20/0,offline=offline,bf16=1/0+bf16"` -> {name: (m, n)}.

  `offline` stands for m = total_steps + 1: every batch from version 0. A
  `+engine` suffix adds an engine-mismatch setting (`parse_engines`).
  """
  out = {}
  for name, value in _parse_pairs("lags", spec):
    value = value.partition("+")[0]
    if value == "offline":
      out[name] = (total_steps + 1, 0)
      continue
    m, sep, n = value.partition("/")
    try:
      pair = (int(m), int(n))
      if not sep:
        raise ValueError
      lag.validate_schedule(*pair)
    except ValueError as e:
      raise ValueError(
        f"config.study.lags: {name}={value!r} is not 'm/n' (sync_interval >= 1 / "
        f"sync_offset >= 0) or 'offline' ({e})"
      ) from None
    out[name] = pair
  return out


def parse_aa_lags(spec: str, lags: Mapping[str, Any]) -> tuple[str, ...]:
  """`"all"` -> every lag, `""` -> none, `"onpolicy,offline"` -> those (names of `lags`)."""
  if spec.strip() == "all":
    return tuple(lags)
  names = tuple(s.strip() for s in spec.split(",") if s.strip())
  unknown = [g for g in names if g not in lags]
  if unknown or len(set(names)) != len(names):
    raise ValueError(
      f"config.study.aa_lags: {spec!r} must be 'all', '' or distinct lags of the grid "
      f"(unknown {unknown}; lags {list(lags)})"
    )
  return names


def grid_from_config(config: ml_collections.ConfigDict) -> tuple[ml_collections.ConfigDict, Grid]:
  """(the base run config without `study`, the grid of `config.study`)."""
  config_schema.check(config, config_schema.STUDY_FIELDS)
  st = config.study
  base = ml_collections.ConfigDict({k: v for k, v in config.items() if k != "study"})
  run = components.run_settings(base)
  if run.eval_every < 1 or run.total_steps % run.eval_every:
    raise ValueError(
      f"config.eval_every: {run.eval_every} must be >= 1 and divide total_steps {run.total_steps}"
    )
  if not st.eval_last <= run.total_steps // run.eval_every:
    raise ValueError(
      f"config.study.eval_last: {st.eval_last} evaluations, the run has "
      f"{run.total_steps // run.eval_every}"
    )
  if run.lag_mode != "sync":
    raise ValueError("config.lag.mode: a study simulates lag exactly; it must be 'sync'")
  if base.mesh.sampler_devices:
    raise ValueError(
      "config.mesh.sampler_devices: a study runs every seed's step as one program on one "
      "mesh; it must be 0"
    )
  if base.multiturn.max_turns and base.rollout.partial_budget:
    raise ValueError(
      "config.rollout.partial_budget: a study plays every seed's episodes to their end within "
      "the step; episodes in flight across steps (rollout.episode_pool) run in single runs only"
    )
  if base.rollout.continuous_auto_steps:
    raise ValueError(
      "config.rollout.continuous_auto_steps: a study runs one sampler for every seed and "
      "cell; it must be 0 (choose with rollout.continuous_slots)"
    )
  methods = parse_methods(st.methods)
  for name, overrides in methods.items():
    loss, adv = overrides["loss.name"], overrides.get("advantage.name")
    if loss not in losses.names() or (adv and adv not in advantages.names()):
      raise ValueError(
        f"config.study.methods: {name}={loss}{'+' + adv if adv else ''} names an unknown "
        f"loss or advantage (losses.names(), advantages.names())"
      )
    if name.startswith(AA_PREFIX):
      raise ValueError(
        f"config.study.methods: {name!r}: names starting with {AA_PREFIX!r} are the A/A twins"
      )
  lags = parse_lags(st.lags, run.total_steps)
  method, _, lag_name = st.baseline.partition("@")
  if method not in methods or lag_name not in lags:
    raise ValueError(
      f"config.study.baseline: {st.baseline!r} must be <method>@<lag> of the grid "
      f"(methods {list(methods)}, lags {list(lags)})"
    )
  seeds = tuple(range(run.seed, run.seed + st.seeds))
  grid = Grid(
    methods,
    lags,
    seeds,
    st.eval_last,
    (method, lag_name),
    st.vmap_seeds,
    st.eval_batch,
    parse_engines(st.lags),
    parse_aa_lags(st.aa_lags, lags),
  )
  return base, grid


def _stack(trees: list) -> Any:
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def evaluate(
  fns: rl_step.StepFns,
  params,
  seeds: tuple[int, ...],
  num_prompts: int,
  *,
  k: int = 0,
  step: int = 0,
  batch_size: int = 0,
  base=None,
):
  """Greedy accuracy [S] (and pass@k [S] when k >= 2) of seed-stacked `params` (over `base`).

  The run's evaluator (`evaluation.evaluate_seeds`) on the first `num_prompts`
  held-out prompts, `batch_size` at a time (0: all at once), pass@k sampled
  with each seed's EVAL key of `step`.
  """
  keys = jax.vmap(lambda s: pipeline.step_key(s, step, pipeline.EVAL))(jnp.asarray(seeds))
  ev = evaluation.evaluate_seeds(
    fns, params, keys, num_prompts, k, batch_size=batch_size or num_prompts, base=base
  )
  return ev["accuracy"], ev.get(f"pass@{k}")


def _prompt_chunk(iters: list, n: int, host_fields: bool) -> dict[str, Any]:
  """[S, n, ...] prompts: n batches from each seed's iterator."""
  fields = pipeline.DEVICE_FIELDS + (("index", "valid") if host_fields else ())
  per_seed = []
  for it in iters:
    batches = [next(it) for _ in range(n)]
    per_seed.append({k: np.stack([b[k] for b in batches]) for k in fields})
  return {k: np.stack([p[k] for p in per_seed]) for k in fields}


def grid_snapshot_slots(grid: Grid) -> int:
  """Snapshot slots enough for every lag of the grid (one state shape for all)."""
  return max(lag.snapshot_capacity(m, n) for m, n in grid.lags.values())


def run_cell(
  base: ml_collections.ConfigDict,
  grid: Grid,
  method: str,
  lag_name: str,
  starts: dict[int, Any] | None = None,
) -> dict[str, Any]:
  """Runs every seed of one cell; returns its record (curves per seed, JSON-ready).

  Seeds run `grid.vmap_seeds` at a time under one `vmap` (0: all at once).
  `starts` keeps the warm-started parameters of each seed between cells (filled here).
  The A/A twin (`grid.aa_method`) runs the baseline method with its random
  streams drawn from seed + `AA_STREAM_OFFSET`.
  """
  m, n = grid.lags[lag_name]
  aa = method == grid.aa_method and lag_name in grid.aa_lags
  offset = AA_STREAM_OFFSET if aa else 0
  overrides = {
    **grid.methods[grid.baseline[0] if aa else method],
    **grid.engines.get(lag_name, {}),
    "lag.sync_interval": m,
    "lag.sync_offset": n,
  }
  comps = components.build_components(sweeps.apply_overrides(base, overrides))
  starts = {} if starts is None else starts
  for s in grid.seeds:
    if s not in starts:
      starts[s] = warm_start(comps, s, base_seed=grid.seeds[0])
  size = grid.vmap_seeds or len(grid.seeds)
  runs = []
  for lo in range(0, len(grid.seeds), size):
    seeds = grid.seeds[lo : lo + size]
    runs += _run_seeds(comps, grid, seeds, [starts[s] for s in seeds], (m, n), offset)
  if any(r.pop("snapshot_missing") for r in runs):
    raise RuntimeError(f"{method}@{lag_name}: a behaviour snapshot was missing (a bug)")
  record: dict[str, Any] = {"method": method, "lag": lag_name, "schedule": [m, n], "runs": runs}
  if aa:
    record |= {"aa_of": grid.baseline[0], "stream_offset": offset}
  if lag_name in grid.engines:
    record["engine"] = dict(grid.engines[lag_name])
  return record


def _run_seeds(
  comps, grid: Grid, seeds: tuple[int, ...], starts: list, schedule_mn, stream_offset: int = 0
) -> list[dict]:
  """One vmapped run of `seeds` from their warm starts `(base, params)`: per-seed curves.

  The prompts are each seed's; the random streams of the steps and the
  pass@k evaluation are those of seed + `stream_offset`. With adapters the
  seeds share one base (held once, not stacked) and only their adapters and
  states are vmapped.
  """
  fns, run = comps.fns, comps.run
  slots = grid_snapshot_slots(grid)
  state = _stack(
    [
      rl_step.init_state(fns, p, capacity_batches=run.replay_capacity_batches, snapshots=slots)
      for _, p in starts
    ]
  )._replace(base=starts[0][0])
  iters = [pipeline.prompt_iterator(fns, s) for s in seeds]
  streams = tuple(s + stream_offset for s in seeds)
  seeds_a = jnp.asarray(streams, jnp.int32)
  schedule = rl_step.LagSchedule(*(jnp.int32(x) for x in schedule_mn))
  device = fns.reward.device is not None
  ev = dict(batch_size=grid.eval_batch, base=state.base)
  acc0, _ = evaluate(fns, state.train.params, streams, run.eval_prompts, **ev)
  eval_steps, accs, metrics_l, pass_k = [0], [acc0], [], None
  for start in range(0, run.total_steps, run.eval_every):
    prompts = _prompt_chunk(iters, run.eval_every, not device)
    steps = jnp.arange(start + 1, start + run.eval_every + 1, dtype=jnp.int32)
    progs = programs.programs(fns, run.replay, state, over_seeds=True)
    if fns.rollout.traced and device:  # every step one program, scanned and vmapped
      state, out = progs.rl_steps(state, prompts, steps, seeds_a, schedule)
    else:
      state, out = host_step.steps_over_seeds(fns, progs, state, prompts, steps, seeds_a, schedule)
    metrics_l.append(jax.device_get(out))
    end = start + run.eval_every
    k = run.eval_samples if end == run.total_steps else 0
    acc, solved = evaluate(fns, state.train.params, streams, run.eval_prompts, k=k, step=end, **ev)
    eval_steps.append(end)
    accs.append(acc)
    pass_k = solved if solved is not None else pass_k
  out = {key: np.concatenate([o[key] for o in metrics_l], axis=1) for key in metrics_l[0]}
  accs_sl = np.stack(accs, axis=1)
  return [
    {
      "seed": seed,
      "eval_steps": eval_steps,
      "eval_accuracy": accs_sl[i].tolist(),
      "train_reward": out["reward_mean"][i].tolist(),
      "staleness_mean": out["staleness_mean"][i].tolist(),
      "skipped": float(out["skipped"][i].sum()),
      f"pass@{run.eval_samples}": None if pass_k is None else float(pass_k[i]),
      "snapshot_missing": bool(out["snapshot_missing"][i].any()),
      "off_policy": {k: float(np.mean(out[k][i])) for k in OFF_POLICY_METRICS if k in out},
    }
    for i, seed in enumerate(seeds)
  ]


def warm_start(comps: components.Components, seed: int, base_seed: int | None = None):
  """Seed `seed`'s warm start `(base, params)` (shared by every cell through the sft cache).

  Without adapters `base` is None and `params` the whole warm-started model.
  With adapters every seed of a study shares the base of `base_seed` (its
  warm start), and `params` is seed `seed`'s fresh adapter.
  """
  fns, run = comps.fns, comps.run
  base, params = fns.split(fns.init_params(seed))
  kw: dict[str, Any] = dict(
    steps=run.sft_steps,
    batch_size=run.sft_batch_size,
    learning_rate=run.sft_learning_rate,
    distractor=run.sft_distractor,
    log_fn=lambda *_: None,
  )
  if base is None:
    return None, sft.warm_start(fns, params, seed=seed, **kw) if run.sft_enabled else params
  base_seed = seed if base_seed is None else base_seed
  if base_seed != seed:
    base = fns.split(fns.init_params(base_seed))[0]
  if run.sft_enabled:  # any adapter with B = 0 leaves the warm start of the base unchanged
    base = sft.warm_start(fns, base, seed=base_seed, frozen=params, **kw)
  return base, params


def cell_path(path: str, method: str, lag_name: str) -> str:
  return os.path.join(path, CELLS_DIR, f"{method}@{lag_name}.json")


def load_cells(path: str, grid: Grid) -> dict[tuple[str, str], dict]:
  """The finished cells of the grid in `path` (a corrupt cell file raises, naming it)."""
  cells = {}
  for method, lag_name in grid.cells():
    file = cell_path(path, method, lag_name)
    if not os.path.exists(file):
      continue
    try:
      with open(file) as f:
        cell = json.load(f)
      seeds = [r["seed"] for r in cell["runs"]]
      if (cell["method"], cell["lag"]) != (method, lag_name) or seeds != list(grid.seeds):
        raise ValueError(f"holds {cell['method']}@{cell['lag']} seeds {seeds}")
      if method == grid.aa_method and cell.get("stream_offset") != AA_STREAM_OFFSET:
        raise ValueError(f"an A/A cell with stream offset {cell.get('stream_offset')!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise ValueError(f"{file}: unreadable cell record ({e}); delete it to rerun the cell") from e
    cells[method, lag_name] = cell
  return cells


def _write_json(file: str, record: Any) -> None:
  tmp = file + ".tmp"
  with open(tmp, "w") as f:
    json.dump(record, f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, file)


def _check_config(path: str, config: ml_collections.ConfigDict) -> None:
  """Records the study's config, or refuses to resume one started with another config."""
  file = os.path.join(path, CONFIG_FILE)
  cfg = json.loads(config.to_json_best_effort())
  if not os.path.exists(file):
    _write_json(file, cfg)
    return
  with open(file) as f:
    stored = json.load(f)
  changes = workdir.config_changes(stored, cfg, matters=lambda role: role.cell)
  if changes:
    listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())
    raise workdir.ConfigChanged(
      f"{path} holds a study started with another config ({file}): {listed}. "
      "Use a new --workdir or restore the old values."
    )


def run_study(
  config: ml_collections.ConfigDict, path: str, *, log: Callable[[str], None] = print
) -> dict[tuple[str, str], dict]:
  """Runs the cells of `config`'s grid not yet in `path`; returns every cell's record."""
  base, grid = grid_from_config(config)
  os.makedirs(os.path.join(path, CELLS_DIR), exist_ok=True)
  with workdir.lock(path):
    _check_config(path, config)
    cells = load_cells(path, grid)
    todo = [c for c in grid.cells() if c not in cells]
    total, seeds, begin = len(grid.cells()), len(grid.seeds), time.perf_counter()
    log(f"study: {len(cells)}/{total} cells done, {len(todo)} to run ({seeds} seeds each)")
    starts: dict[int, Any] = {}  # every cell of a seed starts from the same parameters
    for i, (method, lag_name) in enumerate(todo, start=1):
      cell_begin = time.perf_counter()
      record = run_cell(base, grid, method, lag_name, starts)
      record["seconds"] = time.perf_counter() - cell_begin
      _write_json(cell_path(path, method, lag_name), record)
      cells[method, lag_name] = record
      elapsed = time.perf_counter() - begin
      eta = elapsed / i * (len(todo) - i)
      log(
        f"[{len(cells)}/{total} cells, {len(cells) * seeds}/{total * seeds} runs] "
        f"{method}@{lag_name}: {elapsed:.0f}s elapsed, ETA {math.ceil(eta / 60)} min"
      )
  return cells
