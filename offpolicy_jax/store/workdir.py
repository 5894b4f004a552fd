"""A run's directory: one writer at a time, and a config record that resumes are checked against.

  with workdir.lock(path):                          # a second run refuses at once
    workdir.check_config(path, config, resuming=True, allow_change=False, step=40)

- **Lock.** `lock(path)` takes an exclusive `filelock` lock on `path/.lock`
  (an OS-level lock: the kernel releases it when its holder dies, however it
  dies). Who holds it (host, pid, start time, command) is written beside it in
  `path/.lock.json`, so a second run fails at once with `WorkdirLocked` naming
  the workdir and the holder, and a run that finds the record of a holder that
  no longer holds the lock (killed) says that it takes the stale lock over.
- **Config record.** On resume, the fields that change what a run means (loss,
  advantage, lag, model, task, shapes, seed, optimizer, replay, ...: every
  field whose `config_schema` role is kept on resume; not the run control of
  length, evaluation, checkpoints, logging, reward workers and mesh) are
  compared with the run's `config.json`. A change is refused
  (`ConfigChanged`, listing the fields) unless `allow_change`, in which case
  it is appended, with the step it takes effect at, to `config_history.jsonl`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import filelock

from offpolicy_jax import config_fields, config_schema, errors, files, losses
from offpolicy_jax.store import metrics

LOCK_FILE = ".lock"
HOLDER_FILE = ".lock.json"
HISTORY_FILE = metrics.CONFIG_HISTORY_FILE
# Fields the checkpointed parameters' shapes follow: a resume is refused on a change
# of them even with --allow_config_change (the checkpoint could not be restored).
PARAMETER_SHAPE_FIELDS = ("model", "lora.rank", "lora.targets")
ABSENT = "<absent>"
# Fields whose None picks a value from the model (`model_scan_layers`: stacked from 0.4B
# parameters): None against a value is no change here; the checkpoints are read in either
# layout (`run.relayout`).
UNSET_PICKS = ("model_scan_layers",)
# Fields that say only how a checkpoint's numbers are stored: an evaluation may choose them
# freely (the checkpoint is read in either layout, `run.relayout`).
LAYOUT_FIELDS = ("model_scan_layers",)


class WorkdirLocked(errors.UserError, RuntimeError):
  """Another live run holds the workdir."""


class ConfigChanged(errors.UserError, ValueError):
  """A resume's config differs from the run's record in fields that change its meaning.

  `changes` lists them (`field: old -> new; ...`), so that a caller with its own remedy
  (a sweep, whose runs take no `--allow_config_change`) can word the error itself.
  """

  def __init__(self, message: str, changes: str = ""):
    super().__init__(message)
    self.changes = changes


def _holder_record() -> dict[str, Any]:
  return {
    "host": socket.gethostname(),
    "pid": os.getpid(),
    "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    "command": " ".join(sys.argv)[:500],
  }


def _read_json(path: str) -> Any:
  try:
    return files.read_json_object(path)
  except FileNotFoundError:
    return None


def _describe(holder: Any) -> str:
  if not isinstance(holder, dict):
    return "an unknown process"
  return f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('started')}"


def refuse_file(path: str, hint: str) -> None:
  """Raises `WorkdirError` if `path` exists and is not a directory."""
  if os.path.exists(path) and not os.path.isdir(path):
    raise errors.WorkdirError(f"--workdir {path} is a file", hint)


def create(path: str) -> bool:
  """Makes the workdir `path` if it is missing; returns whether this call made it.

  Raises:
    WorkdirError: `path` is a file, or cannot be created or written.
  """
  refuse_file(path, "give a directory")
  existed = os.path.isdir(path)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise errors.WorkdirError(
      f"--workdir {path}: cannot create it ({e.strerror})", "give a writable directory"
    ) from None
  if not os.access(path, os.W_OK | os.X_OK):
    raise errors.WorkdirError(f"--workdir {path} is not writable", "give a writable directory")
  return not existed


def remove_created(path: str) -> None:
  """Removes a workdir `create` made, after a refused start (it holds no run's data)."""
  shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def lock(path: str) -> Iterator[None]:
  """Holds `path` exclusively for the duration of the block.

  Raises:
    WorkdirLocked: another live process holds it (the message names the
      workdir and the holder).
  """
  os.makedirs(path, exist_ok=True)
  holder_path = os.path.join(path, HOLDER_FILE)
  file_lock = filelock.FileLock(os.path.join(path, LOCK_FILE))
  try:
    file_lock.acquire(timeout=0)
  except filelock.Timeout:
    try:
      holder = _read_json(holder_path)
    except ValueError:
      holder = None
    raise WorkdirLocked(
      f"workdir {path} is in use by another run ({_describe(holder)}); wait for it to "
      "finish, stop it, or choose another --workdir."
    ) from None
  try:
    try:
      stale = _read_json(holder_path)
    except ValueError:
      stale = None
    if stale is not None:
      print(f"workdir {path}: taking over the stale lock of {_describe(stale)}", flush=True)
    with open(holder_path, "w") as f:
      json.dump(_holder_record(), f)
    yield
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.remove(holder_path)
    file_lock.release()


def _normalise(value: Any) -> Any:
  """The JSON form `metrics.save_config` stores, so stored and live values compare."""
  return json.loads(json.dumps(value, default=str))


def config_changes(
  stored: Mapping[str, Any],
  config: Mapping[str, Any],
  *,
  matters: Callable[[config_fields.Role], bool] = lambda role: role.kept,
) -> dict[str, tuple]:
  """`{field: (stored, new)}` for the fields that differ (added or removed ones too).

  Args:
    stored: the recorded config (JSON form).
    config: the new config (a dict).
    matters: which roles count (default: the fields a resume must keep); an
      undeclared field always counts. A retired field at its retired value
      (`config_schema.RETIRED`) is no change, nor is a field added to the
      schema after `stored` (a record, not an empty one) was written that
      holds its default (a default keeps what the code did before the field
      existed).
  """
  old, new = config_schema.flatten(stored), config_schema.flatten(_normalise(dict(config)))
  changes = {}
  for field in sorted(set(old) | set(new)):
    if not matters(config_schema.role_of(field)):
      continue
    a, b = old.get(field, ABSENT), new.get(field, ABSENT)
    if b == ABSENT and field in config_schema.RETIRED and a == config_schema.RETIRED[field]:
      continue
    declared = config_schema.field(field)
    added = bool(old) and a == ABSENT and declared is not None and declared.name == field
    if added and declared is not None and b == declared.default:
      continue
    if field in UNSET_PICKS and None in (a, b):  # the checkpoint's own record decides
      continue
    if a != b:
      changes[field] = (a, b)
  return changes


def describe_changes(changes: dict[str, tuple[Any, Any]]) -> str:
  """`field: old -> new; ...`, the listing every ConfigChanged gives."""
  return "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())


def _has_critic(cfg: Mapping[str, Any]) -> bool:
  """Whether a run config trains a critic (`run.critic_settings.estimator`), so that its
  parameters hold a value head; False for a record without one or an unknown loss."""
  chosen = (cfg.get("critic") or {}).get("estimator", "")
  try:
    chosen = chosen or losses.default_critic((cfg.get("loss") or {}).get("name", ""))
  except ValueError:  # a loss registered in another process: no preset critic
    pass
  return chosen not in ("", "none")


def check_config(path: str, config: Any, *, step: int, allow_change: bool = False) -> None:
  """Compares a resume's `config` with the run's `config.json`.

  Args:
    path: the workdir.
    config: the resume's config (a ConfigDict or a dict).
    step: the step the run resumes from (recorded with an allowed change).
    allow_change: accept changed meaning fields, recording them in
      `config_history.jsonl`.

  Raises:
    ConfigChanged: meaning fields differ and `allow_change` is False.
    ValueError: `config.json` is missing or corrupt (naming the file).
  """
  record = os.path.join(path, metrics.CONFIG_FILE)
  cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  try:
    stored = _read_json(record)
  except ValueError as e:
    if not allow_change:
      raise ValueError(
        f"{e} Pass --allow_config_change to resume with the current config."
      ) from None
    os.replace(record, record + ".corrupt")
    print(f"{record} was corrupt: kept as {record}.corrupt", flush=True)
    stored = None
  if not isinstance(stored, dict):
    if not allow_change:
      raise ValueError(
        f"{record}: missing, so the config this run started with cannot be checked; pass "
        "--allow_config_change to resume with the current config."
      )
    stored = {}
  changes = config_changes(stored, cfg)
  if not changes:
    return
  listed = describe_changes(changes)
  fixed = [k for k in changes if k in PARAMETER_SHAPE_FIELDS]
  if "rollout.routing_replay" in changes and "off" in changes["rollout.routing_replay"]:
    fixed.append("rollout.routing_replay")  # its replay buffer holds the experts, or not
  if _has_critic(stored) != _has_critic(cfg):  # the parameters hold a value head, or not
    fixed.append("critic.estimator")
  if fixed:
    raise ConfigChanged(
      f"workdir {path} holds checkpoints whose parameter (or replay buffer) shapes follow "
      f"{', '.join(fixed)}: {listed}. No resume can change them; use a new --workdir "
      "or restore the old values.",
      listed,
    )
  if not allow_change:
    raise ConfigChanged(
      f"workdir {path} holds a run started with another config ({record}): {listed}. "
      "Use a new --workdir, restore the old values, or pass --allow_config_change to "
      f"resume with the change (recorded in {HISTORY_FILE}).",
      listed,
    )
  entry = {"step": int(step), "time": time.strftime("%Y-%m-%d %H:%M:%S"), "changes": changes}
  with open(os.path.join(path, HISTORY_FILE), "a") as f:
    f.write(json.dumps(entry, default=str) + "\n")
    f.flush()
    os.fsync(f.fileno())
  print(f"workdir {path}: resuming at step {step} with a changed config: {listed}", flush=True)


def require_run(path: str) -> None:
  """Refuses a path that is not a run's directory (missing, or without `config.json`).

  Raises:
    errors.WorkdirError: naming the path and what it lacks.
  """
  refuse_file(path, "give a run's workdir")
  if not os.path.isdir(path):
    raise errors.WorkdirError(f"--workdir {path}: no such directory", "give a run's workdir")
  if not os.path.isfile(os.path.join(path, metrics.CONFIG_FILE)):
    raise errors.WorkdirError(
      f"--workdir {path}: not a run directory (no {metrics.CONFIG_FILE})",
      "give the --workdir a train run wrote",
    )


def recorded_config(workdir: str) -> Any:
  """The config a run in `workdir` last ran with: `config.json` plus its recorded changes.

  Raises:
    errors.WorkdirError: `workdir` is missing or has no `config.json` (not a run
      directory), or `config.json` / `config_history.jsonl` is not readable JSON.
  """
  path = os.path.join(workdir, metrics.CONFIG_FILE)
  require_run(workdir)
  config = config_schema.config_dict()
  try:
    flat = config_schema.flatten(files.read_json_object(path))
  except ValueError as e:
    raise errors.WorkdirError(str(e)) from None
  history = os.path.join(workdir, metrics.CONFIG_HISTORY_FILE)
  if os.path.isfile(history):
    with open(history) as f:
      for i, line in enumerate(f):
        try:
          changes = json.loads(line)["changes"]
        except (ValueError, KeyError, TypeError) as e:
          raise errors.WorkdirError(
            f"{history}: line {i + 1} is not a recorded change ({e})"
          ) from None
        flat.update({k: new for k, (_, new) in changes.items()})
  for name, value in flat.items():
    *parents, leaf = name.split(".")
    node = config
    for p in parents:
      node = node[p]
    node[leaf] = value
  return config


_IDENTITY = ("task", "task_kwargs", "model", "loss")


def eval_config(config: Any, workdir: str) -> Any:
  """The config to evaluate a run's checkpoint with: the run's own, or `config` if it agrees.

  `config` may change how evaluation runs (eval prompts, samples, mesh: the
  run-control fields; the layout of the decoder blocks, `LAYOUT_FIELDS`), not what
  the run is: a different task, model, loss or
  any other field a resume must keep is refused by name, since scoring a
  checkpoint on another task's prompts gives a number that means nothing.

  Raises:
    errors.WorkdirError: `workdir` is not a run directory.
    errors.ConfigError: `config` differs from the run's record in such fields.
  """
  recorded = recorded_config(workdir)
  if config is None:
    return recorded
  changes = config_changes(recorded.to_dict(), config.to_dict())
  changes = {k: v for k, v in changes.items() if k not in LAYOUT_FIELDS}
  if changes:
    # What a run is about first: a task, model or loss change explains the rest.
    names = sorted(changes, key=lambda k: (k.split(".")[0] not in _IDENTITY, k))
    shown = "; ".join(f"{k}: run {changes[k][0]!r}, given {changes[k][1]!r}" for k in names[:4])
    more = f" and {len(changes) - 4} more" if len(changes) > 4 else ""
    raise errors.ConfigError(
      f"--config differs from the run in {workdir} ({shown}{more})",
      "omit --config to evaluate with the run's own config",
    )
  return config
