"""One cell of the study (method, lag): every seed's run under one `jax.vmap`.

The run states of the seeds are stacked on a leading axis and the loop's
driver (`step.drivers`, over `Seeds.many`) advances them together: one jitted
`vmap(rl_step.rl_steps)` per chunk, or the host step with vmapped halves where
a step leaves the device. It evaluates every
`config.eval_every` steps with a vmapped greedy sampler on
`config.eval_prompts` held-out prompts. Runs with the same seed share the warm
start (`sft.warm_start`, computed once per seed) and the prompt stream, so they
are paired (`study.stats`). The lag schedule is a traced argument and every
cell has the same number of snapshot slots (`grid.grid_snapshot_slots`), so
the lags of one method share one compiled program.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from offpolicy_jax import metric_names
from offpolicy_jax.rollout import prompt_rows
from offpolicy_jax.run import components, evaluation
from offpolicy_jax.step import costs, drivers, run_state
from offpolicy_jax.step.seeds import Seeds
from offpolicy_jax.study import sweeps
from offpolicy_jax.study.grid import AA_STREAM_OFFSET, Grid, grid_snapshot_slots
from offpolicy_jax.study.warm_starts import Starts


def study_means(out: dict[str, np.ndarray], i: int) -> dict[str, float]:
  """Seed `i`'s mean over its steps of each metric declared for the study
  (`metric_names.study_metrics`) that the rows hold: its record's `off_policy`."""
  return {k: float(np.mean(out[k][i])) for k in metric_names.study_metrics() if k in out}


def _costs(out: dict[str, np.ndarray], i: int, train_s: float, seeds: int) -> dict[str, float]:
  """Seed `i`'s cost totals (`step.costs`): tokens sampled and trained, and seconds.

  The S seeds of one vmapped program share its seconds: `train_wall_s` is
  their share, the program's training seconds / S (`seeds_per_program`).
  """
  spent = costs.of_row({k: float(np.sum(v[i])) for k, v in out.items()})  # the loop's sums
  return {
    "sampled_tokens": spent.sampled_tokens,
    "sampled_prompt_tokens": spent.sampled_prompt_tokens,
    "trained_tokens": spent.trained_tokens,
    "train_wall_s": train_s / seeds,
    "seeds_per_program": float(seeds),
  }


def _at_evals(per_step: np.ndarray, eval_steps: list[int]) -> list[float]:
  """The running total of a per-step count at each evaluated step (0 at step 0)."""
  total = np.concatenate([[0.0], np.cumsum(np.asarray(per_step, np.float64))])
  return [float(total[s]) for s in eval_steps]


def _stack(trees: list) -> Any:
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def evaluate(
  fns: run_state.StepFns,
  params,
  seeds: tuple[int, ...],
  num_prompts: int,
  *,
  k: int = 0,
  step: int = 0,
  batch_size: int = 0,
  base=None,
  split: str = "eval",
):
  """Greedy accuracy [S], pass@k [S] (k >= 2, else None), reward failures [S] and the
  samples' mean reward [S] (k >= 2, else None) of `params`.

  `params` are seed-stacked (over `base`). A failure is a response whose
  sandboxed reward timed out, raised or crashed (scored 0): a host reward
  under load can turn a correct answer into a failure, so a cell records them.

  The run's evaluator (`evaluation.evaluate_seeds`) on the first `num_prompts`
  held-out prompts (or of `split`), `batch_size` at a time (0: all at once),
  pass@k sampled with each seed's EVAL key of `step`.
  """
  keys = jax.vmap(lambda s: run_state.step_key(s, step, run_state.EVAL))(jnp.asarray(seeds))
  ev = evaluation.evaluate_seeds(
    fns,
    params,
    keys,
    num_prompts,
    k,
    seeds=Seeds.many(seeds),
    batch_size=batch_size or num_prompts,
    base=base,
    split=split,
  )
  return ev["accuracy"], ev.get(f"pass@{k}"), ev["reward_failures"], ev.get("sample_reward")


def _read(iters: list, host_fields: bool, n: int, state) -> tuple[list[dict], list[dict]]:
  """The next n steps' prompts, each [S, ...] (a batch from each seed's iterator), and how
  many prompts of each step were truncated (`drivers.Read`; every prompt read is sampled)."""
  del state
  fields = prompt_rows.DEVICE_FIELDS + (("index", "valid") if host_fields else ())
  steps, rows = [], []
  for _ in range(n):
    batches = [next(it) for it in iters]
    steps.append({k: np.stack([b[k] for b in batches]) for k in fields})
    rows.append({"prompts_truncated": sum(prompt_rows.truncated(b) for b in batches)})
  return steps, rows


def _driver(comps, iters: list, streams: tuple[int, ...], schedule_mn) -> drivers.Driver:
  """The loop's driver (`step.drivers`) over the seeds side by side, in sync mode."""
  return drivers.make(
    comps.fns,
    lag_mode="sync",
    replay=comps.replay,
    read=functools.partial(_read, iters, comps.fns.reward.device is None),
    seeds=Seeds.many(streams),
    sync=schedule_mn,
    may_prefetch=_never,
  )


def _never(step: int) -> bool:
  """No step samples ahead of the previous one's learning in a study (`drivers.make`)."""
  del step
  return False


def run_cell(
  base: ml_collections.ConfigDict,
  grid: Grid,
  method: str,
  lag_name: str,
  starts: Starts | None = None,
) -> dict[str, Any]:
  """Runs every seed of one cell; returns its record (curves per seed, JSON-ready).

  Seeds run `grid.vmap_seeds` at a time under one `vmap` (0: all at once).
  `starts` gives each seed's warm start, computed once per study (`Starts`; a
  fresh one, kept in memory only, when None).
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
  starts = Starts() if starts is None else starts
  start_of = {s: starts.get(comps, s, base_seed=grid.seeds[0]) for s in grid.seeds}
  size = grid.vmap_seeds or len(grid.seeds)
  runs = []
  for lo in range(0, len(grid.seeds), size):
    seeds = grid.seeds[lo : lo + size]
    runs += _run_seeds(comps, grid, seeds, [start_of[s] for s in seeds], (m, n), offset)
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
      run_state.init_state(fns, p, capacity_batches=comps.replay_capacity_batches, snapshots=slots)
      for _, p in starts
    ]
  )._replace(base=starts[0][0])
  iters = [fns.prompts(s) for s in seeds]
  streams = tuple(s + stream_offset for s in seeds)
  ev = dict(batch_size=grid.eval_batch, base=state.base)
  acc0, _, eval_fails, _ = evaluate(fns, state.train.params, streams, run.eval_prompts, **ev)
  eval_steps, accs, pass_k = [0], [acc0], None
  step_rows: list[dict[str, Any]] = []  # the driver's metrics rows, each metric [S]
  ope_fn = evaluation.ope_program(fns, grid.ope, Seeds.many(streams)) if grid.ope else None
  ope_l: list[dict] = []  # each evaluation's estimates [S] and the truth they estimate
  train_s_at = [0.0]  # the program's training seconds at each evaluation
  driver = _driver(comps, iters, streams, schedule_mn)
  train_s = 0.0  # the training steps' seconds, evaluations excluded (compilation included)
  for start in range(0, run.total_steps, run.eval_every):
    begin = time.perf_counter()
    step, end = start, start + run.eval_every
    while step < end:  # one scan of the chunk, or one host step at a time
      state, rows = driver.steps(state, step, min(driver.max_chunk, end - step))
      step_rows += rows
      step += len(rows)
    train_s += time.perf_counter() - begin
    k = run.eval_samples if end == run.total_steps else 0
    acc, solved, fails, _ = evaluate(
      fns, state.train.params, streams, run.eval_prompts, k=k, step=end, **ev
    )
    if ope_fn is not None:  # the truth: fresh samples on prompts of the buffer's split
      with jax.set_mesh(fns.model.mesh):
        est = jax.device_get(ope_fn(state))
      at = dict(k=run.eval_samples, step=end, split="train", **ev)
      truth = evaluate(fns, state.train.params, streams, run.eval_prompts, **at)[3]
      ope_l.append({**est, "truth": truth})
    eval_fails = eval_fails + fails
    eval_steps.append(end)
    train_s_at.append(train_s)
    accs.append(acc)
    pass_k = solved if solved is not None else pass_k
  # Each seed's metrics [S, steps]; the rows' per-step scalars (timings) are the loop's.
  out = {
    k: np.stack([r[k] for r in step_rows], axis=1)
    for k, v in step_rows[0].items()
    if np.ndim(v) == 1
  }
  accs_sl = np.stack(accs, axis=1)
  ope = {key: np.stack([o[key] for o in ope_l], axis=1) for key in ope_l[0]} if ope_l else {}
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
      # Off-policy estimates at evaluations 1, 2, ... (`config.study.ope`) and their truth.
      **({"ope": {key: v[i].tolist() for key, v in ope.items()}} if ope else {}),
      "off_policy": study_means(out, i),
      "costs": _costs(out, i, train_s, len(seeds)),
      # Running totals at each evaluation (time- and tokens-to-accuracy).
      "eval_sampled_tokens": _at_evals(out["sampled_tokens"][i], eval_steps),
      "eval_train_wall_s": [t / len(seeds) for t in train_s_at],
      # Sandboxed rewards that failed (scored 0) in evaluations and in training.
      "reward_failures": {
        "eval_reward_failures": float(eval_fails[i]),
        "train_reward_failures": float(out["reward_failures"][i].sum())
        if "reward_failures" in out
        else 0.0,
      },
    }
    for i, seed in enumerate(seeds)
  ]
