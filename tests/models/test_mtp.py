"""MTP heads (models/mtp.py): config fields, loading the `mtp.*` tensors of each family (both MoE
expert layouts, NemotronH's names), the cache-free forward against a plain-JAX transcription of
the head's definition, and the serving forward over the arena (its K/V fused into the target's
full-attention envelopes, chunked prefill then decode) against the cache-free one, fp32 <= 1e-4.
The checkpoints: the committed family fixtures plus random mtp.* tensors (tests/_mtp_fixtures.py)."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _model_arena import HandPager  # noqa: E402
from _mtp_fixtures import FIXTURES, write_mtp_checkpoint  # noqa: E402

from umem_jax.arena import Arena  # noqa: E402
from umem_jax.core.batch import make_batch  # noqa: E402
from umem_jax.engine.speculative import plan_decls  # noqa: E402
from umem_jax.memory import plan as make_plan  # noqa: E402
from umem_jax.models import mtp  # noqa: E402
from umem_jax.models.config import FULL  # noqa: E402
from umem_jax.models.loader import load_model  # noqa: E402
from umem_jax.models.nemotron_h import MOE_BLOCK, nemotron_h_config  # noqa: E402
from umem_jax.models.qwen3_5 import qwen3_5_config  # noqa: E402

RTOL = 1e-4
FAMILIES = ["qwen3_5_tiny", "qwen3_next_tiny", "nemotron_h_moe_tiny"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return functools.cache(lambda name: write_mtp_checkpoint(root, name))


@functools.cache
def _models(path: Path):
    target = load_model(path)
    return target, mtp.load_head(target)


def _rel(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def _dense_hidden(target, toks):
    """The target's final-normed hidden at every position, cache-free: what the head reads."""
    def run(params, toks):
        t = nnx.merge(target.graphdef, params)
        pos = jnp.broadcast_to(jnp.arange(toks.shape[1], dtype=jnp.int32), toks.shape)
        h = t.embed(toks)
        for layer in t.layers:
            h = layer.dense(h, pos, jnp.ones(toks.shape, bool))
        return t.final_norm(h)

    return jax.jit(run)(target.params, toks)


def _dense_head(target, head, nxt, hidden):
    """The head's cache-free forward -> logits [B, T, V]."""
    run = lambda tp, hp, nxt, hidden: nnx.merge(head.graphdef, hp).dense(nxt, hidden, nnx.merge(target.graphdef, tp))[0]
    return jax.jit(run)(target.params, head.params, nxt, hidden)


# ----------------------------------------------------------------------------- config


def test_config_declares_the_mtp_layers():
    base = json.loads((FIXTURES / "qwen3_5_tiny" / "config.json").read_text())
    assert qwen3_5_config(base).mtp_num_layers == 0 and qwen3_5_config(base).mtp_layer_types == ()
    cfg = qwen3_5_config({**base, "mtp_num_hidden_layers": 1})
    assert (cfg.mtp_num_layers, cfg.mtp_layer_types) == (1, (FULL,))
    nem = json.loads((FIXTURES / "nemotron_h_moe_tiny" / "config.json").read_text())
    assert nemotron_h_config(nem).mtp_layer_types == ()  # num_nextn_predict_layers 0 in the fixture
    for extra in ({"mtp_layers_block_type": ["attention", "moe"]}, {"mtp_hybrid_override_pattern": "*E"},
                  {"mtp_layers_block_type": None}):  # transformers' default: attention, moe
        cfg = nemotron_h_config({**nem, "num_nextn_predict_layers": 1, **extra})
        assert (cfg.mtp_num_layers, cfg.mtp_layer_types) == (1, (FULL, MOE_BLOCK)), extra


# ----------------------------------------------------------------------------- loading


def test_head_declares_fused_kv_and_loads_each_expert_layout(ckpt, tmp_path):
    """The head's one attention layer declares the target's full-attention geometry (so it fuses
    into the target's envelope, model "draft"); per-expert checkpoint tensors load like fused ones."""
    from safetensors.numpy import load_file, save_file

    path = ckpt("qwen3_5_moe_tiny")
    target, head = _models(path)
    p = make_plan(plan_decls(target.decls("float32"), head, "float32"), page_size=4)
    assert [sp.name for sp in p.subpools] == ["state", "full"]
    assert p["full"].layers == (("target", 2), ("draft", 0))
    d = tmp_path / "per_expert"
    d.mkdir()
    (d / "config.json").write_text((path / "config.json").read_text())
    t = load_file(path / "model.safetensors")
    gate_up, down = t.pop("mtp.layers.0.mlp.experts.gate_up_proj"), t.pop("mtp.layers.0.mlp.experts.down_proj")
    inter = gate_up.shape[1] // 2
    for j in range(gate_up.shape[0]):
        t[f"mtp.layers.0.mlp.experts.{j}.gate_proj.weight"] = gate_up[j, :inter]
        t[f"mtp.layers.0.mlp.experts.{j}.up_proj.weight"] = gate_up[j, inter:]
        t[f"mtp.layers.0.mlp.experts.{j}.down_proj.weight"] = down[j]
    save_file(t, d / "model.safetensors")
    other = mtp.load_head(target, d)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), head.params, other.params))


def test_missing_mtp_weights_are_named(ckpt, tmp_path):
    from safetensors.numpy import load_file, save_file

    target, _ = _models(ckpt("qwen3_5_tiny"))
    with pytest.raises(ValueError, match="declares no MTP layers"):
        mtp.load_head(load_model(FIXTURES / "qwen3_5_tiny"))
    with pytest.raises(ValueError, match="UmemTinyHybrid has no MTP layers"):
        mtp.load_head(load_model("tiny-attention"))
    d = tmp_path / "partial"
    d.mkdir()
    (d / "config.json").write_text((ckpt("qwen3_5_tiny") / "config.json").read_text())
    t = load_file(ckpt("qwen3_5_tiny") / "model.safetensors")
    del t["mtp.norm.weight"], t["mtp.layers.0.self_attn.k_proj.weight"]
    save_file(t, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"misses 2 tensor\(s\) .*layers.0.self_attn.k_proj.weight, norm.weight"):
        mtp.load_head(target, d)
    save_file({k: v for k, v in t.items() if not k.startswith("mtp.")}, d / "model.safetensors")
    with pytest.raises(ValueError, match="has no MTP weights"):
        mtp.load_head(target, d)


# ----------------------------------------------------------------------------- forwards


def _plain_qwen_head(target, head, nxt, hidden):
    """The head's definition written out for Qwen3.5 (module docstring): zero-centred norms,
    fc over [embedding | hidden], the layer, the head's norm, the tied LM head."""
    t, h = nnx.merge(target.graphdef, target.params), nnx.merge(head.graphdef, head.params)

    def norm(x, w, eps=target.config.rms_norm_eps):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * (1 + w)

    emb = t.embed_tokens.weight[...]
    x = jnp.concatenate([norm(emb[nxt], h.pre_fc_norm_embedding.weight[...]),
                         norm(hidden, h.pre_fc_norm_hidden.weight[...])], -1) @ h.fc.weight[...].T
    pos = jnp.broadcast_to(jnp.arange(nxt.shape[1]), nxt.shape)
    x = h.layers[0].dense(x, pos, jnp.ones(nxt.shape, bool))
    return norm(x, h.norm.weight[...]) @ emb.T


def test_dense_head_is_its_definition(ckpt):
    target, head = _models(ckpt("qwen3_5_tiny"))
    toks = jnp.asarray(np.random.default_rng(0).integers(3, 128, (2, 12)), jnp.int32)
    hidden = _dense_hidden(target, toks)
    logits = _dense_head(target, head, toks[:, 1:], hidden[:, :-1])
    want = jax.jit(functools.partial(_plain_qwen_head, target, head))(toks[:, 1:], hidden[:, :-1])
    assert _rel(logits, want) < 1e-5


@pytest.mark.parametrize("name", FAMILIES)
def test_head_over_the_arena_is_the_dense_head(ckpt, name):
    """A 21-token prompt in chunks of 8 (the last one partial), then 3 decode steps: at each
    call the head's logits at the row's last token equal the cache-free head's there.  The
    arena starts NaN-filled, so a read of anything the head did not write shows."""
    target, head = _models(ckpt(name))
    L, steps, chunk = 21, 3, 8
    seq = np.random.default_rng(1).integers(3, target.config.vocab_size, L + steps + 1).astype(np.int32)
    hidden = _dense_hidden(target, jnp.asarray(seq[None, :-1]))
    want = np.asarray(_dense_head(target, head, jnp.asarray(seq[None, 1:]), hidden)[0])
    plan = make_plan(plan_decls(target.decls("float32"), head, "float32"), page_size=4)
    arena = Arena.create(plan, 2048, dtype="uint16", debug_nan=True)
    fwd = jax.jit(target.forward_fn(plan, hidden=True), donate_argnums=1)
    hfwd = jax.jit(mtp.forward_fn(target, head), donate_argnums=2)
    pager = HandPager(plan, 2048)
    start = 0
    while start < L + steps:
        end = min(start + chunk, L) if start < L else start + 1
        t = chunk if start < L else 1
        toks, nxt = np.zeros((2, t), np.int32), np.zeros((2, t), np.int32)
        toks[0, :end - start], nxt[0, :end - start] = seq[start:end], seq[start + 1:end + 1]
        pager.ensure(0, end)
        tables = pager.table([0, None], 8)
        slots = np.array([pager.slot(0), 0], np.int32)
        batch = make_batch(toks, [end - start, 0], [end, 0], tables, slots)
        (_, hid), arena = fwd(target.params, arena, batch)
        logits, _, arena = hfwd(target.params, head.params, arena, make_batch(nxt, [end - start, 0], [end, 0],
                                                                               tables, slots), hid)
        assert _rel(np.asarray(logits[0]), want[end - 1]) < RTOL, (name, start, end)
        assert np.isfinite(np.asarray(logits[1])).all()  # the padding row
        start = end
