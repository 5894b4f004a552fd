"""Routing replay (`rollout.routing_replay`): the sampler records experts, the learner replays them.

The log-prob contract holds with replay (the learner at the sampler's
parameters reproduces mu), the agreement metric sees routing that differs by
construction, and a replaying run resumes exactly from its checkpoints.
"""

import itertools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offpolicy_jax import models, types  # noqa: E402
from offpolicy_jax.learn import scorer  # noqa: E402
from offpolicy_jax.run import components_rollout, loop  # noqa: E402
from offpolicy_jax.sampling import sampler as sampling  # noqa: E402
from tests.test_loop import full_and_resumed, small_config  # noqa: E402

N, K = 8, 3
PROMPTS = np.array([[0, 0, 0, 5, 6, 7], [11, 12, 13, 14, 15, 16]], np.int32)
LENGTHS = np.array([3, 6], np.int32)


@pytest.fixture(scope="module")
def moe(numpy_init):
  return numpy_init(models.get_config("tiny-moe"), scale=4.0)


def _batch(out) -> types.TrainBatch:
  zeros_b = jnp.zeros(out.tokens.shape[0])
  versions = jnp.zeros(out.tokens.shape, jnp.int32)
  return types.pack_groups(
    PROMPTS, LENGTHS, out.tokens, out.mask, out.logprobs, versions, zeros_b, zeros_b, out.kept,
    None, out.prompt_experts, out.experts,
  )  # fmt: skip


def _score(graphdef, params, batch, temperature, truncated, top_k, shared, replay):
  return scorer.token_logprobs(
    graphdef, params, batch, temperature, K if shared else 0, truncated=truncated, top_k=top_k,
    full=True, replay=replay,
  )[:3]  # fmt: skip


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.8, 5)])
def test_the_sampler_records_experts_and_replay_reproduces_mu(moe, temperature, top_p, top_k):
  graphdef, params = moe
  c = models.get_config("tiny-moe")
  sampler = sampling.make_sampler(
    graphdef, max_new_tokens=N, group_size=K, temperature=temperature, top_p=top_p,
    top_k=top_k, eos_id=3, record_routing=True,
  )  # fmt: skip
  out = sampler(params, PROMPTS, LENGTHS, jax.random.key(1))
  assert out.prompt_experts.shape == (2, PROMPTS.shape[1], c.num_layers, c.num_experts_per_tok)
  assert out.experts.shape == (2 * K, N, c.num_layers, c.num_experts_per_tok)
  assert out.experts.dtype == jnp.uint8
  batch = _batch(out)
  mask = np.asarray(out.mask) > 0
  truncated = top_p < 1.0 or top_k > 0
  for shared, replay in itertools.product((False, True), (False, True)):
    logp, _, stats = _score(graphdef, params, batch, temperature, truncated, top_k, shared, replay)
    np.testing.assert_allclose(np.asarray(logp)[mask], np.asarray(out.logprobs)[mask], atol=1e-5)
    # At the sampler's parameters the learner's own routing is the recorded one.
    np.testing.assert_array_equal(stats.agreement(), 1.0)
  plain = sampling.make_sampler(graphdef, max_new_tokens=N, group_size=K, eos_id=3)
  assert plain(params, PROMPTS, LENGTHS, jax.random.key(1)).experts is None


def test_agreement_sees_routing_that_differs_and_replay_follows_the_record(moe):
  graphdef, params = moe
  sampler = sampling.make_sampler(
    graphdef, max_new_tokens=N, group_size=K, eos_id=3, record_routing=True
  )
  out = sampler(params, PROMPTS, LENGTHS, jax.random.key(2))
  batch = _batch(out)
  # A learner whose routers are negated ranks the experts in reverse: with k = 2
  # of E = 4, its own top-2 never meets the recorded one.
  flipped = jax.tree_util.tree_map_with_path(
    lambda path, x: -x if "router" in jax.tree_util.keystr(path) else x, params
  )
  own, _, stats = _score(graphdef, flipped, batch, 1.0, False, 0, False, False)
  np.testing.assert_array_equal(stats.agreement(), 0.0)
  replayed, _, stats_r = _score(graphdef, flipped, batch, 1.0, False, 0, False, True)
  np.testing.assert_array_equal(stats_r.agreement(), 0.0)  # agreement reads the own top-k
  mask = np.asarray(out.mask) > 0
  assert np.abs(np.asarray(replayed - own)[mask]).max() > 1e-3


def test_replay_is_refused_where_nothing_records_routing():
  dense = models.get_config("tiny")
  with pytest.raises(
    ValueError, match="rollout.routing_replay='replay': model 'tiny' has no experts"
  ):
    components_rollout.check_routing_replay(
      small_config(**{"rollout.routing_replay": "replay"}), dense
    )
  moe_config = models.get_config("tiny-moe")
  for field, value in (("rollout.partial_budget", 2), ("rollout.continuous_slots", 2)):
    with pytest.raises(
      ValueError, match=f"rollout.routing_replay='record': the sampler of {field}"
    ):
      cfg = small_config(model="tiny-moe", **{"rollout.routing_replay": "record", field: value})
      components_rollout.check_routing_replay(cfg, moe_config)


def test_a_replaying_run_resumes_exactly_and_reports_agreement(tmp_path):
  kw = {"model": "tiny-moe", "rollout.routing_replay": "replay", "lag.sync_interval": 3}
  want, got = full_and_resumed(tmp_path, **kw)
  assert got == want
  assert want[0]["moe/router_agreement"] == 1.0  # on-policy: the learner's routing is mu's
  assert all(0.0 <= r["moe/router_agreement"] <= 1.0 for r in want)
  assert all(r["moe/aux_loss"] > 0 for r in want)


def test_a_mixture_of_experts_on_an_8_device_mesh_matches_one_device(tmp_path):
  common = {
    "model": "tiny-moe",
    "rollout.routing_replay": "replay",
    "total_steps": 3,
    "eval_prompts": 0,
    "sft.enabled": False,
    "task_kwargs.partial_credit": True,
  }
  one = loop.train_and_evaluate(small_config(**common), str(tmp_path / "one"))
  mesh = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}
  eight = loop.train_and_evaluate(small_config(**common, **mesh), str(tmp_path / "eight"))
  assert jax.device_count() == 8
  assert any(r["grad_norm"] > 0 for r in one)
  for a, b in zip(one, eight, strict=True):
    for k in ("reward_mean", "loss", "grad_norm", "moe/aux_loss", "moe/router_agreement"):
      assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k


def test_run_means_keeps_one_row_per_run(tmp_path, capsys):
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
  import run_means

  for name, values in (("record-s0", (0.5, 0.7)), ("replay-s1", (0.2, 0.4))):
    rows = [{"step": 0, "eval/accuracy": 0.25}]
    rows += [{"step": i + 1, "mismatch_kl_k3": v} for i, v in enumerate(values)]
    rows += [{"step": 2, "eval/accuracy": 0.75}]
    (tmp_path / name).mkdir()
    (tmp_path / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
  got = run_means.main(["--workdirs", str(tmp_path / "*-s*"), "--keys", "mismatch_kl_k3"])
  assert [(r["group"], r["seed"], r["steps"]) for r in got] == [("record", 0, 2), ("replay", 1, 2)]
  assert got[0]["mismatch_kl_k3"] == pytest.approx(0.6) and got[1]["final_accuracy"] == 0.75
  assert capsys.readouterr().out.splitlines()[0].startswith("group,seed,steps,mismatch_kl_k3")
  (tmp_path / "stray").mkdir()
  with pytest.raises(SystemExit):
    run_means.main(["--workdirs", str(tmp_path / "*"), "--keys", "x"])


def test_the_expert_fields_are_part_of_what_compiles():
  """The train step and the sampler read them: a run that changes them gets its own programs."""
  from offpolicy_jax.run import components

  base = small_config(model="tiny-moe")
  for field, value in (("rollout.routing_replay", "replay"), ("model_router_aux_coef", 0.5)):
    assert components.compile_key(base) != components.compile_key(
      small_config(model="tiny-moe", **{field: value})
    ), field


def test_a_resume_cannot_switch_recording_on_or_off(tmp_path):
  """Recording changes the replay buffer's layout: refused even with --allow_config_change."""
  from offpolicy_jax.store import metrics, workdir

  cfg = small_config(model="tiny-moe", **{"rollout.routing_replay": "record"})
  (tmp_path / metrics.CONFIG_FILE).write_text(json.dumps(cfg.to_dict()))
  for mode, refused in (("off", True), ("replay", False)):
    new = small_config(model="tiny-moe", **{"rollout.routing_replay": mode})
    if refused:
      with pytest.raises(workdir.ConfigChanged, match="replay buffer.*rollout.routing_replay"):
        workdir.check_config(str(tmp_path), new, step=3, allow_change=True)
    else:
      workdir.check_config(str(tmp_path), new, step=3, allow_change=True)
