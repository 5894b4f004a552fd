"""The study's grid: methods x lag schedules x seeds, parsed from `config.study`.

`grid_from_config` checks the config and returns the base run config and the
`Grid`: methods (loss and advantage overrides), lags (m, n) with their
engine-mismatch settings (`ENGINES`), seeds, and the A/A lags.

A/A calibration: for every lag of `config.study.aa_lags` the baseline method
runs a second time as the cell `aa-<method>@<lag>`, from the same warm starts
on the same prompts, with every other random stream (sampling, advantages,
replay, training) drawn from seed + `AA_STREAM_OFFSET` instead of seed. The
two runs differ only by chance, so `study.report` counts how often its tests
call them different (`study.stats`).
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_collections

from offpolicy_jax import config_schema, errors, lag
from offpolicy_jax.config_spec import RunSpec, StudySpec
from offpolicy_jax.run import critic_settings, validation
from offpolicy_jax.study import sweeps

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
  # Off-policy estimators run on the replay buffers at every evaluation (`config.study.ope`).
  ope: tuple[str, ...] = ()

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
    if ";" in name:
      raise ValueError(f"config.study.{field}: {item!r}: name it first, name=value;field=...")
    if not name.isidentifier() and not name.replace("-", "_").isidentifier():
      raise ValueError(f"config.study.{field}: {name!r} is not a name (letters, digits, _ and -)")
    pairs.append((name, value or name))
  if not pairs:
    raise ValueError(f"config.study.{field} is empty")
  names = [n for n, _ in pairs]
  if len(set(names)) != len(names):
    raise ValueError(f"config.study.{field}: duplicate names in {names}")
  return pairs


# Fields a method entry may set besides its loss and advantage: how the RL phase learns.
# Not the warm start, the task, the model, the lag or the evaluation, which every cell of
# a seed shares (the runs are paired).
METHOD_FIELDS = ("optimizer.", "loss.", "advantage.", "replay.", "rollout.", "train.")


def _literal(text: str) -> Any:
  """A method field's value: a Python literal (3e-4, 2, True) or else the text itself."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def parse_methods(spec: str) -> dict[str, dict[str, Any]]:
  """Methods as overrides: `name=loss[+advantage][;field=value...]`, comma-separated.

  `"grpo,red_drop=reinforce+red_drop,reinforce_lr1e3=reinforce;optimizer.learning_rate=1e-3"`
  -> {name: {"loss.name": ..., "advantage.name": ..., field: value}}; the
  fields must start with one of `METHOD_FIELDS`.
  """
  out = {}
  for name, value in _parse_pairs("methods", spec):
    head, *fields = value.split(";")
    loss, _, adv = head.partition("+")
    out[name] = {"loss.name": loss} | ({"advantage.name": adv} if adv else {})
    for item in fields:
      field, eq, text = item.partition("=")
      if not eq:
        raise ValueError(f"config.study.methods: {name}: {item!r} is not field=value")
      if not field.startswith(METHOD_FIELDS):
        raise ValueError(
          f"config.study.methods: {name}: {field} cannot differ between methods: a method "
          f"sets fields of {', '.join(p + '*' for p in METHOD_FIELDS)} (what the RL phase "
          "does; the warm start, task, model, lag and evaluation are shared by a seed's cells)"
        )
      out[name][field] = _literal(text)
  return out


# Engine-mismatch settings a lag entry can carry ("bf16_onpolicy=1/0+bf16"): the
# sampler's numerics or truncation differ from the learner's at the same
# parameters (docs/off_policyness.md). `rollout.score_old` reports both factors.
ENGINES: dict[str, dict[str, Any]] = {
  "bf16": {"rollout.sampler_dtype": "bfloat16", "rollout.score_old": True},
  "topk5": {"top_k": 5, "rollout.behavior_logp": "mismatched", "rollout.score_old": True},
  "topp8": {"top_p": 0.8, "rollout.behavior_logp": "mismatched", "rollout.score_old": True},
}


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
    if pair[0] > total_steps or pair[1] >= total_steps:  # every batch from the warm start
      raise ValueError(
        f"config.study.lags: {name}={value!r} reaches no step past the warm start's data in "
        f"total_steps={total_steps} (write '{name}=offline', or lengthen the run)"
      )
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
  st = StudySpec.from_config(config)
  base = ml_collections.ConfigDict({k: v for k, v in config.items() if k != "study"})
  run = RunSpec.from_config(base)
  if run.eval_every < 1 or run.total_steps % run.eval_every:
    raise ValueError(
      f"config.eval_every: {run.eval_every} must be >= 1 and divide total_steps {run.total_steps}"
    )
  if not st.eval_last <= run.total_steps // run.eval_every:
    raise ValueError(
      f"config.study.eval_last: {st.eval_last} evaluations, the run has "
      f"{run.total_steps // run.eval_every}"
    )
  if run.lag.mode != "sync":
    raise ValueError("config.lag.mode: a study simulates lag exactly; it must be 'sync'")
  _check_prompt_pool(base)
  if run.mesh.sampler_devices:
    raise ValueError(
      "config.mesh.sampler_devices: a study runs every seed's step as one program on one "
      "mesh; it must be 0"
    )
  validation.validate_config(base)  # a bad shared value is named as itself, not as a method's
  _check_cell_config(base)
  methods = parse_methods(st.methods)
  for name, overrides in methods.items():
    if name.startswith(AA_PREFIX):
      raise ValueError(
        f"config.study.methods: {name!r}: names starting with {AA_PREFIX!r} are the A/A twins"
      )
    with errors.about(f"config.study.methods: {name}"):  # keeps a suggested field name
      method_config = sweeps.apply_overrides(base, overrides)
      validation.validate_config(method_config)  # values and how the fields fit together
      _check_cell_config(method_config)
  lags = parse_lags(st.lags, run.total_steps)
  engines = parse_engines(st.lags)
  for lag_name, engine in engines.items():  # a lag's engine would silently overwrite them
    for name, overrides in methods.items():
      if both := sorted(set(engine) & set(overrides)):
        raise ValueError(
          f"config.study.methods: {name} sets {', '.join(both)}, which the engine of lag "
          f"{lag_name!r} sets too (study.grid.ENGINES); set it in one place"
        )
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
    engines,
    parse_aa_lags(st.aa_lags, lags),
    _ope(st.ope, run, base, methods),
  )
  return base, grid


def _ope(spec: str, run: RunSpec, base, methods) -> tuple[str, ...]:
  """The estimators of `config.study.ope`; refused where a cell could not run them."""
  names = tuple(n.strip() for n in spec.split(",") if n.strip())
  if names and run.eval_samples < 2:
    raise ValueError(
      f"config.study.ope: the truth the estimates are compared with is the mean reward of "
      f"eval_samples samples per prompt; eval_samples is {run.eval_samples}, needs >= 2"
    )
  if {"dr", "wdr"} & set(names):
    for name, overrides in methods.items():
      if not critic_settings.estimator(sweeps.apply_overrides(base, overrides)):
        raise ValueError(
          f"config.study.ope: dr and wdr read a critic's values; method {name!r} has none"
        )
  return names


def _check_cell_config(config: ml_collections.ConfigDict) -> None:
  """What every cell's config (the base, or a method's) must allow for seeds run together."""
  spec = RunSpec.from_config(config)
  if spec.multiturn.max_turns and spec.rollout.partial_budget:
    raise ValueError(
      "config.rollout.partial_budget: a study plays every seed's episodes to their end within "
      "the step; episodes in flight across steps (rollout.episode_pool) run in single runs only"
    )
  if spec.rollout.continuous_auto_steps:
    raise ValueError(
      "config.rollout.continuous_auto_steps: a study runs one sampler for every seed and "
      "cell; it must be 0 (choose with rollout.continuous_slots)"
    )
  _check_prompt_pool(config)


def _check_prompt_pool(config: ml_collections.ConfigDict) -> None:
  if config.critic.prompt_pool > 1:
    raise ValueError(
      "config.critic.prompt_pool: a study's seeds read the same prompts side by side; the "
      "choice of prompts by their values runs in single runs only (1 here)"
    )


def grid_snapshot_slots(grid: Grid) -> int:
  """Snapshot slots enough for every lag of the grid (one state shape for all)."""
  return max(lag.snapshot_capacity(m, n) for m, n in grid.lags.values())
