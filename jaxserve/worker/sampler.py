"""Token sampling from a step's logits: greedy, temperature, top-k, top-p, per-request seeds."""

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-sequence sampling settings of one step, padded to the step's S.

    Attributes:
      temperature: [S] float32; 0 means greedy.
      top_k: [S] int32; 0 disables.
      top_p: [S] float32 in (0, 1].
      seeds: [S] uint32 per-request seed.
      steps: [S] int32 tokens the request has generated so far; folded into its seed so a
        request's draws do not depend on what else is in the batch.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seeds: jax.Array
    steps: jax.Array


jax.tree_util.register_dataclass(
    SamplingMetadata, data_fields=["temperature", "top_k", "top_p", "seeds", "steps"], meta_fields=[]
)


def _sample(logits: jax.Array, sm: SamplingMetadata) -> jax.Array:
    vocab = logits.shape[-1]
    temp = jnp.where(sm.temperature > 0, sm.temperature, 1.0)
    scaled = logits / temp[:, None]
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    # top-k: keep logits >= the k-th largest.
    k = jnp.where(sm.top_k > 0, jnp.minimum(sm.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    # top-p: keep the smallest prefix of sorted tokens whose mass reaches top_p.
    probs = jax.nn.softmax(jnp.where(sorted_logits >= kth, sorted_logits, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < sm.top_p[:, None]
    num_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_logits, (num_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(threshold, kth)
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(sm.seeds, sm.steps)
    sampled = jax.vmap(jax.random.categorical)(keys, masked)
    return jnp.where(sm.temperature > 0, sampled, jnp.argmax(logits, axis=-1))


def sample(logits: jax.Array, sm: SamplingMetadata) -> jax.Array:
    """Pick one token per row.

    Args:
      logits: [S, V] float32.
      sm: the rows' sampling settings.

    Returns:
      [S] int32 token ids. Greedy rows take the argmax; when every row is greedy the sort
      needed for top-k/top-p is skipped at run time.
    """
    return jax.lax.cond(
        jnp.all(sm.temperature == 0),
        lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32),
        lambda: _sample(logits, sm).astype(jnp.int32),
    )
