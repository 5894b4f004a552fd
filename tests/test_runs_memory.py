"""Many runs in one process keep its memory flat (what an inline sweep or a study does)."""

from benchmarks import runs_memory


def test_twenty_runs_in_one_process_keep_memory_and_mappings_flat():
  """Resident memory after run 20 within 100 MB of run 2; code mappings and threads flat.

  Each run is the default task end to end (warm start, RL steps, evaluation,
  checkpoint, TensorBoard writer) with its own seed and workdir. A process that
  kept something of every finished run (compiled programs, buffers, checkpoint
  threads, writers) grows by about 60 MB and 2,000 mappings per run
  (docs/results/sweeps.md); rerunning the same config compiles nothing new, so
  whatever grows here is kept per run.
  """
  after = runs_memory.measure(runs=20, steps=2, losses=[], sft_steps=2, log=lambda s: None)
  second, last = after[1], after[-1]
  assert last["rss"] - second["rss"] < 100, [round(r["rss"]) for r in after]
  assert last["maps"] - second["maps"] < 50, [r["maps"] for r in after]
  assert last["threads"] <= second["threads"] + 1, [r["threads"] for r in after]
  assert last["files"] <= second["files"] + 4, [r["files"] for r in after]
