"""How a run's model is built from its config: the tokenizer, the adapters, the policy and a
separate critic (`critic.model`, `models.value`), as `seed -> model`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from offpolicy_jax import models
from offpolicy_jax.models import hub, tokenizers, value
from offpolicy_jax.run import critic_settings
from offpolicy_jax.scale import sharding
from offpolicy_jax.step.run_state import INIT, step_key


def tokenizer(config):
  """The run's tokenizer: `config.tokenizer`, the model checkpoint's, or characters."""
  if config.tokenizer:
    return tokenizers.HFTokenizer.from_pretrained(config.tokenizer)
  path = hub.model_dir(config.model)
  if path is not None:
    return tokenizers.HFTokenizer.from_pretrained(path)
  return tokenizers.CharTokenizer()


def lora_config(config) -> models.LoraConfig | None:
  """The adapters of `config.lora` (None when `lora.rank` is 0: full fine-tuning)."""
  c = config.lora
  if not c.rank:
    return None
  targets = tuple(t.strip() for t in c.targets.split(","))
  return models.LoraConfig(
    rank=c.rank, alpha=float(c.alpha), targets=targets, dropout=float(c.dropout)
  )


def model_constructor(config, mesh, tokenizer, dtype: str = ""):
  """`seed -> model`: an HF checkpoint loaded onto the mesh, or a fresh preset.

  `dtype` overrides the compute dtype (`model_dtype`); parameters stay float32.
  With `lora.rank > 0` the model carries fresh adapters (B = 0) drawn from the seed.
  With `critic.model` the model carries a separate critic (`models.value`).
  """
  lc = lora_config(config)
  separate = critic_settings.separate_critic(config)
  value_head = bool(critic_settings.estimator(config)) and not separate
  policy = _decoder(config, config.model, mesh, tokenizer, dtype, value_head, lc, 0)
  if not separate:
    return policy
  name = config.model if separate == critic_settings.FROM_POLICY else separate
  critic = _decoder(config, name, mesh, tokenizer, dtype, True, None, 1)
  return lambda seed: value.attach(policy(seed), critic(seed))


def _decoder(config, name: str, mesh, tokenizer, dtype: str, value_head: bool, lc, stream: int):
  """`seed -> Decoder` of preset or HF checkpoint `name`; a fresh preset's weights are drawn
  from the seed's stream `stream` (0: the policy, 1: a separate critic)."""
  dtype = dtype or config.model_dtype
  path = hub.model_dir(name, "critic.model" if stream else "model")
  if path is not None:
    compute = jnp.dtype(dtype)
    scan, remat, attention = config.model_scan_layers, config.model_remat, config.model_attention

    def load(seed):
      model = models.from_pretrained(
        path,
        jnp.float32,
        compute_dtype=compute,
        mesh=mesh,
        rules=sharding.LOGICAL_AXIS_RULES,
        scan_layers=scan,
        scan_decode=config.model_scan_decode,
        remat=remat,
        attention=attention,
        value_head=value_head,
      )
      return model if lc is None else models.lora.with_adapters(model, lc, step_key(seed, 0, INIT))

    return load
  mcfg = models.get_config(
    name,
    vocab_size=tokenizer.vocab_size,
    dtype=dtype,
    scan_layers=config.model_scan_layers,
    scan_decode=config.model_scan_decode,
    remat=config.model_remat,
    attention=config.model_attention,
    lora=lc,
    value_head=value_head,
  )

  def build(seed):
    key = step_key(seed, 0, INIT)
    key = jax.random.fold_in(key, stream) if stream else key
    return models.Decoder(mcfg, rngs=nnx.Rngs(params=key))

  return build


def critic_start(config) -> str:
  """`ModelParts.critic` of the run's config."""
  separate = critic_settings.separate_critic(config)
  return "" if not separate else "policy" if separate == critic_settings.FROM_POLICY else "own"
