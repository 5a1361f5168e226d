"""Bring your own model: a user-defined Flax NNX hybrid served by the umem_jax engine.

Three layers -- sliding-window attention, Mamba2, full attention -- built from the project's
public layers (models.attention.Attention, models.mamba2_mixer.Mamba2Mixer, models.layers).
The module meets the engine's contract (docs/byo_model.md):

    decls(config, kv_dtype) -> [LayerDecl]      what each layer keeps per request in the arena
    __call__(arena, batch, plan, impl=, interpret=) -> (logits [B, V] fp32, arena)
    dense(tokens [B, T]) -> logits [B, T, V]    optional cache-free path (the test's oracle)

    python examples/byo_model.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from umem_jax import LLM, SamplingParams
from umem_jax.memory import full_attention, mamba2_state_tensors, recurrent_state, window_attention
from umem_jax.models import Model, ModelConfig
from umem_jax.models.arena_slot import arena_slot
from umem_jax.models.attention import Attention
from umem_jax.models.config import FULL, RECURRENT, SLIDING, MambaConfig, RopeConfig
from umem_jax.models.layers import MLP, RMSNorm
from umem_jax.models.mamba2_mixer import Mamba2Mixer

CONFIG = ModelConfig(
    architecture="ByoHybrid", vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=4,
    num_kv_heads=2, head_dim=16, layer_types=(SLIDING, RECURRENT, FULL), sliding_window=8,
    rope=((SLIDING, RopeConfig(10_000.0)), (FULL, RopeConfig(1_000_000.0))), hidden_activation="silu",
    mamba=MambaConfig(num_heads=4, head_dim=16, state_size=16), eos_token_id=None, max_position_embeddings=512)


class Block(nnx.Module):
    """Pre-norm residual block: h += mixer(norm(h)); h += mlp(norm(h))."""

    def __init__(self, cfg: ModelConfig, i: int, *, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.kind = cfg.layer_types[i]
        self.norm1, self.norm2 = RMSNorm(d, eps=1e-6, dtype=jnp.float32), RMSNorm(d, eps=1e-6, dtype=jnp.float32)
        self.mixer = (Mamba2Mixer(d, cfg.mamba, time_step_min=0.0, eps=1e-6, conv_bias=True, dtype=jnp.float32,
                                  rngs=rngs) if self.kind == RECURRENT else Attention(cfg, i, qk_norm=False, rngs=rngs))
        self.mlp = MLP(d, cfg.intermediate_size, cfg.hidden_activation, dtype=jnp.float32, rngs=rngs)

    def dense(self, h, positions, valid):
        h = h + self.mixer.dense(self.norm1(h), positions, valid)
        return h + self.mlp(self.norm2(h))

    def __call__(self, h, arena, batch, slot):
        y, arena = self.mixer(self.norm1(h), arena, batch, slot)  # writes this step's K/V or state first
        h = h + y
        return h + self.mlp(self.norm2(h)), arena


class ByoHybrid(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg  # Model.from_module reads it
        self.embed = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size)))
        self.layers = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=1e-6, dtype=jnp.float32)

    @staticmethod
    def decls(cfg: ModelConfig, kv_dtype: str = "bfloat16"):
        m, out = cfg.mamba, []
        for i, kind in enumerate(cfg.layer_types):
            if kind == SLIDING:
                out.append(window_attention(i, cfg.sliding_window, cfg.num_kv_heads, cfg.head_dim, dtype=kv_dtype))
            elif kind == FULL:
                out.append(full_attention(i, cfg.num_kv_heads, cfg.head_dim, dtype=kv_dtype))
            else:  # conv window + SSM state, one slot per request; a prefix-cache checkpoint every 32 tokens
                state = mamba2_state_tensors(m.num_heads, m.head_dim, m.state_size, m.n_groups, m.conv_kernel,
                                             conv_dtype=kv_dtype)
                out.append(recurrent_state(i, state, checkpoint_interval=32))
        return out

    def _logits(self, h):
        return jnp.einsum("...d,vd->...v", self.norm(h), self.embed[...]).astype(jnp.float32)

    def __call__(self, arena, batch, plan, *, impl=None, interpret=False):
        h = jnp.take(self.embed[...], batch.tokens, axis=0)
        for i, layer in enumerate(self.layers):  # where layer i lives in the arena (static, from the plan)
            h, arena = layer(h, arena, batch, arena_slot(plan, i, impl=impl, interpret=interpret))
        last = jnp.take_along_axis(h, batch.last_index()[:, None, None], axis=1)[:, 0]
        return self._logits(last), arena

    def dense(self, tokens):
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        h = jnp.take(self.embed[...], tokens, axis=0)
        for layer in self.layers:
            h = layer.dense(h, positions, jnp.ones((b, t), bool))
        return self._logits(h)


def build(seed: int = 0) -> Model:
    return Model.from_module(ByoHybrid(CONFIG, rngs=nnx.Rngs(seed)))


PROMPTS = [[5, 17, 42, 99, 3, 8, 150, 77, 21, 60, 11, 200], [7, 7, 31, 64, 128], list(range(40, 70))]


def main(max_tokens: int = 12, model: Model | None = None):
    """Greedy-generate for PROMPTS through the engine -> (the LLM, the output token ids)."""
    model = model or build()
    llm = LLM(model=model, arena_bytes=256 << 10, max_num_seqs=4, max_num_batched_tokens=32, page_size=4,
              max_model_len=128, batch_buckets=(4,), token_buckets=(32,), page_buckets=(32,))
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    tokens = [o.outputs[0].token_ids for o in outs]
    for p, t in zip(PROMPTS, tokens):
        print(f"prompt {p[:6]}... ({len(p)} tokens) -> {t}")
    return llm, tokens


if __name__ == "__main__":
    main()
