"""The decode roofline: machine limits measured here, and a decode step's work from the config.

A decode step of B = G * K rows (G prompts of P tokens, K samples each, rows
attending to S of their own cached keys) must at least

  FLOPs  = B * 2 * N_mm  +  B * 4 * L * n * h * (P + S)
  bytes  = N_mm * w  +  2 * L * n_kv * h * c * (G * P + B * S)  +  B * V * 4

with N_mm the matmul parameters a token is computed with (q, k, v, o, the
MLP and the output projection; the embedding lookup reads B rows only; with
experts, the router and k of the E experts per block), L layers of n query
heads and n_kv key/value heads of width h, w the bytes per weight and c per
cached value: the weights read once, each prompt's keys and values read once
per group (the sampler shares them), each row's own keys and values, and the
float32 logits written. With experts the weights read are the dense ones
and, per block, the experts the B rows touch: E (1 - (1 - k/E)^B) of them
in expectation under uniform routing. Its time is at least max(FLOPs / peak, bytes /
bandwidth) (Williams et al., "Roofline", CACM 2009); the fraction of that
bound a measured step reaches is bound / measured time.

The peak is the median rate of jitted matmuls (float32 unless asked; `chain` products in
one program where one call would be as short as its dispatch); the bandwidth the
median rate of a jitted reduction over a large float32 array (bytes read /
time), both timed in the calling process, so they share its machine state.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from offpolicy_jax import models


def median_time(fn, *args, repeats: int) -> float:
  """Median seconds of `fn(*args)` over `repeats` calls after one warm-up (compilation) call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def matmul_peak(
  size: int = 2048, repeats: int = 5, dtype=jnp.float32, chain: int | None = None
) -> float:
  """Median FLOP/s of `chain` jitted [size, size] @ [size, size] products run as one program.

  On an accelerator one product can take as long as the call's dispatch (4096^3 in bf16 is
  about 0.2 ms on an H200), so a chain of products in one program is timed there: by default
  16 on an accelerator, 1 on a CPU.
  """
  if chain is None:
    chain = 1 if jax.default_backend() == "cpu" else 16
  a = jax.random.normal(jax.random.key(0), (size, size), dtype)
  scale = jnp.asarray(size**-0.5, dtype)  # keeps the chained products' entries O(1)

  @jax.jit
  def products(x):
    return jax.lax.fori_loop(0, chain, lambda _, y: (y @ a) * scale, x)

  return chain * 2 * size**3 / median_time(products, a, repeats=repeats)


def memory_bandwidth(mib: int = 512, repeats: int = 5) -> float:
  """Median bytes/s read by a jitted sum over a float32 array of `mib` MiB."""
  x = jnp.ones((mib * 2**18,), jnp.float32)
  return x.nbytes / median_time(jax.jit(jnp.sum), x, repeats=repeats)


def matmul_params(config: models.ModelConfig) -> int:
  """N_mm: parameters used as matmul weights in one token's forward (output projection included).

  With experts: the router and the token's k experts per block (activated parameters).
  """
  c = config
  d, n, kv, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
  return c.num_layers * (
    2 * d * n * h + 2 * d * kv * h + _feed_forward(c, c.num_experts_per_tok)
  ) + (c.vocab_size * d)


def _feed_forward(c: models.ModelConfig, experts: float) -> float:
  """Matmul parameters of one block's feed-forward computing `experts` of its experts."""
  if not c.num_experts:
    return 3 * c.hidden_size * c.intermediate_size
  return c.hidden_size * c.num_experts + experts * 3 * c.hidden_size * c.moe_intermediate_size


def weights_read(config: models.ModelConfig, rows: int) -> float:
  """Weights one decode step over `rows` rows reads: with experts, those the rows touch."""
  c = config
  if not c.num_experts:
    return matmul_params(c)
  e, k = c.num_experts, c.num_experts_per_tok
  touched = e * (1 - (1 - k / e) ** rows)  # expected, routing uniform
  per_token = _feed_forward(c, k)
  return matmul_params(c) + c.num_layers * (_feed_forward(c, touched) - per_token)


@dataclasses.dataclass(frozen=True)
class StepCost:
  """Work of one decode step (module docstring)."""

  flops: float
  bytes: float

  def bound_s(self, peak: float, bandwidth: float) -> float:
    """The roofline time: max(FLOPs / peak, bytes / bandwidth)."""
    return max(self.flops / peak, self.bytes / bandwidth)


def decode_step_cost(
  config: models.ModelConfig, *, prompts: int, group_size: int, prompt_len: int, span: float
) -> StepCost:
  """FLOPs and bytes of one decode step of `prompts * group_size` rows (module docstring).

  Args:
    config: the model.
    prompts: G.
    group_size: K.
    prompt_len: P, cached prompt tokens attended per row.
    span: S, own cached tokens attended per row (a mean over steps may be fractional).
  """
  c = config
  b = prompts * group_size
  n_mm = matmul_params(c)
  w = jnp.dtype(c.param_dtype).itemsize
  cache = jnp.dtype(c.dtype).itemsize
  flops = b * 2 * n_mm + b * 4 * c.num_layers * c.num_heads * c.head_dim * (prompt_len + span)
  kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * cache * (prompts * prompt_len + b * span)
  weights = weights_read(c, b) * w
  return StepCost(float(flops), float(weights + kv + b * c.vocab_size * 4))
