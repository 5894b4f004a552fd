"""Which correction fixes which kind of off-policyness: the correction family x mismatch and lag.

  python -m experiments.study --config=configs/mismatch_study.py --workdir=/tmp/mismatch_study

The lag study's instrument (configs/lag_study.py: vmapped seeds, paired
verdicts, resumable) on a grid of GRPO and the rollout-correction family
(docs/losses.md) against four settings:

  exact    on-policy, the sampler's distribution scored exactly (the contract)
  stale8   every batch from the version 8 optimizer steps old (policy staleness)
  topk5    on-policy, top-k 5 sampling that the learner scores as the full
           softmax (`rollout.behavior_logp=mismatched`: the peers' truncation
           bug, on-policy ratios down to ~0.1; engine mismatch)
  bf16     on-policy, a bf16 sampler beside the fp32 learner (engine mismatch)

Every run scores pi_old (`rollout.score_old`), so the study records both
factors (`mismatch_kl_k3`, `staleness_kl_k3`) and what each correction
masked. 100 steps, 3 seeds, 256 held-out prompts, 60 cells with the A/A
twins: 30 minutes on the first 2-core CPU it ran on, 100 minutes on a slower
one beside test runs. Results: docs/results/off_policyness.md.
"""

from configs import lag_study

METHODS = ",".join(
  (
    "grpo",
    "tis",
    "tis_seq",
    "tis_old",
    "icepop",
    "icepop_old",
    "mis_token",
    "mis_seq",
    "mis_geo",
    "tr_mask_k3",
    "tr_mask_k1",
    "dppo_tv",
    "dppo_kl",
    "opsm",
  )
)
LAGS = "exact=1/0,stale8=1/8,topk5=1/0+topk5,bf16=1/0+bf16"


def get_config():
  c = lag_study.get_config()
  c.unlock()
  c.total_steps = 100
  c.eval_every = 50
  c.eval_prompts = 256
  c.task_kwargs.num_eval = 256
  c.rollout.score_old = True
  c.study.methods = METHODS
  c.study.lags = LAGS
  c.study.seeds = 3
  c.study.eval_last = 1
  c.study.baseline = "grpo@exact"
  c.lock()
  return c
