"""MTP head: a checkpoint's own multi-token-prediction layers, a draft that shares the target's
embedding and LM head (speculative method "mtp": runner/mtp.py).

    e = norm_e(E[x_{i+1}]);  g = norm_h(h_i)      h_i: the target's FINAL-NORMED hidden at position i
    y = fc([e | g])                                fc [d, 2d]: the embedding half first
    per layer:  y = layer(y)                       Qwen3.5 / -MoE / Qwen3-Next: one gated full-attention
                                                   decoder layer of the family (its MLP or MoE block);
                                                   NemotronH: the blocks of mtp_layers_block_type
                                                   (attention, then MoE), each h + mixer(norm(h))
    y = norm(y)                                    the head's own final norm (the target's is not applied)
    logits = y W_lm^T                              the target's LM head

So the head's entry at position i is computed from (x_{i+1}, h_i): its attention layers write
their K/V there, RoPE at position i, and attend over the head's K/V of positions <= i.  Drafts
chain: d_1 = argmax(logits at the last position n), then d_{j+1} from (d_j, y) at position
n + j, the head's output y standing in for the target's hidden.  Norms are Qwen's zero-centred
(1 + w) RMSNorm or NemotronH's plain w * x_hat, like the family's.  (vLLM's qwen3_next_mtp.py,
qwen3_5_mtp.py and nemotron_h_mtp.py compute the same; their hidden is the target model's
output after its final norm.)

Checkpoint names, under `mtp.` (also `model.mtp.`, `language_model.mtp.`): Qwen `fc.weight`,
`pre_fc_norm_embedding.weight`, `pre_fc_norm_hidden.weight`, `layers.0.*` (the family layer's
names), `norm.weight`; NemotronH `layers.0.{enorm, hnorm, eh_proj}`, `layers.{i}.{norm, mixer.*}`,
`layers.{last}.final_layernorm`, read as fc / the pre-fc norms / norm.  Parameter paths are the
Qwen names.  Experts load as the family's (either layout).  One MTP layer is served (every
released checkpoint has one); more is refused by name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from ..core.batch import Batch
from ..memory.declarations import LayerDecl
from ..memory.plan import Plan
from .arena_slot import arena_slot
from .config import LAYER_TYPES, ModelConfig
from .layers import Linear, RMSNorm, settle
from .model import Model

PREFIXES = ("mtp.", "model.mtp.", "language_model.mtp.", "model.language_model.mtp.")
MEMORY_MODEL = "draft"  # the head's layers in the plan: fused into the target's envelopes


class MTPHead(nnx.Module):
    """fc over [norm_e(embedding) | norm_h(hidden)], the family's layers, the head's norm
    (module docstring).  A family subclass says its layer and norm style."""

    norm_offset = 1.0  # zero-centred (1 + w) norms; NemotronH: 0

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dtype, d, eps = jnp.dtype(cfg.dtype), cfg.hidden_size, cfg.rms_norm_eps
        self.config = cfg
        lc = self.layer_config(cfg)
        self.kinds = lc.layer_types
        self.fc = Linear(2 * d, d, dtype=dtype, rngs=rngs)
        self.pre_fc_norm_embedding = RMSNorm(d, eps=eps, offset=self.norm_offset, dtype=dtype)
        self.pre_fc_norm_hidden = RMSNorm(d, eps=eps, offset=self.norm_offset, dtype=dtype)
        self.layers = nnx.List([self.make_layer(lc, i, rngs) for i in range(lc.num_layers)])
        self.norm = RMSNorm(d, eps=eps, offset=self.norm_offset, dtype=dtype)

    def make_layer(self, lc: ModelConfig, layer: int, rngs: nnx.Rngs) -> nnx.Module:
        raise NotImplementedError

    @staticmethod
    def layer_config(cfg: ModelConfig) -> ModelConfig:
        """The target's config with the head's layers as its layers (what the family's layer
        classes, decls and checkpoint conversion read)."""
        return dataclasses.replace(cfg, layer_types=cfg.mtp_layer_types, mtp_num_layers=0, mtp_layer_types=())

    @classmethod
    def decls(cls, cfg: ModelConfig, kv_dtype: str = "bfloat16") -> list[LayerDecl]:
        """The head's attention layers' K/V (layer i of the head; engine/speculative.py tags them
        "draft"): the family's declarations of its layers."""
        from .registry import model_class

        return model_class(cfg.architecture).decls(cls.layer_config(cfg), kv_dtype)

    @classmethod
    def checkpoint_to_params(cls, cfg: ModelConfig, tensors: dict) -> dict:
        """{name under mtp.: array} -> {our path: array}: the family's conversion of its layers
        (stacked experts)."""
        from .registry import model_class

        return model_class(cfg.architecture).checkpoint_to_params(cls.layer_config(cfg), tensors)

    def fuse_inputs(self, embedded: jax.Array, hidden: jax.Array) -> jax.Array:
        """[B, T, d] embeddings of x_{i+1} and target hiddens h_i -> fc input projection [B, T, d]."""
        e = self.pre_fc_norm_embedding(embedded)
        g = self.pre_fc_norm_hidden(hidden.astype(embedded.dtype))
        return self.fc(jnp.concatenate([e, g], axis=-1))

    def dense(self, tokens: jax.Array, hidden: jax.Array, target, valid: jax.Array | None = None):
        """Cache-free forward (the oracle).  tokens [B, T]: x_{i+1} at position i (positions
        0..T-1); hidden [B, T, d]: the target's final-normed hidden; target: the CausalLM module
        -> (logits [B, T, V] fp32, the head's output [B, T, d])."""
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        valid = jnp.ones((b, t), bool) if valid is None else valid
        y = self.fuse_inputs(target.embed(tokens), hidden)
        for layer in self.layers:
            y = layer.dense(y, positions, valid)
        y = self.norm(y)
        return target.head_logits(y), y

    def __call__(self, arena: jax.Array, batch: Batch, plan: Plan, hidden: jax.Array, target, *,
                 impl: str | None = None, interpret: bool = False):
        """Serving forward.  batch.tokens [B, T]: x_{i+1} at the positions the batch computes;
        hidden [B, T, d]: h_i there.  Writes the head's K/V at those positions (the plan's
        "draft" layers), then attends -> (logits [B, V] fp32 and the head's output [B, d] at each
        row's last valid token, arena)."""
        y = self.fuse_inputs(target.embed(batch.tokens), hidden)
        for i, layer in enumerate(self.layers):
            keeps = self.kinds[i] in LAYER_TYPES
            slot = arena_slot(plan, i, MEMORY_MODEL, impl=impl, interpret=interpret) if keeps else None
            y, arena = layer(y, arena, batch, slot)
        y = settle(y)  # a layer may leave its residual add pending (RMSNorm.enter)
        y = self.norm(jnp.take_along_axis(y, batch.last_index()[:, None, None], axis=1)[:, 0])
        return target.head_logits(y), y, arena


class QwenMTP(MTPHead):
    """Qwen3.5, Qwen3.5-MoE, Qwen3-Next: one full-attention decoder layer of the family; it is
    sparse where the family's rule makes layer 0 sparse (vLLM builds it the same way)."""

    def make_layer(self, lc, layer, rngs):
        from .qwen3_5 import Qwen3_5DecoderLayer

        return Qwen3_5DecoderLayer(lc, layer, rngs=rngs)


# NemotronH's names for the fc and the head's norms (on its first and last block) -> ours.
_NEMOTRON_NAMES = {"layers.0.enorm.weight": "pre_fc_norm_embedding.weight",
                   "layers.0.hnorm.weight": "pre_fc_norm_hidden.weight", "layers.0.eh_proj.weight": "fc.weight"}


class NemotronHMTP(MTPHead):
    """NemotronH: its MTP blocks (attention without RoPE, MoE) with plain w * x_hat norms."""

    norm_offset = 0.0

    def make_layer(self, lc, layer, rngs):
        from .nemotron_h import NemotronHBlock

        return NemotronHBlock(lc, layer, rngs=rngs)

    @classmethod
    def checkpoint_to_params(cls, cfg, tensors):
        last = f"layers.{len(cfg.mtp_layer_types) - 1}.final_layernorm.weight"
        names = {**_NEMOTRON_NAMES, last: "norm.weight"}
        return super().checkpoint_to_params(cfg, {names.get(k, k): v for k, v in tensors.items()})


HEADS: dict[str, type[MTPHead]] = {"Qwen3_5ForCausalLM": QwenMTP, "Qwen3_5MoeForCausalLM": QwenMTP,
                                   "Qwen3NextForCausalLM": QwenMTP, "NemotronHForCausalLM": NemotronHMTP}


def head_class(cfg: ModelConfig) -> type[MTPHead]:
    """The MTP head of the target config `cfg`; ValueError saying why there is none to serve."""
    if cfg.architecture not in HEADS:
        raise ValueError(f"{cfg.architecture} has no MTP layers (speculative method 'mtp' serves the MTP heads of "
                         f"{', '.join(sorted(HEADS))}); use method 'draft' with a separate draft model")
    if cfg.mtp_num_layers < 1:
        raise ValueError(f"this {cfg.architecture} checkpoint's config.json declares no MTP layers "
                         "(mtp_num_hidden_layers / num_nextn_predict_layers is 0 or absent), so it has no MTP head")
    if cfg.mtp_num_layers > 1:
        raise ValueError(f"{cfg.mtp_num_layers} MTP layers: one is served (every released checkpoint has one; each "
                         "draft step would run layer j % n, which is not built)")
    return HEADS[cfg.architecture]


def random_head(target: Model, seed: int = 0) -> Model:
    """The target's MTP head with random weights (load_format "dummy")."""
    return Model.from_module(head_class(target.config)(target.config, rngs=nnx.Rngs(seed)))


def read_tensors(path: Path) -> dict:
    """Every MTP tensor of the checkpoint directory `path`, named without the MTP prefix (one
    tensor at a time, as the target's: checkpoint.py)."""
    from .checkpoint import read_safetensors

    def rename(k: str) -> str | None:
        prefix = next((p for p in PREFIXES if k.startswith(p)), None)
        return None if prefix is None else k[len(prefix):]

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(read_safetensors(f, rename))
    return out


def load_head(target: Model, source: str | Path | None = None) -> Model:
    """The MTP head of `target` from its checkpoint (`source`, default the directory the target
    was loaded from), in the target's dtype.  ValueError naming what is missing."""
    from . import loader

    cfg = target.config
    cls = head_class(cfg)
    path = Path(source) if source is not None else target.source
    if path is None or not Path(path).is_dir():
        raise ValueError("method 'mtp' reads the MTP layers from the target's checkpoint directory, and this target "
                         "was not loaded from one: give speculative_config model= the checkpoint directory")
    tensors = read_tensors(path)
    if not tensors:
        raise ValueError(f"{path} has no MTP weights: no tensor under {' / '.join(PREFIXES[:2])}, though config.json "
                         f"declares {cfg.mtp_num_layers} MTP layer ({cfg.architecture}: mtp.fc.weight, "
                         "mtp.layers.0.*, ... are missing; some exports drop them). Use a checkpoint with its MTP "
                         "layers, or method 'draft'")
    tensors = cls.checkpoint_to_params(cfg, tensors)
    _, abstract = nnx.split(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0))))
    wanted = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(abstract)}
    missing = sorted(n for n in wanted - set(tensors) if not n.endswith(("k_scale", "v_scale")))
    if missing:
        raise ValueError(f"{path}: the MTP head misses {len(missing)} tensor(s) (names under mtp.): "
                         f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    return loader.build(cfg, tensors, cfg.dtype, f"{path} (MTP head, names under mtp.)", cls=cls)


def forward_fn(target: Model, head: Model, *, impl: str | None = None, interpret: bool = False):
    """Pure `forward(target_params, head_params, arena, batch, hidden) -> (logits [B, V], the
    head's output [B, d], arena)` over an umem_jax.arena.Arena (MTPHead.__call__).  With a
    target and head split over a tp mesh (ShardedModel), the head runs under shard_map as the
    target's forward does: each device its weight slices and arena shard, the batch and the
    target's hidden replicated, logits and output leaving replicated."""
    tg, hg = target.graphdef, head.graphdef

    def local(tparams, hparams, data, plan, batch, hidden):
        t, h = nnx.merge(tg, tparams), nnx.merge(hg, hparams)
        return h(data, batch, plan, hidden, t, impl=impl, interpret=interpret)

    mesh = getattr(target, "mesh", None)
    if mesh is None:
        def forward(tparams, hparams, arena, batch: Batch, hidden):
            logits, y, data = local(tparams, hparams, arena.data, arena.plan, batch, hidden)
            return logits, y, arena.replace(data)

        return forward

    from jax.sharding import PartitionSpec as P

    from ..parallel.collectives import TP_AXIS
    from ..parallel.mesh import shard_map

    def forward(tparams, hparams, arena, batch: Batch, hidden):
        (tl, tt), (hl, ht) = jax.tree.flatten(tparams), jax.tree.flatten(hparams)

        def body(tl, hl, data, batch, hidden):
            logits, y, data = local(target._local_params(tl, tt), head._local_params(hl, ht), data[0], arena.plan,
                                    batch, hidden)
            return logits, y, data[None]

        sharded = shard_map(body, mesh, in_specs=(target._specs(), head._specs(), P(TP_AXIS), P(), P()),
                            out_specs=(P(), P(), P(TP_AXIS)))
        logits, y, data = sharded(tl, hl, arena.data, batch, hidden)
        return logits, y, arena.replace(data)

    return forward


__all__ = ["HEADS", "MTPHead", "NemotronHMTP", "QwenMTP", "forward_fn", "head_class", "load_head", "random_head",
           "read_tensors"]
