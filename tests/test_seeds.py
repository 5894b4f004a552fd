"""`step.seeds.Seeds`: one run's trees pass through untouched, the study's carry a seed axis."""

import jax
import numpy as np

from offpolicy_jax.step import rows
from offpolicy_jax.step.seeds import Seeds


def test_one_run_has_no_seed_axis_and_the_study_has_a_leading_one():
  one, many = Seeds.one(7), Seeds.many(np.array([3, 5, 9]))
  assert one == Seeds((7,), False) and many == Seeds((3, 5, 9), True)
  tree = {"a": np.arange(6).reshape(3, 2), "b": None}
  assert one.take(tree, 0) is tree and one.stack([tree]) is tree
  assert np.array_equal(many.take(tree, 1)["a"], [2, 3]) and many.take(tree, 1)["b"] is None
  back = many.stack([many.take(tree, s) for s in range(3)])
  assert np.array_equal(back["a"], tree["a"]) and back["b"] is None


def test_scalars_rows_and_steps():
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  step, seed = Seeds.one(7).scalars(mesh, 4)
  assert (int(step), int(seed)) == (4, 7) and seed.sharding.is_fully_replicated
  step, seeds = Seeds.many([3, 5]).scalars(mesh, 4)
  assert int(step) == 4 and seeds.tolist() == [3, 5]
  # A step's row: one run's as it is; each seed's values stacked per metric.
  assert Seeds.one(7).row([{"x": 1.0}]) == {"x": 1.0}
  assert Seeds.many([3, 5]).row([{"x": 1.0}, {"x": 2.0}])["x"].tolist() == [1.0, 2.0]
  # A scan's metrics: [n] for one run, [S, n] for the study (each step's [S]).
  assert Seeds.one(7).step_of({"x": np.array([1.0, 2.0])}, 1) == {"x": 2.0}
  many = Seeds.many([3, 5]).step_of({"x": np.array([[1.0, 2.0], [3.0, 4.0]])}, 1)
  assert many["x"].tolist() == [2.0, 4.0]
  # n steps' prompt batches: [n, ...] for one run, [S, n, ...] for the study's [S, ...] ones.
  batches = [{"p": np.zeros((2, 4))}, {"p": np.ones((2, 4))}]
  assert Seeds.one(7).stack_steps(batches, ["p"])["p"].shape == (2, 2, 4)
  stacked = Seeds.many([3, 5]).stack_steps(batches, ["p"])["p"]
  assert stacked.shape == (2, 2, 4) and stacked[:, 1].sum() == 8 and stacked[:, 0].sum() == 0


def test_a_step_row_is_put_together_in_one_place():
  device, host = {"loss": np.float32(0.5)}, [{"reward_failures": np.int64(1)}]
  row = rows.step_row(
    Seeds.one(7), device, host, fields={"prompts_truncated": 2}, times={"sample_s": 0.25}
  )
  assert row == {"loss": 0.5, "reward_failures": 1, "prompts_truncated": 2, "time/sample_s": 0.25}
  assert type(row["loss"]) is float and type(row["reward_failures"]) is int  # JSON-ready
  # Stacked seeds: each per-seed metric [S]; shared fields and times stay scalars.
  device = {"loss": np.array([0.5, 1.5], np.float32)}
  host = [{"reward_failures": 1}, {"reward_failures": 3}]
  row = rows.step_row(Seeds.many([3, 5]), device, host, fields={"f": 1}, times={"train_s": 2.0})
  assert row["loss"].tolist() == [0.5, 1.5] and row["reward_failures"].tolist() == [1, 3]
  assert row["f"] == 1 and row["time/train_s"] == 2.0
