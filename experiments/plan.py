r"""Prints the per-device memory plan of a config on a device mesh, and whether it fits.

  python -m experiments.plan --config=configs/gsm8k_qwen25_1p5b.py --devices=v5e-8
  python -m experiments.plan --config=configs/default.py --devices=8 --memory_gib=16 \
      [--config.mesh.fsdp=2 --config.model=small ...]

--devices is <type>-<count> (types: v4, v5e, v5p, v6e, a100-40, a100-80,
h100-80, cpu) or a bare count with --memory_gib. Nothing is allocated: see
offpolicy_jax/run/planner.py for what is counted and how.

With --timeline=DIR it also predicts a step's wall clock in each layout (sync or
async, shared or own sampler devices) from the per-phase costs of the run in DIR
(a split or async run; offpolicy_jax/timeline.py lists the assumptions), with
--sampler_factor / --learner_factor for other device counts per side:

  python -m experiments.plan --config=configs/calculator.py:latency --devices=8 \
      --memory_gib=16 --timeline=/tmp/opj_calc_latency
"""

import math
import os

from absl import app, flags, logging
from ml_collections import config_flags

from offpolicy_jax import cli, timeline
from offpolicy_jax.run import planner
from offpolicy_jax.store import metrics_files

_CONFIG = config_flags.DEFINE_config_file("config", None, cli.config_help(), lock_config=True)
_DEVICES = flags.DEFINE_string("devices", None, "<type>-<count> (e.g. v5e-8) or a device count.")
_MEMORY_GIB = flags.DEFINE_float(
  "memory_gib", None, "Memory per device in GiB (default: the device type's)."
)
_ACTIVATIONS = flags.DEFINE_enum(
  "activations",
  "auto",
  ["auto", "compiled", "analytic"],
  "Train-step temporaries: compiled on this machine (auto: when the mesh fits here and the "
  "platform matches) or the analytic estimate.",
)
_TIMELINE = flags.DEFINE_string(
  "timeline", None, "A run's workdir: predict a step's wall clock per layout from its rows."
)
_SAMPLER_FACTOR = flags.DEFINE_float(
  "sampler_factor", 1.0, "--timeline: the sampler's devices relative to the measured run's."
)
_LEARNER_FACTOR = flags.DEFINE_float(
  "learner_factor", 1.0, "--timeline: the learner's devices relative to the measured run's."
)
flags.mark_flags_as_required(["config", "devices"])


def parse_devices(text: str, known) -> tuple[str | None, int]:
  """`"v5e-8"` -> `("v5e", 8)`; `"8"` -> `(None, 8)`; ValueError naming `devices` otherwise."""
  if text.isdigit() and int(text) >= 1:
    return None, int(text)
  name, _, count = text.rpartition("-")
  if name not in known or not count.isdigit() or int(count) < 1:
    raise ValueError(f"devices: {text!r} is not <type>-<count> or <count>; types: {list(known)}")
  return name, int(count)


def format_plan(result) -> str:
  """The plan as a table (component, per-device MiB, total MiB over the mesh) and a verdict."""
  n, mib = math.prod(result.mesh.values()), lambda b: f"{b / 2**20:12.1f}"
  lines = [f"mesh {result.mesh} ({n} of {result.devices} devices)"]
  lines += [f"{'component':28s}{'per-device MiB':>15s}{'total MiB':>15s}"]
  lines += [f"{k:28s}{mib(v):>15s}{mib(v * n):>15s}" for k, v in result.bytes.items()]
  lines += [f"{'peak = state + max(KV, act)':28s}{mib(result.peak_bytes):>15s}"]
  if result.sampler is not None:
    lines[-1] = f"{'peak (the fullest device)':28s}{mib(result.peak_bytes):>15s}"
    lines.insert(
      1,
      f"sampler mesh {result.sampler} of its own: a parameter copy of "
      f"{result.sampler_params_bytes / 2**20:.1f} MiB and the KV cache per sampler device; "
      "the trainer's devices hold the rest",
    )
  lines += [f"activations: {result.activations_source}", *(f"note: {x}" for x in result.notes)]
  if result.headroom is None:
    lines.append("verdict: unknown (no device memory given)")
  else:
    fits = "fits" if result.headroom >= 0 else "does NOT fit"
    cap = (result.bytes_per_device or 0) / planner.GIB
    lines.append(f"verdict: {fits} in {cap:.1f} GiB per device, headroom {result.headroom:+.0%}")
    if result.headroom < 0:
      top = max(result.bytes, key=result.bytes.__getitem__)
      lines.append(f"largest: {top} (activations shrink with a smaller train.micro_batch_size)")
  if result.peak_flops:
    seconds = result.step_flops / (result.peak_flops * n)
    lines.append(
      f"step time >= {seconds:.3g} s (rough bound: {result.flops_rule} FLOPs "
      f"at 100% of {result.peak_flops:.3g} FLOP/s per device)"
    )
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  try:
    device_type, count = parse_devices(_DEVICES.value, planner.DEVICES)
    if _MEMORY_GIB.value is not None and _MEMORY_GIB.value <= 0:
      raise ValueError(f"memory_gib: must be > 0, got {_MEMORY_GIB.value}")
    memory = _MEMORY_GIB.value and int(_MEMORY_GIB.value * planner.GIB)
    if memory is None and device_type is not None:
      memory = planner.DEVICES[device_type].hbm_bytes
    result = planner.plan(
      _CONFIG.value,
      devices=count,
      bytes_per_device=memory,
      device_type=device_type,
      activations=_ACTIVATIONS.value,
    )
    extra = ""
    if _TIMELINE.value:
      if not os.path.exists(_TIMELINE.value):
        raise ValueError(f"timeline: {_TIMELINE.value} does not exist")
      rows = metrics_files.split_rows(metrics_files.read_metrics(_TIMELINE.value))[0]
      if not rows:
        raise ValueError(f"timeline: {_TIMELINE.value} holds no training rows (metrics.jsonl)")
      costs = timeline.from_rows(rows)
      skip = timeline.COMPILE_ROWS
      extra = f"timeline from {_TIMELINE.value} (means of steps {skip + 1}..{len(rows)}), "
      extra += timeline.report(costs, _SAMPLER_FACTOR.value, _LEARNER_FACTOR.value)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  print(format_plan(result))
  if extra:
    print(extra)


if __name__ == "__main__":
  cli.run(main)
