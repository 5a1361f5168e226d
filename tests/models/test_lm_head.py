"""The LM head's logits are accumulated and returned in fp32, not rounded to the weights' bf16.

bf16 logits tie exactly (steps of 1/32 near |8|); on the H200 a speculative verify and a plain
decode step then picked different tokens of such a tie (benchmarks/RESULTS.md, speculative
decoding, 2026-12-04).  fp32 logits leave only real near-ties.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from umem_jax.models.layers import Embedding


def test_attend_is_fp32_and_not_bf16_rounded():
    vocab, d = 4096, 256
    emb = Embedding(vocab, d, dtype=jnp.bfloat16, rngs=nnx.Rngs(np.random.randint(1 << 30)))
    h = jax.random.normal(jax.random.key(np.random.randint(1 << 30)), (3, d), jnp.float32).astype(jnp.bfloat16)
    out = emb.attend(h)
    assert out.dtype == jnp.float32 and out.shape == (3, vocab)
    want = np.asarray(h, np.float32) @ np.asarray(emb.weight[...], np.float32).T
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # Rounded to bf16, many logits would tie exactly; in fp32 the distinct values stay distinct.
    rounded = np.asarray(out.astype(jnp.bfloat16), np.float32)
    assert len(np.unique(rounded[0])) < len(np.unique(np.asarray(out[0])))
    assert not np.array_equal(rounded, np.asarray(out))
