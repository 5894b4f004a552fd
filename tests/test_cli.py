"""A user's mistakes through the binaries: one line, a non-zero exit, nothing written.

Every case runs the real binary (`python -m experiments.<name>`) and checks
that stderr is exactly one `error: ...` line naming what is wrong, with no
traceback, and that the workdir it names is as it was (absent, or unchanged).
"""

import os
import subprocess
import sys
from concurrent import futures

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from offpolicy_jax import cli, config_schema  # noqa: E402
from offpolicy_jax.store import metrics  # noqa: E402


@pytest.fixture(scope="module")
def places(tmp_path_factory):
  """A recorded run without checkpoints, a plain file, an empty directory."""
  root = tmp_path_factory.mktemp("cli")
  run = root / "run"
  metrics.save_config(str(run), config_schema.config_dict())
  (root / "afile").write_text("not a directory")
  (root / "empty").mkdir()
  (root / "raises.py").write_text('def get_config():\n  raise ValueError("bad thing")\n')
  (root / "nothing.py").write_text("x = 1\n")
  for name, bad in (("typo_sweep", '"totl_steps": 3'), ("loss_sweep", '"loss.name": "grpoo"')):
    (root / f"{name}.py").write_text(SWEEP.format(bad=bad))
  return root


# A sweep whose second run is wrong (`places` fills in how).
SWEEP = """
from offpolicy_jax import config_schema


def get_config():
  return config_schema.config_dict()


def get_sweep():
  return [{{"name": "fine"}}, {{"name": "bad", {bad}}}]
"""


def _listing(path):
  if not os.path.exists(path):
    return None
  if os.path.isfile(path):
    return ("file", os.path.getsize(path))
  return sorted((d, sorted(f)) for d, _, f in os.walk(path))


def _cases(root):
  """(binary, flags, words the error line holds, the path that must stay as it was)."""
  new = str(root / "new")
  run, afile, empty = str(root / "run"), str(root / "afile"), str(root / "empty")
  train = ["train", "--config=configs/default.py"]
  return [
    (
      [*train, f"--workdir={new}", "--config.totl_steps=10"],
      ["--config.totl_steps", "did you mean --config.total_steps"],
      new,
    ),
    (
      [*train, f"--workdir={new}", "--config.loss.nme=grpo"],
      ["--config.loss.nme", "did you mean --config.loss.name"],
      new,
    ),
    ([*train, f"--workdir={new}", "--config.total_steps=-5"], ["config.total_steps", ">= 1"], new),
    (
      [*train, f"--workdir={new}", "--config.total_steps=abc"],
      ["--config.total_steps", "docs/config.md"],
      new,
    ),
    ([*train, f"--workdir={new}", "--config.top_p=0"], ["config.top_p"], new),
    ([*train, f"--workdir={new}", "--config.group_size=1"], ["config.group_size"], new),
    ([*train, f"--workdir={new}", "--config.model=qwen9-77b"], ["config.model", "qwen9-77b"], new),
    (
      [*train, f"--workdir={new}", "--config.loss.name=grpoo"],
      ["config.loss.name", "grpoo", "did you mean 'grpo'?", "docs/losses.md"],
      new,
    ),
    (
      [*train, f"--workdir={new}", "--config.advantage.name=rlo"],
      ["config.advantage.name", "did you mean 'rloo'?"],
      new,
    ),
    (
      [*train, f"--workdir={new}", "--config.optimizr.learning_rate=1e-3"],
      ["--config.optimizr.learning_rate", "did you mean --config.optimizer.learning_rate?"],
      new,
    ),
    ([*train, f"--workdir={new}", "--config.mesh.data=3"], ["config.mesh"], new),
    (["train", "--config=configs/nope.py", f"--workdir={new}"], ["--config", "nope.py"], new),
    ([*train], ["--workdir"], new),
    ([*train, f"--workdir={afile}"], ["--workdir", "is a file"], afile),
    ([*train, f"--workdir={afile}/sub"], ["--workdir", "cannot create"], afile),
    (
      ["eval", f"--workdir={run}"],
      [
        "no checkpoint",
        "train it first",
        f"python -m experiments.train --config=<its config file> --workdir={run}",
      ],
      run,
    ),
    (["eval", f"--workdir={root / 'missing'}"], ["no such directory"], str(root / "missing")),
    (["eval", f"--workdir={empty}"], ["not a run directory"], empty),
    (
      ["eval", f"--workdir={run}", "--config=configs/calculator.py"],
      ["differs from the run", "task: run 'reverse', given 'calculator'"],
      run,
    ),
    (["eval"], ["--workdir", "--config"], run),
    (["export", f"--workdir={run}", f"--out={new}", "--peft"], ["no adapters", "--merged"], run),
    (["export", f"--workdir={run}", f"--out={new}", "--dtype=float7"], ["--dtype float7"], run),
    (["export", f"--workdir={run}", f"--out={new}"], ["nothing to export"], run),
    (["plot", f"--workdirs={root / 'missing'}", f"--out={new}.png"], ["no metrics rows"], empty),
    (
      ["train", f"--config={root / 'raises.py'}", f"--workdir={new}"],
      ["raises.py: the config file raised ValueError: bad thing"],
      new,
    ),
    (
      ["train", f"--config={root / 'nothing.py'}", f"--workdir={new}"],
      ["nothing.py: the file has no get_config()"],
      new,
    ),
    (["sweep", "--config=configs/default.py", f"--workdir={new}"], ["no get_sweep()"], new),
    (
      ["sweep", f"--config={root / 'typo_sweep.py'}", f"--workdir={new}"],
      ["sweep run bad: override 'totl_steps'", "did you mean 'total_steps'?"],
      new,
    ),
    (
      ["sweep", f"--config={root / 'loss_sweep.py'}", f"--workdir={new}", "--print_only"],
      ["sweep run bad: config.loss.name", "did you mean 'grpo'?"],
      new,
    ),
    (
      [
        "study",
        "--config=configs/lag_study.py",
        f"--workdir={new}",
        "--config.study.methods=grpo,fast=grpo;optimizer.learnin_rate=1e-3",
      ],
      [
        "config.study.methods: fast",
        "'optimizer.learnin_rate'",
        "did you mean 'optimizer.learning_rate'?",
      ],
      new,
    ),
    (["study", "--config=configs/default.py", f"--workdir={new}"], ["not a study config"], new),
    (["study", "--config=configs/lag_study.py", f"--workdir={afile}"], ["is a file"], afile),
    (
      ["sweep", "--config=configs/lag_study.py", f"--workdir={new}", "--print_only"]
      + ["--config.loss.name=grpoo"],
      ["--config.loss.name", "the sweep's runs set loss.name themselves", "drop the flag"],
      new,
    ),
    (
      ["sweep", "--config=configs/lag_study.py", f"--workdir={new}", "--print_only", "--hosts=0"],
      ["hosts"],
      new,
    ),
    (["eval", f"--workdir={afile}"], ["is a file"], afile),
    (["export", f"--workdir={run}", f"--out={afile}", "--merged"], ["--out", "is a file"], afile),
    (
      ["export", f"--workdir={run}", f"--out={run}", "--merged"],
      ["--out", "is not empty", "choose an empty or new folder"],
      run,
    ),
  ]


def _run(argv):
  cmd = [sys.executable, "-m", f"experiments.{argv[0]}", *argv[1:]]
  env = {k: v for k, v in os.environ.items() if k != cli.VERBOSE_ENV}
  return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_user_mistakes_end_in_one_line(places):
  cases = _cases(places)
  assert len(cases) >= 15
  before = {path: _listing(path) for _, _, path in cases}
  with futures.ThreadPoolExecutor(2) as pool:
    results = list(pool.map(_run, [argv for argv, _, _ in cases]))
  for (argv, words, path), out in zip(cases, results, strict=True):
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    what = f"{argv}: {out.stderr[-2000:]}"
    assert out.returncode == cli.USAGE_EXIT, what
    assert len(lines) == 1 and lines[0].startswith("error: "), what
    assert "Traceback" not in out.stderr + out.stdout, what
    for w in words:
      assert w in lines[0], what
    assert _listing(path) == before[path], what
  assert not os.path.exists(places / "new.png")


def test_help_names_the_config_reference_and_the_main_fields():
  out = _run(["train", "--help"])
  assert out.returncode in (0, 1), out.stderr  # absl's --help exits 1
  assert "Traceback" not in out.stderr + out.stdout
  for words in (
    "docs/config.md",
    "--config.FIELD=VALUE",
    *(f"--config.{f}:" for f in cli.HELP_FIELDS),
  ):
    assert words in out.stdout, words
  schema_doc = config_schema.field("total_steps").doc
  assert schema_doc.split(" (")[0] in out.stdout  # the field's doc, from the schema


def test_the_binaries_and_their_configs_work_from_outside_the_repo(tmp_path):
  """Once installed, `python -m experiments.*` and `--config=configs/...` work from anywhere."""
  env = {k: v for k, v in os.environ.items() if k not in (cli.VERBOSE_ENV, "PYTHONPATH")}
  train = [sys.executable, "-m", "experiments.train", "--config=configs/default.py"]
  cmd = [*train, f"--workdir={tmp_path / 'run'}", "--config.totl_steps=5"]
  out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  # The module and the config file were found: the one error is the misspelt field's.
  assert out.stderr.strip() == (
    "error: --config.totl_steps: no such config field (did you mean --config.total_steps? "
    "docs/config.md describes every field)"
  ), out.stderr[-2000:]
  assert not os.path.exists(tmp_path / "run")


def test_verbose_shows_the_traceback(places):
  out = _run(["eval", f"--workdir={places / 'empty'}", "--verbose"])
  assert out.returncode != 0
  assert "Traceback" in out.stderr and "WorkdirError" in out.stderr


SECOND_SIGNAL = """
import os, signal, time
from offpolicy_jax.run import stopping

with stopping.Stop() as stop:
  os.kill(os.getpid(), signal.SIGTERM)
  assert stop.signum == signal.SIGTERM and stop.agreed() == signal.SIGTERM
  print("still running after the first signal", flush=True)
  os.kill(os.getpid(), signal.SIGTERM)
  time.sleep(30)
print("not reached")
"""


def test_a_second_signal_stops_at_once():
  out = subprocess.run(
    [sys.executable, "-c", SECOND_SIGNAL], cwd=REPO, capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 128 + 15, out.stderr
  assert out.stdout.splitlines() == ["still running after the first signal"]
  assert "SIGTERM again: stopping now, without saving" in out.stderr
