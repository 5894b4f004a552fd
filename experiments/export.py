r"""Exports a run's checkpoint as a PEFT adapter or a Hugging Face checkpoint.

  python -m experiments.export --workdir=/tmp/opj_lora --out=/tmp/adapter            # PEFT
  python -m experiments.export --workdir=/tmp/opj_lora --out=/tmp/merged --merged    # HF
  python -m experiments.export --workdir=workdirs/default --out=/tmp/hf --merged     # no LoRA

The run's recorded config rebuilds the model; the latest checkpoint step (or
--step) is read. An HF checkpoint written holds the run's tokenizer and a
generation_config.json, so transformers' Auto classes load it as it is (the
`[hf]` extra installs them). See `offpolicy_jax.run.export` and docs/lora.md.
"""

import json

from absl import app, flags, logging

from offpolicy_jax import cli
from offpolicy_jax.store import workdir

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (config.json, checkpoints/).")
_OUT = flags.DEFINE_string("out", None, "Output directory, new or empty (a full one is refused).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
_MERGED = flags.DEFINE_bool(
  "merged", False, "Write one HF checkpoint (adapters merged) instead of a PEFT adapter."
)
_PEFT = flags.DEFINE_bool("peft", False, "Write a PEFT adapter (the default for a LoRA run).")
_DTYPE = flags.DEFINE_string("dtype", None, "Storage dtype, e.g. bfloat16 (default: as trained).")
flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _MERGED.value and _PEFT.value:
    raise app.UsageError("--peft and --merged exclude each other")
  recorded = workdir.recorded_config(_WORKDIR.value)  # a run's workdir, before JAX is imported
  from offpolicy_jax.run import export

  logging.set_verbosity(logging.WARNING)
  fmt = "merged" if _MERGED.value else "peft"
  if not _PEFT.value and not _MERGED.value and not recorded.lora.rank:
    fmt = "merged"  # a run without adapters exports the whole model
  result = export.export_checkpoint(
    _WORKDIR.value, _OUT.value, fmt=fmt, step=_STEP.value, dtype=_DTYPE.value
  )
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  cli.run(main)
