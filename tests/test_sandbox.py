"""Tests for offpolicy_jax.sandbox, through the verifier workers it confines.

Each hostile verifier returns 1.0 only if its attack worked; a confined worker
makes it raise (or be killed), so every attack must score 0 and fail.
"""

import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from offpolicy_jax.rewards import sandbox, verifiers
from offpolicy_jax.rewards import scoring as rewards


def _attack(example, text):
  path = example["path"]
  if text == "write":
    with open(os.path.join(path, "pwned"), "w") as f:
      f.write("x")
  elif text == "remove":
    os.remove(os.path.join(path, "keep"))
  elif text == "chmod":
    os.chmod(os.path.join(path, "keep"), 0o777)
  elif text == "fork":
    if os.fork() == 0:
      os._exit(0)
  elif text == "subprocess":
    subprocess.run(["touch", os.path.join(path, "pwned")], check=True)
  elif text == "system":
    if os.system(f"touch {os.path.join(path, 'pwned')}") != 0:
      raise OSError("system failed")
  elif text == "tcp":
    socket.create_connection(("127.0.0.1", example["port"]), timeout=2).close()
  elif text == "unix":
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(example["unix_path"])
    s.sendall(b"exfiltrated")
  elif text == "udp":
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", example["port"]))
  elif text == "signal":
    os.kill(example["trainer_pid"], signal.SIGCONT)  # harmless if it got through
  elif text == "memory":
    bytearray(100 * 2**30)
  elif text == "read":  # outside the read allow-list
    with open(os.path.join(path, "keep")) as f:
      f.read()
  elif text == "read_allowed":  # the Python installation
    with open(os.__file__) as f:
      return float(len(f.read()) > 0)
  elif text == "fds":  # descriptors beyond stdio
    return float(sum(_is_open(fd) for fd in range(3, 256)))
  else:
    raise ValueError(text)
  return 1.0


def _is_open(fd):
  try:
    os.fstat(fd)
    return True
  except OSError:
    return False


ATTACKS = (
  "read",
  "write",
  "remove",
  "chmod",
  "fork",
  "subprocess",
  "system",
  "tcp",
  "udp",
  "unix",
  "signal",
  "memory",
)


@pytest.fixture(scope="module")
def pool():
  p = verifiers.VerifierPool(2, memory_mb=1024)
  yield p
  p.close()


def test_landlock_is_available_here():
  # The CI machines run Linux >= 5.13; strict mode depends on it.
  assert sandbox.landlock_abi() >= 1


def test_every_attack_is_contained(pool, tmp_path):
  (tmp_path / "keep").write_text("data")
  mode = (tmp_path / "keep").stat().st_mode
  server = socket.create_server(("127.0.0.1", 0))
  server.settimeout(0.5)
  port = server.getsockname()[1]
  unix_path = str(tmp_path / "daemon.sock")
  unix_server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  unix_server.bind(unix_path)
  unix_server.listen()
  unix_server.settimeout(0.5)
  ex = {"path": str(tmp_path), "port": port, "trainer_pid": os.getpid(), "unix_path": unix_path}
  texts = [*ATTACKS, "read_allowed", "fds"]
  res = rewards.score_batch(_attack, [ex] * len(texts), texts, timeout_s=10.0, pool=pool)
  failed = dict(zip(texts, res.failed.tolist(), strict=True))
  assert all(failed[a] for a in ATTACKS), failed
  # Reading the allow-list works; a worker holds no descriptor past stdio but its 2
  # pipes to the trainer and its socket to its program template.
  np.testing.assert_array_equal(res.scores, [0.0] * len(ATTACKS) + [1.0, 3.0])
  with pytest.raises(TimeoutError):
    unix_server.accept()
  unix_server.close()
  assert sorted(os.listdir(tmp_path)) == ["daemon.sock", "keep"]
  assert (tmp_path / "keep").read_text() == "data" and (tmp_path / "keep").stat().st_mode == mode
  with pytest.raises(TimeoutError):
    server.accept()
  server.close()


_FAIL_CLOSED = """
from offpolicy_jax.rewards import sandbox
sandbox.landlock_abi = lambda: 0  # a kernel without Landlock
try:
  sandbox.apply(strict=True)
  print("APPLIED")
except sandbox.SandboxError as e:
  print("REFUSED", e)
print("MISSING", sandbox.apply(strict=False))
"""


def test_strict_mode_fails_closed_and_warn_mode_reports_what_is_missing():
  # In a throwaway process: apply() confines its caller for good.
  out = subprocess.run(
    [sys.executable, "-c", _FAIL_CLOSED], capture_output=True, text=True, timeout=120, check=True
  ).stdout
  assert "REFUSED verifier sandbox unavailable: landlock" in out and "APPLIED" not in out
  missing = out.split("MISSING", 1)[1]
  assert "'landlock (not supported by this kernel)'" in missing and "seccomp" not in missing
