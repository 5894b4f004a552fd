"""Confinement of a verifier worker process: resource limits, Landlock, seccomp.

`apply(limits)` turns the calling process into a sandbox for code that may act
on model output (third-party verifiers, the code task's programs). It is
called once, at the start of each verifier worker (`verifiers.VerifierPool`),
after the worker's imports and before it receives any model output, and in
each worker's program template (`isolation`, with `processes=True`: it may fork
the processes that run programs, which `confine_program` then confines further).

What is applied (Linux; every item is checked and reported by `apply`):

- rlimits: address space `memory_mb`; file size 0; no core files; 256 open files.
- capabilities: all dropped (a worker of a root trainer loses root's powers).
- no_new_privs: set (required by Landlock and seccomp).
- Landlock fs: reads only from the allow-list `read_paths()` (the Python
  installation, importable code on `sys.path` such as this package, the
  system's shared libraries and a few device and loader files); nothing else
  can be read or listed (not the workdir, the repository's data, home
  directories or `/proc`); only `/dev/null` writable.
- Landlock net (ABI >= 4): no TCP bind or connect.
- Landlock scope (ABI >= 6): no signals to, or abstract sockets of, processes
  outside the sandbox.
- seccomp: no new processes (but in a program template, whose children
  add a filter that forbids them again) or exec (threads are allowed), no
  sockets of any family (nor connect/bind/listen/accept), no signals to other
  processes, no ptrace, mount, namespaces, kernel modules, BPF, io_uring,
  chmod/chown, setuid.
- descriptors: every inherited descriptor but stdio (on /dev/null) and the
  worker's two pipes to the trainer is closed (`worker` does this).

CPU time is limited per call by `set_cpu_limit` (SIGXCPU kills the worker),
and the pool's wall-clock timeout kills a worker whatever it runs.

`strict=True` (the default) fails closed: if Landlock or seccomp cannot be
applied (an old kernel, macOS, a missing libseccomp), `apply` raises
`SandboxError` and the worker never scores anything. `strict=False` applies
what the platform offers (at least the rlimits) and returns the list of what
is missing, which the pool logs as a warning.
"""

import ctypes
import errno
import functools
import os
import resource
import signal
import struct
import sys
import sysconfig
from typing import NamedTuple


class SandboxError(RuntimeError):
  """The sandbox could not be applied (and `strict` asked to fail closed)."""


class Limits(NamedTuple):
  """Resource limits of one verifier worker.

  Attributes:
    memory_mb: address-space limit (RLIMIT_AS) in MiB; allocations beyond it
      raise MemoryError inside the worker.
    open_files: RLIMIT_NOFILE.
  """

  memory_mb: int = 2048
  open_files: int = 256


# Landlock (include/uapi/linux/landlock.h). The syscall numbers are the same on
# every architecture (they were added after the syscall tables were unified).
_LL_CREATE_RULESET, _LL_ADD_RULE, _LL_RESTRICT_SELF = 444, 445, 446
_LL_CREATE_RULESET_VERSION = 1
_LL_RULE_PATH_BENEATH = 1
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1, 2, 4, 8
_FS_IOCTL_DEV = 1 << 15
# Rights handled (denied unless allowed by a rule) per Landlock ABI version.
_FS_HANDLED = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1, 2
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4

# Syscalls a verifier never needs and that could reach beyond the worker.
_DENIED_SYSCALLS = (
  "fork", "vfork", "execve", "execveat", "ptrace", "process_vm_readv", "process_vm_writev",
  "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "bpf", "perf_event_open",
  "keyctl", "add_key", "request_key", "init_module", "finit_module", "delete_module",
  "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "io_uring_setup",
  "io_uring_enter", "io_uring_register", "userfaultfd", "open_by_handle_at",
  "name_to_handle_at", "acct", "quotactl", "syslog", "settimeofday", "clock_settime",
  "sethostname", "setdomainname", "tkill", "pidfd_open", "pidfd_send_signal", "pidfd_getfd",
  "process_madvise", "kcmp", "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown",
  "lchown", "fchownat", "utime", "utimes", "utimensat", "futimesat", "setxattr", "lsetxattr",
  "fsetxattr", "removexattr", "lremovexattr", "fremovexattr", "setuid", "setgid", "setreuid",
  "setregid", "setresuid", "setresgid", "setgroups", "setfsuid", "setfsgid", "capset",
  # No new sockets of any family (UNIX path sockets reach local daemons), no
  # connecting or serving: a worker talks to the trainer over inherited pipes only.
  "socket", "connect", "bind", "listen", "accept", "accept4",
)  # fmt: skip
# Syscalls a program template may use to fork and kill its own children.
_PROCESS_SYSCALLS = ("fork", "vfork", "tkill", "pidfd_open", "pidfd_send_signal")
_CLONE_THREAD = 0x00010000
_PR_SET_PDEATHSIG = 1
# System locations any process reads (shared libraries, the loader's cache, time zone,
# random bytes); the Python installation and this package are added by `read_paths`.
_SYSTEM_READS = (
  "/lib", "/lib64", "/usr/lib", "/usr/lib64", "/etc/ld.so.cache", "/etc/localtime",
  "/usr/share/zoneinfo", "/dev/urandom", "/dev/random",
)  # fmt: skip


@functools.cache
def _libc() -> ctypes.CDLL:
  libc = ctypes.CDLL(None, use_errno=True)
  libc.syscall.restype = ctypes.c_long
  return libc


def _check(ret: int, what: str) -> int:
  if ret < 0:
    e = ctypes.get_errno()
    raise OSError(e, f"{what}: {os.strerror(e)}")
  return ret


def landlock_abi() -> int:
  """The kernel's Landlock ABI version (0 when Landlock is unavailable)."""
  if not sys.platform.startswith("linux"):
    return 0
  ret = _libc().syscall(_LL_CREATE_RULESET, None, ctypes.c_size_t(0), _LL_CREATE_RULESET_VERSION)
  return max(int(ret), 0)


def _apply_rlimits(limits: Limits, processes: bool = False) -> None:
  mem = limits.memory_mb * 2**20
  resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
  resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
  resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
  if os.getuid() != 0 and not processes:  # root is exempt from RLIMIT_NPROC; seccomp covers it
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
  # A write past RLIMIT_FSIZE raises OSError(EFBIG) instead of killing the worker.
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def set_cpu_limit(seconds: float) -> None:
  """Lets the calling process use `seconds` more CPU time, then SIGXCPU kills it."""
  used = resource.getrusage(resource.RUSAGE_SELF)
  total = used.ru_utime + used.ru_stime + max(seconds, 1.0)
  _, hard = resource.getrlimit(resource.RLIMIT_CPU)
  soft = int(total) + 1
  if hard != resource.RLIM_INFINITY:
    soft = min(soft, hard)
  resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _drop_capabilities(libc: ctypes.CDLL) -> None:
  """capset(2) with empty effective/permitted/inheritable sets, ambient cleared."""
  header = struct.pack("=Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
  data = bytes(24)  # two zeroed __user_cap_data_struct
  _check(libc.capset(header, data), "capset")
  libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)


def read_paths() -> list[str]:
  """The read allow-list of a sandboxed process (existing paths only).

  The Python installation (`sysconfig`'s stdlib and site-packages directories
  and the interpreter's library directory); importable code on `sys.path`
  (this package, and where a reward's own module lives): each regular package
  (a directory with `__init__.py`) and each top-level `.py` module, never the
  directory around them (a repository's data, docs, the workdir); and
  `_SYSTEM_READS`. A verifier reaches its example as data on its pipe, never
  as a file.
  """
  py = {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
  py.add(sysconfig.get_config_var("LIBDIR") or "")
  package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  paths = {os.path.realpath(p) for p in (*py, package, *_SYSTEM_READS) if p}
  for entry in {os.path.realpath(p or os.curdir) for p in sys.path}:
    if os.path.isdir(entry) and not any(entry.startswith(p + os.sep) or entry == p for p in py):
      paths.update(_importable(entry))
  return sorted(p for p in paths if os.path.exists(p))


def _importable(entry: str) -> list[str]:
  """The regular packages and top-level modules in a `sys.path` directory."""
  out = []
  for name in os.listdir(entry):
    path = os.path.join(entry, name)
    if name.endswith((".py", ".so")) and os.path.isfile(path):
      out.append(path)
    elif os.path.isfile(os.path.join(path, "__init__.py")):
      out.append(path)
  return out


def _add_rule(libc: ctypes.CDLL, ruleset: int, path: str, allowed: int) -> None:
  fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
  try:
    rule = ctypes.create_string_buffer(struct.pack("=Qi", allowed, fd), 12)
    _check(libc.syscall(_LL_ADD_RULE, ruleset, _LL_RULE_PATH_BENEATH, rule, 0), path)
  finally:
    os.close(fd)


def _apply_landlock(libc: ctypes.CDLL, abi: int) -> list[str]:
  """Reads from `read_paths()` only, no TCP, scoped signals (as far as `abi` allows).

  Written against the three Landlock syscalls with ctypes: the kernel ABI is
  small and stable, and the Python binding on PyPI is a development pre-release.
  """
  fs = _FS_HANDLED[max(v for v in _FS_HANDLED if v <= abi)]
  attr, missing = struct.pack("=Q", fs), []
  if abi >= 4:
    attr += struct.pack("=Q", _NET_BIND_TCP | _NET_CONNECT_TCP)
  else:
    missing.append("landlock-net (ABI < 4; seccomp still blocks sockets)")
  if abi >= 6:
    attr += struct.pack("=Q", _SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL)
  else:
    missing.append("landlock-scope (ABI < 6; seccomp still blocks signals)")
  buf = ctypes.create_string_buffer(attr, len(attr))
  ruleset = _check(
    libc.syscall(_LL_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)), 0), "landlock_create_ruleset"
  )
  try:
    # Directories take the directory right too; a rule on a file may name file rights only.
    read_file = _FS_READ_FILE | _FS_EXECUTE | (_FS_IOCTL_DEV if abi >= 5 else 0)
    for path in read_paths():
      _add_rule(libc, ruleset, path, read_file | (_FS_READ_DIR if os.path.isdir(path) else 0))
    _add_rule(libc, ruleset, "/dev/null", _FS_READ_FILE | _FS_WRITE_FILE)
    _check(libc.syscall(_LL_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
  finally:
    os.close(ruleset)
  return missing


def _deny(f, sc, names) -> None:
  for name in names:
    try:
      f.add_rule(sc.ERRNO(errno.EPERM), name)
    except (ValueError, RuntimeError, OSError):  # not a syscall on this architecture
      pass


def _deny_processes(f, sc) -> None:
  """No new processes (threads are allowed), no signals to other processes."""
  _deny(f, sc, _PROCESS_SYSCALLS)
  f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # glibc falls back to clone, checked below
  f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
  pid = os.getpid()
  f.add_rule(sc.ERRNO(errno.EPERM), "kill", sc.Arg(0, sc.NE, pid))
  f.add_rule(sc.ERRNO(errno.EPERM), "tgkill", sc.Arg(0, sc.NE, pid))


def _apply_seccomp(processes: bool = False) -> None:
  """A deny-list filter: process creation (unless `processes`), sockets, exec, kernel admin."""
  import pyseccomp as sc  # ctypes binding to libseccomp, which writes the BPF per architecture

  f = sc.SyscallFilter(sc.ALLOW)
  _deny(f, sc, [n for n in _DENIED_SYSCALLS if n not in _PROCESS_SYSCALLS])
  if not processes:
    _deny_processes(f, sc)
  f.load()


def program_filter():
  """The seccomp filter `confine_program` adds: no new processes, no signals at all.

  Built once by the program template (None without libseccomp), loaded by
  each child: compiling it per child would cost more than the fork.
  """
  try:
    import pyseccomp as sc
  except ImportError:
    return None
  f = sc.SyscallFilter(sc.ALLOW)
  _deny(f, sc, (*_PROCESS_SYSCALLS, "kill", "tgkill"))
  f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
  f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
  return f


def confine_program(seccomp_filter) -> None:
  """Confines a process forked by a program template before it runs a program.

  Adds `program_filter()` (built by the caller) on top of the template's
  seccomp filter; Landlock and the rest are inherited (they cannot be
  lifted). The caller sets its CPU limit (`set_cpu_limit`) and its
  parent-death signal (`die_with_parent`).
  """
  if os.getuid() != 0:
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
  if seccomp_filter is not None:
    seccomp_filter.load()


def die_with_parent(parent: int) -> None:
  """SIGKILLs the calling process when its parent dies; exits now if it already has."""
  _check(_libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
  if os.getppid() != parent:
    os._exit(1)


def apply(limits: Limits | None = None, strict: bool = True, processes: bool = False) -> list[str]:
  """Confines the calling process for good (see the module docstring).

  Args:
    limits: resource limits.
    strict: raise `SandboxError` unless Landlock and seccomp are both applied.
    processes: let the process fork and signal its children (a program
      template, whose children call `confine_program`).

  Returns:
    The layers that could not be applied (empty when fully sandboxed).

  Raises:
    SandboxError: `strict` and a layer is unavailable or failed.
  """
  _apply_rlimits(limits or Limits(), processes)
  missing: list[str] = []
  if not sys.platform.startswith("linux"):
    missing += ["capabilities", "landlock", "seccomp (not Linux: resource limits only)"]
  else:
    libc = _libc()
    try:
      _drop_capabilities(libc)
    except OSError as e:
      missing.append(f"capabilities ({e})")
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    try:  # loading libseccomp may search the file system, so before Landlock
      import pyseccomp  # noqa: F401
    except ImportError:
      pass  # reported below
    abi = landlock_abi()
    if abi < 1:
      missing.append("landlock (not supported by this kernel)")
    else:
      try:
        missing += _apply_landlock(libc, abi)
      except OSError as e:
        missing.append(f"landlock ({e})")
    try:
      _apply_seccomp(processes)
    except (ImportError, OSError, RuntimeError, ValueError) as e:
      missing.append(f"seccomp ({type(e).__name__}: {e})")
  essential = [m for m in missing if m.split(" ")[0] in ("landlock", "seccomp")]
  if strict and essential:
    raise SandboxError(
      "verifier sandbox unavailable: " + "; ".join(essential) + ". Verifiers are not run "
      "unconfined; set config.reward_sandbox='warn' to run them with what this platform offers."
    )
  return missing
