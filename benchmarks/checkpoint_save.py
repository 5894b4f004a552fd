"""Seconds and compiled programs of a process's first checkpoint saves on CPU devices.

Orbax splits the write of an array replicated over R devices into R slices (one
compiled program per device and shape) to copy them to the host in parallel;
`store.checkpointing` turns that off on CPU, where device memory is the host's.
This script saves the main job's model parameters and Adam state, replicated
over `--devices` CPU devices, `--saves` times in a fresh process for each mode,
and prints the seconds of each save and the programs compiled during it:

  python benchmarks/checkpoint_save.py [--devices 8] [--saves 2]

`whole` is what a run does on CPU; `split` is orbax's default.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("whole", "split")


def _measure(mode: str, saves: int) -> list[dict]:
  """In this process: `saves` saves of one replicated train state under `mode`."""
  import jax
  import optax
  import orbax.checkpoint as ocp
  from flax import nnx
  from orbax.checkpoint._src.metadata import array_metadata_store

  from configs import default
  from offpolicy_jax import models
  from offpolicy_jax.store import checkpointing

  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **_: (
      compiles.append(secs) if event == "/jax/core/compile/backend_compile_duration" else None
    )
  )
  config = models.get_config(default.get_config().model)
  params = nnx.state(models.Decoder(config, rngs=nnx.Rngs(0)), nnx.Param)
  mesh = jax.make_mesh((len(jax.devices()),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  state = jax.device_put({"params": params, "opt": optax.adam(1e-3).init(params)}, replicated)
  if mode == "split":  # orbax's own default handler, as before the CPU setting
    split = ocp.type_handlers.ArrayHandler(
      array_metadata_store=array_metadata_store.Store(), use_replica_parallel=True
    )
    checkpointing._whole_replicas_on_cpu = lambda: None
    ocp.type_handlers.register_type_handler(jax.Array, split, override=True)
  ckpt = checkpointing.Checkpointer(tempfile.mkdtemp(), max_to_keep=None, async_save=False)
  rows = []
  for step in range(1, saves + 1):
    before, start = len(compiles), time.perf_counter()
    ckpt.save(step, state, {"step": step})
    ckpt.wait()
    rows.append(
      {"save": step, "seconds": time.perf_counter() - start, "compiled": len(compiles) - before}
    )
  ckpt.close()
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=8, help="CPU devices the state spans.")
  parser.add_argument("--saves", type=int, default=2, help="Saves per mode.")
  parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one mode, this process
  args = parser.parse_args()
  if args.devices < 1 or args.saves < 1:
    parser.error("--devices and --saves must be >= 1")
  if args.mode:
    print(json.dumps(_measure(args.mode, args.saves)))
    return
  env = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}",
  }
  print(f"{args.devices} CPU devices; seconds and programs compiled per save")
  for mode in MODES:
    cmd = [sys.executable, __file__, f"--mode={mode}", f"--saves={args.saves}"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    for row in json.loads(out.splitlines()[-1]):
      print(f"  {mode:<6} save {row['save']}: {row['seconds']:6.2f} s, {row['compiled']} compiled")


if __name__ == "__main__":
  main()
