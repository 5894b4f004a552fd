"""Tests for offpolicy_jax.workdir: the workdir lock and the checked config record."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import default  # noqa: E402
from offpolicy_jax.store import metrics, workdir  # noqa: E402

_HOLD = textwrap.dedent(
  """
  import sys, time
  from offpolicy_jax.store import workdir
  with workdir.lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
  """
)


def test_a_second_holder_is_refused_naming_the_workdir_and_holder(tmp_path):
  holder = subprocess.Popen(
    [sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
  )
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(workdir.WorkdirLocked, match=f"{tmp_path}.*pid {holder.pid}"):
      with workdir.lock(str(tmp_path)):
        pass
  finally:
    holder.kill()  # SIGKILL: the holder record stays behind, the OS lock does not
    holder.wait()


def test_a_killed_holders_lock_is_taken_over_with_a_message(tmp_path, capsys):
  holder = subprocess.Popen(
    [sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
  )
  assert holder.stdout.readline().strip() == "held"
  holder.kill()
  holder.wait()
  with workdir.lock(str(tmp_path)):
    assert json.load(open(tmp_path / workdir.HOLDER_FILE))["pid"] == os.getpid()
  assert f"taking over the stale lock of pid {holder.pid}" in capsys.readouterr().out
  assert not (tmp_path / workdir.HOLDER_FILE).exists()  # a clean exit leaves no record
  with workdir.lock(str(tmp_path)):  # and the next holder finds nothing stale
    pass
  assert "stale" not in capsys.readouterr().out


def _record(path, config):
  metrics.save_config(str(path), config)


def test_config_changes_are_refused_or_recorded(tmp_path):
  old = {
    "seed": 0,
    "loss": {"name": "grpo", "eps_low": None},
    "total_steps": 10,
    "mesh": {"data": 1},
  }
  _record(tmp_path, old)
  same_meaning = {**old, "total_steps": 50, "mesh": {"data": 2}}
  workdir.check_config(str(tmp_path), same_meaning, step=5)  # run-control fields may change
  new = {**old, "loss": {"name": "rec_oneside_nois", "eps_low": 0.2}}
  with pytest.raises(workdir.ConfigChanged) as e:
    workdir.check_config(str(tmp_path), new, step=5)
  msg = str(e.value)
  assert "loss.name: 'grpo' -> 'rec_oneside_nois'" in msg and "loss.eps_low: None -> 0.2" in msg
  assert "--allow_config_change" in msg and not (tmp_path / workdir.HISTORY_FILE).exists()
  workdir.check_config(str(tmp_path), new, step=5, allow_change=True)
  (entry,) = [json.loads(line) for line in open(tmp_path / workdir.HISTORY_FILE)]
  assert entry["step"] == 5 and entry["changes"]["loss.name"] == ["grpo", "rec_oneside_nois"]


def test_missing_or_corrupt_config_record_names_the_file(tmp_path):
  with pytest.raises(ValueError, match="config.json: missing"):
    workdir.check_config(str(tmp_path), {"seed": 0}, step=3)
  (tmp_path / "config.json").write_text('{"seed": 0,')
  with pytest.raises(ValueError, match="config.json: invalid JSON.*--allow_config_change"):
    workdir.check_config(str(tmp_path), {"seed": 0}, step=3)
  workdir.check_config(str(tmp_path), {"seed": 0}, step=3, allow_change=True)
  assert (tmp_path / "config.json.corrupt").read_text() == '{"seed": 0,'
  (entry,) = [json.loads(line) for line in open(tmp_path / workdir.HISTORY_FILE)]
  assert entry["changes"] == {"seed": ["<absent>", 0]}


def test_the_schema_roles_decide_what_a_resume_may_change(tmp_path):
  old = default.base_config().to_dict()
  old["optimizer"]["micro_batches"] = 1  # recorded before the knob was retired, at its no-op value
  del old["model_remat"]  # recorded before this field (placement: may change) was added
  _record(tmp_path, old)
  control = default.base_config()
  control.total_steps, control.eval_every, control.checkpoint_every = 5, 1, 1
  control.mesh.data, control.reward_workers, control.reward_timeout = -1, 3, 1.0
  workdir.check_config(str(tmp_path), control, step=2)
  for field, value in (("seed", 1), ("lag.sync_interval", 1), ("loss.name", "grpo")):
    changed = default.base_config()
    changed.update_from_flattened_dict({field: value})
    with pytest.raises(workdir.ConfigChanged, match=field):
      workdir.check_config(str(tmp_path), changed, step=2)
  remat = default.base_config()
  remat.model_remat = True
  workdir.check_config(str(tmp_path), remat, step=2)
  old["optimizer"]["micro_batches"] = 4  # a retired field that meant something else
  _record(tmp_path, old)
  with pytest.raises(workdir.ConfigChanged, match="optimizer.micro_batches: 4 -> '<absent>'"):
    workdir.check_config(str(tmp_path), default.base_config(), step=2)


def test_parameter_shape_fields_never_change_on_resume(tmp_path):
  """A change the checkpoint's shapes follow is refused even with allow_change, naming it."""
  old = {"seed": 0, "model": "tiny", "lora": {"rank": 8, "alpha": 32.0}}
  (tmp_path / "config.json").write_text(json.dumps(old))
  new = {**old, "lora": {"rank": 4, "alpha": 32.0}}
  with pytest.raises(workdir.ConfigChanged, match="lora.rank: 8 -> 4") as e:
    workdir.check_config(str(tmp_path), new, step=5, allow_change=True)
  assert "--allow_config_change" not in str(e.value)
  assert not (tmp_path / workdir.HISTORY_FILE).exists()


def test_a_field_added_since_the_run_began_is_no_change_at_its_default():
  """A run recorded before `critic.estimator` existed resumes under its default; set to
  anything else it is a change."""
  config = default.base_config().to_dict()
  stored = json.loads(json.dumps(config, default=str))
  del stored["critic"]["estimator"]
  assert workdir.config_changes(stored, config) == {}
  config["critic"]["estimator"] = "gae"
  assert set(workdir.config_changes(stored, config)) == {"critic.estimator"}


def test_adding_or_removing_a_critic_is_refused_even_when_changes_are_allowed(tmp_path):
  """The value head is in the checkpointed parameters: no resume can add or drop it."""
  plain = default.base_config().to_dict()
  _record(tmp_path, plain)
  critic = default.base_config()
  critic.loss.name = "ppo_critic"
  with pytest.raises(workdir.ConfigChanged, match="shapes follow critic.estimator"):
    workdir.check_config(str(tmp_path), critic, step=2, allow_change=True)
  _record(tmp_path, critic.to_dict())
  off = default.base_config()
  off.loss.name, off.critic.estimator = "ppo_critic", "none"
  with pytest.raises(workdir.ConfigChanged, match="shapes follow critic.estimator"):
    workdir.check_config(str(tmp_path), off, step=2, allow_change=True)
  same = default.base_config()  # '' -> 'gae' under ppo_critic: the same head
  same.loss.name, same.critic.estimator = "ppo_critic", "gae"
  workdir.check_config(str(tmp_path), same, step=2, allow_change=True)
