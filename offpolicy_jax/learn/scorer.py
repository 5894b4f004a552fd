"""The learner's log-probs of responses: `token_logprobs` and the rollout scorer `make_scorer`.

Both score as the train step does (temperature, top-k / top-p truncation,
shared prefix; `StepOptions`), so log pi_old scored at the sampling parameters
matches the train step's log-probs at the same parameters.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from offpolicy_jax import models, types
from offpolicy_jax.learn.step_options import StepOptions
from offpolicy_jax.types import TrainBatch


def token_logprobs(
  graphdef: nnx.GraphDef,
  params,
  mb: TrainBatch,
  temperature: float,
  shared_group: int = 0,
  *,
  truncated: bool = False,
  top_k: int = 0,
  dropout_key: jax.Array | None = None,
  full: bool = False,
  replay: bool = False,
):
  """Teacher-forced log-probs and entropies [B, N] of `mb`'s responses under `params`.

  With ``shared_group = K > 0`` the rows are groups of K sharing a prompt and
  each prompt runs once (`models.shared_prefix_logprobs`). With `truncated`
  the log-probs are those of the top-k / top-p truncated distribution of
  ``mb.behavior_kept`` tokens (`StepOptions.truncated`). `dropout_key` turns
  on the adapters' input dropout (the train step's current policy only).
  `full` returns a `models.logprobs.Scored`: the experts' `moe.RouterStats`
  and the value head's values too (None where the model has none). When `mb` carries the sampler's
  routing (`TrainBatch.experts`), the stats compare with it and `replay`
  routes along it (`models.moe`).
  """
  model = nnx.merge(graphdef, params)
  kept = mb.behavior_kept if truncated else None
  recorded = None
  if mb.experts is not None and mb.prompt_experts is not None:
    prompt_experts = mb.prompt_experts[::shared_group] if shared_group else mb.prompt_experts
    recorded = (prompt_experts, mb.experts)
  if shared_group:
    return models.shared_prefix_logprobs(
      model,
      mb.prompt_tokens[::shared_group],
      mb.prompt_mask[::shared_group],
      mb.tokens,
      mb.mask,
      shared_group,
      temperature,
      kept=kept,
      top_k=top_k,
      dropout_key=dropout_key,
      full=full,
      recorded=recorded,
      replay=replay,
    )
  return models.sequence_logprobs(
    model,
    mb.prompt_tokens,
    mb.prompt_mask,
    mb.tokens,
    mb.mask,
    temperature,
    kept=kept,
    top_k=top_k,
    dropout_key=dropout_key,
    full=full,
    recorded=recorded,
    replay=replay,
  )


def step_logprobs(
  graphdef, options: StepOptions, params, mb: TrainBatch, *, dropout_key=None, full=False
):
  """`token_logprobs` of `mb` scored as the train step scores: the options' temperature,
  truncation, top-k, shared prefix and routing replay. The one place those settings are read."""
  return token_logprobs(
    graphdef,
    params,
    mb,
    options.temperature,
    options.group_size if options.shared_prefix else 0,
    truncated=options.truncated,
    top_k=options.top_k,
    dropout_key=dropout_key,
    full=full,
    replay=options.routing_replay == "replay",
  )


def make_scorer(graphdef: nnx.GraphDef, options: StepOptions):
  """Jitted `score(params, prompt_tokens [G, P], prompt_lengths [G], out) -> logp [G*K, N]`.

  The learner's log-probs of a sampled rollout `out` (`sampling.SampleOutput`)
  at `params`, scored as the train step scores (temperature, truncation,
  shared prefix, routing replay): at the sampling parameters, log pi_old
  (docs/science.md s7).
  """

  def score(params, prompt_tokens, prompt_lengths, out):
    zeros = jnp.zeros(out.tokens.shape[:1], jnp.float32)
    batch = types.pack_groups(
      prompt_tokens,
      prompt_lengths,
      out.tokens,
      out.mask,
      out.logprobs,
      jnp.zeros(out.tokens.shape, jnp.int32),
      zeros,
      zeros,
      out.kept,
      None,
      getattr(out, "prompt_experts", None),
      getattr(out, "experts", None),
    )
    logp, _ = step_logprobs(graphdef, options, params, batch)
    return logp

  return jax.jit(score)
