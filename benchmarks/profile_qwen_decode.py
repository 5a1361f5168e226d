"""Where the Qwen3.5-4B-like decode step (B=64, ctx 2048) spends its time beyond the bytes roofline.

    PYTHONPATH=$PWD python3 benchmarks/profile_qwen_decode.py            # GPU, < 3 min
    PYTHONPATH=$PWD python3 benchmarks/profile_qwen_decode.py --small    # CPU smoke (tiny shapes, meaningless times)

One model (random bf16 weights, made on the device), one arena, one batch of B requests at ctx
(page tables from the engine's allocator, as bench_models does); then the same donated step
compiled in variants, each timed (median of --trials runs of --iters back-to-back steps):

  full           the step with separate projections (as served before Model.fuse_projections)
  no_gdn         gated DeltaNet state kernels replaced by a stub (zeros out, arena untouched)
  no_attn        K/V write and paged decode attention stubbed
  no_head        LM head replaced by a [B, 128] slice of it
  no_kernels     no_gdn + no_attn: what remains is XLA (projections, norms, MLPs, glue)
  fused_proj     full, with each GDN layer's four input projections (qkv, z, b, a) as one matmul
                 and each MLP's gate/up as one, over weights concatenated once before timing
                 (fewer, larger GEMM launches; the same bytes).  The engine now serves this way
                 (plus attention q|k|v), see Model.fuse_projections
and isolated kernels at the step's shapes: one GDN decode layer, one attention layer's decode
(K/V read at ctx), the LM head matmul.  The table gives ms, the difference to `full`, the bytes
each part must move and the rate that implies; the last line counts the kernels (fusions, custom
calls) of the compiled full step.  JSON to $OUT/profile_qwen_decode.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_models as bm  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from umem_jax.arena import Arena  # noqa: E402
from umem_jax.memory import plan as make_plan  # noqa: E402
from umem_jax.memory import size_arena
from umem_jax.models import gdn_mixer, gemma3, layers, qwen3_5  # noqa: E402
from umem_jax.models.registry import build_random  # noqa: E402
from umem_jax.pallas_kernels._compat import silence_triton_deprecation  # noqa: E402
from umem_jax.pallas_kernels.gated_deltanet import gdn_decode, gdn_dims  # noqa: E402
from umem_jax.pallas_kernels.paged_decode import paged_decode_attention  # noqa: E402

GIB = 2**30
ROWS: list[dict] = []


def _flush():
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "profile_qwen_decode.json"), "w") as f:
            json.dump(ROWS, f, indent=1, default=str)


def random_params(abstract_params, seed: int = 0):
    """Device weights of the abstract tree: N(0, 0.02) in each leaf's dtype, made in one jit."""
    leaves, tree = jax.tree.flatten(abstract_params)

    def make(key):
        keys = jax.random.split(key, len(leaves))
        return [(0.02 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype) for k, x in zip(keys, leaves)]

    return jax.tree.unflatten(tree, jax.jit(make)(jax.random.key(seed, impl="rbg")))


# ------------------------------------------------------------------------------- variants
# Each variant swaps names the model modules look up at trace time; `patched` restores them.


class patched:
    def __init__(self, *swaps):
        self.swaps = swaps  # (object, attribute, replacement)

    def __enter__(self):
        self.saved = [(o, n, getattr(o, n)) for o, n, _ in self.swaps]
        for o, n, v in self.swaps:
            setattr(o, n, v)

    def __exit__(self, *exc):
        for o, n, v in self.saved:
            setattr(o, n, v)


def _gdn_stub(arena, slots, qkv, a, b, conv_weight, A_log, dt_bias, *, view, **kw):
    d = gdn_dims(view)
    return jnp.zeros((slots.shape[0], d.v_heads, d.v_dim), qkv.dtype), arena


def _attn_stub(q, arena, page_table, lengths, *, view, **kw):
    return jnp.zeros((q.shape[0], q.shape[1], view.v_head_dim), q.dtype)


def _write_stub(arena, k, v, pages, slots, *, view, **kw):
    return arena


def _head_stub(self, h):
    head = self.lm_head if self.lm_head is not None else self.embed_tokens
    return jnp.einsum("...d,vd->...v", self.norm(h), head.weight[...][:128]).astype(jnp.float32)


# fused_proj: concatenated weights are handed to the step as an extra argument and consumed in
# layer order while tracing (each GDN layer pops one [qkv|z|b|a] matrix, each MLP one [gate|up]).
_FUSED = {"gdn": [], "mlp": []}


def _gdn_fused_call(self, x, arena, batch, slot):
    w = _FUSED["gdn"].pop(0)
    y = jnp.einsum("...i,oi->...o", x, w)
    c = 2 * self.key_dim + self.value_dim
    qkv, z = y[..., :c], y[..., c:c + self.value_dim]
    b, a = y[..., c + self.value_dim:c + self.value_dim + self.v_heads], y[..., c + self.value_dim + self.v_heads:]
    o, arena = gdn_mixer.gdn_decode(arena, batch.state_slots, qkv[:, 0], a[:, 0], b[:, 0], self.conv1d.kernel_weight,
                                    self.A_log[...], self.dt_bias[...], view=slot.view, **slot.kernel_kw)
    bsz, t = x.shape[:2]
    o = self.norm(o[:, None].astype(x.dtype), z.reshape(bsz, t, self.v_heads, self.v_dim))
    return self.out_proj(o.reshape(bsz, t, self.value_dim)), arena


def _mlp_fused_call(self, x):
    w = _FUSED["mlp"].pop(0)
    gu = jnp.einsum("...i,oi->...o", x, w)
    n = gu.shape[-1] // 2
    return self.down_proj(layers.activation(self.act)(gu[..., :n]) * gu[..., n:])


def fused_weights(model):
    """([qkv|z|b|a] per GDN layer, [gate|up] per layer), concatenated once on the device."""
    m = nnx.merge(model.graphdef, model.params)
    gdn, mlp = [], []
    for layer in m.layers:
        if hasattr(layer, "linear_attn") and layer.kind != qwen3_5.FULL:
            g = layer.linear_attn
            gdn.append([g.in_proj_qkv.weight[...], g.in_proj_z.weight[...], g.in_proj_b.weight[...],
                        g.in_proj_a.weight[...]])
        mlp.append([layer.mlp.gate_proj.weight[...], layer.mlp.up_proj.weight[...]])
    cat = jax.jit(lambda ws: [jnp.concatenate(w, axis=0) for w in ws])
    return cat(gdn), cat(mlp)


def variant_step(model, name: str):
    """-> (jitted step(params, extra, arena, batch), the context manager of its swaps)."""
    forward = model.forward_fn()
    swaps = {
        "full": (),
        "no_gdn": ((gdn_mixer, "gdn_decode", _gdn_stub),),
        "no_attn": ((qwen3_5, "paged_decode_attention", _attn_stub), (qwen3_5, "write_kv", _write_stub)),
        "no_head": ((gemma3.Gemma3ForCausalLM, "logits", _head_stub),),
        "no_kernels": ((gdn_mixer, "gdn_decode", _gdn_stub), (qwen3_5, "paged_decode_attention", _attn_stub),
                       (qwen3_5, "write_kv", _write_stub)),
        "fused_proj": ((gdn_mixer.GatedDeltaNet, "__call__", _gdn_fused_call),
                       (layers.MLP, "__call__", _mlp_fused_call)),
    }[name]

    def step(params, extra, arena, batch):
        if extra is not None:
            _FUSED["gdn"], _FUSED["mlp"] = list(extra[0]), list(extra[1])
        return forward(params, arena, batch)

    return jax.jit(step, donate_argnums=2), patched(*swaps)


def timed(fn, args_fn, *, iters: int, trials: int, warmup: int = 2):
    """fn(*args_fn()) back to back; args_fn hands the newest arena.  -> (median s, first-call s)."""
    t = time.perf_counter()
    jax.block_until_ready(fn(*args_fn()))
    first = time.perf_counter() - t
    for _ in range(warmup):
        jax.block_until_ready(fn(*args_fn()))
    per = []
    for _ in range(trials):
        t = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args_fn())
        jax.block_until_ready(out)
        per.append((time.perf_counter() - t) / iters)
    return float(np.median(per)), first


def kernel_census(compiled) -> dict:
    """Kernels the entry computation launches, by kind (a rough count: fusions, custom calls, loops)."""
    hlo = compiled.as_text()
    entry = hlo[hlo.find("\nENTRY"):]
    out: dict[str, int] = {}
    for line in entry.splitlines()[1:]:
        if line.startswith("}"):
            break
        for op in ("fusion(", "custom-call(", "while(", "copy(", "all-reduce("):
            if f" {op}" in line:
                key = op[:-1]
                if op == "custom-call(":
                    tgt = line.split('custom_call_target="', 1)[-1].split('"', 1)[0]
                    key = f"custom-call:{tgt[:40]}"
                out[key] = out.get(key, 0) + 1
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--arena-gib", type=float, default=12.0)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--variants", default="full,no_gdn,no_attn,no_head,no_kernels,fused_proj")
    ap.add_argument("--budget", type=float, default=160.0, help="seconds; no new variant starts past it")
    ap.add_argument("--small", action="store_true", help="tiny shapes, reference kernels (CPU smoke)")
    a = ap.parse_args(argv)
    silence_triton_deprecation()
    t0 = time.time()
    deadline = t0 + a.budget
    cfg = bm.qwen3_5_4b_like("bfloat16")
    if a.small:
        cfg = bm._qwen_tiny(cfg)
        a.batch, a.ctx, a.arena_gib, a.iters, a.trials = 2, 64, 1 / 32, 1, 1
    abstract = build_random(cfg, cfg.dtype, abstract=True)
    model = bm.Model(cfg, abstract.graphdef, random_params(abstract.params), abstract.module_cls)
    counts = dict(params=sum(x.size for x in jax.tree.leaves(model.params)),
                  param_bytes=sum(x.nbytes for x in jax.tree.leaves(model.params)))
    plan = make_plan(model.decls(), page_size=16)
    num_rows = size_arena(plan, int(a.arena_gib * GIB)).num_rows
    state = {"arena": Arena.create(plan, num_rows)}
    copy_bw = bm.measure_copy(a.small, trials=3)
    B, ctx, width = a.batch, a.ctx, -(-a.ctx // 16)
    pager = bm.Pager(plan, num_rows)
    reqs = [pager.new() for _ in range(B)]
    for r in reqs:
        pager.extend(r, ctx - 1, ctx)
    toks = np.random.default_rng(0).integers(1, cfg.vocab_size, size=(B, 1))
    batch = pager.batch(reqs, toks, [1] * B, [ctx] * B, width)
    costs = bm.step_costs(cfg, plan, counts["params"], counts["param_bytes"], B=B, T=1, start=ctx - 1)
    roof = costs["total_bytes"] / copy_bw
    print(f"qwen3.5-4b-like decode B={B} ctx={ctx}: {counts['params'] / 1e9:.2f} B params; roofline "
          f"{roof * 1e3:.3f} ms ({costs['total_bytes'] / 1e9:.2f} GB at {copy_bw / 1e12:.2f} TB/s); setup "
          f"{time.time() - t0:.0f} s", flush=True)

    gdn_layers = [i for i, t in enumerate(cfg.layer_types) if t != qwen3_5.FULL]
    attn_layers = [i for i, t in enumerate(cfg.layer_types) if t == qwen3_5.FULL]
    sp = plan.state
    state_bytes = B * sp.geometry.words * 2 * 2 if sp is not None else 0          # one layer, read + write
    kv_pool = next(p for p in plan.token_pools)
    g = kv_pool.geometry
    kv_bytes = B * ctx * (g.k_words + g.v_words) * 2                                  # one layer's read
    head_bytes = cfg.vocab_size * cfg.hidden_size * 2
    attribution = {"no_gdn": len(gdn_layers) * state_bytes, "no_attn": len(attn_layers) * (kv_bytes + B * (
        g.k_words + g.v_words) * 2), "no_head": head_bytes, "no_kernels": None, "fused_proj": None, "full": None}
    extra_fused = None
    census = None
    steps = {}
    for name in a.variants.split(","):
        if time.time() > deadline:
            print(f"  {name:<12} skipped: --budget reached", flush=True)
            continue
        try:
            step, swaps = variant_step(model, name)
            steps[name] = step
            extra = None
            if name == "fused_proj":
                extra_fused = extra_fused or fused_weights(model)
                extra = extra_fused
            if name == "fused_proj":  # same logits as the step as served, from the same state
                fresh = lambda: state["arena"].replace(jnp.copy(state["arena"].data))
                ref_step = steps.get("full") or variant_step(model, "full")[0]
                want = np.asarray(ref_step(model.params, None, fresh(), batch)[0])
                with swaps:
                    got = np.asarray(step(model.params, extra, fresh(), batch)[0])
                err = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
                print(f"  fused_proj logits vs full: max rel err {err:.2e}", flush=True)
            with swaps:
                def args():
                    return model.params, extra, state["arena"], batch

                def run(*xs):
                    logits, state["arena"] = step(*xs)
                    return logits

                ms, first = timed(run, args, iters=a.iters, trials=a.trials)
                if name == "full":
                    census = kernel_census(step.lower(model.params, None, state["arena"], batch).compile())
        except Exception as e:  # noqa: BLE001 - one GPU call: report and go on
            print(f"  {name:<12} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            if getattr(state["arena"].data, "is_deleted", lambda: False)():
                state["arena"] = Arena.create(plan, num_rows)
            continue
        row = dict(part=name, ms=ms * 1e3, first_call_s=first, bytes=attribution.get(name))
        ROWS.append(row)
        _flush()
        print(f"  {name:<12} {ms * 1e3:8.3f} ms  (first call {first:.1f} s)", flush=True)

    # ---- isolated kernels at the step's shapes
    def iso(name, fn, args_fn, nbytes, count):
        if time.time() > deadline:
            print(f"  {name:<12} skipped: --budget reached", flush=True)
            return
        try:
            ms, _ = timed(fn, args_fn, iters=a.iters, trials=a.trials)
        except Exception as e:  # noqa: BLE001
            print(f"  {name:<12} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            return
        row = dict(part=name, ms=ms * 1e3, bytes=nbytes, tbps=nbytes / ms / 1e12, per_step_ms=ms * 1e3 * count,
                   count=count)
        ROWS.append(row)
        _flush()
        print(f"  {name:<12} {ms * 1e3:8.3f} ms x {count} per step = {ms * 1e3 * count:.3f} ms; "
              f"{nbytes / ms / 1e12:.2f} TB/s over {nbytes / 1e6:.1f} MB", flush=True)

    key = jax.random.key(1)
    slots = batch.state_slots
    if sp is not None:
        view = sp.state_view(gdn_layers[0])
        gl = nnx.merge(model.graphdef, model.params).layers[gdn_layers[0]].linear_attn
        conv_w, alog, dtb = gl.conv1d.kernel_weight, gl.A_log[...], gl.dt_bias[...]
        qkv = jax.random.normal(key, (B, 2 * gl.key_dim + gl.value_dim), jnp.bfloat16)
        ab = jax.random.normal(key, (B, gl.v_heads), jnp.bfloat16)
        gdn_fn = jax.jit(lambda ar: gdn_decode(ar, slots, qkv, ab, ab, conv_w, alog, dtb, view=view), donate_argnums=0)

        def gdn_run(ar):
            o, data = gdn_fn(ar)
            state["arena"] = state["arena"].replace(data)
            return o
        iso("gdn_layer", gdn_run, lambda: (state["arena"].data,), state_bytes, len(gdn_layers))
    kv_view = kv_pool.kv_view(attn_layers[0])
    q = jax.random.normal(key, (B, cfg.num_heads, cfg.head_dim), jnp.bfloat16)
    table = batch.page_tables[kv_pool.name]
    attn_fn = jax.jit(lambda ar: paged_decode_attention(q, ar, table, batch.kv_lens, view=kv_view,
                                                        scale=cfg.head_dim ** -0.5))
    iso("attn_layer", attn_fn, lambda: (state["arena"].data,), kv_bytes, len(attn_layers))
    h = jax.random.normal(key, (B, cfg.hidden_size), jnp.bfloat16)
    emb = nnx.merge(model.graphdef, model.params).embed_tokens.weight[...]
    head_fn = jax.jit(lambda w: jnp.einsum("bd,vd->bv", h, w).astype(jnp.float32))
    iso("lm_head", head_fn, lambda: (emb,), head_bytes, 1)

    full = next((r["ms"] for r in ROWS if r["part"] == "full"), None)
    print(f"\n== qwen3.5-4b-like decode B={B} ctx={ctx} ({time.time() - t0:.0f} s; copy {copy_bw / 1e12:.2f} TB/s) ==")
    print(f"{'part':<12} {'ms':>8} {'full - part':>12} {'bytes MB':>9} {'TB/s':>6}")
    for r in ROWS:
        if r["part"] == "copy":
            continue
        whole_step = full is not None and "per_step_ms" not in r and r["part"] != "full"
        diff = f"{full - r['ms']:12.3f}" if whole_step else " " * 12
        rate = ""
        if r.get("tbps"):
            rate = f"{r['tbps']:6.2f}"
        elif r.get("bytes") and full is not None and full > r["ms"]:
            rate = f"{r['bytes'] / ((full - r['ms']) * 1e-3) / 1e12:6.2f}"
        nb = f"{r['bytes'] / 1e6:9.1f}" if r.get("bytes") else " " * 9
        print(f"{r['part']:<12} {r['ms']:8.3f} {diff} {nb} {rate}")
    print(f"roofline {roof * 1e3:.3f} ms; full / roofline {full / (roof * 1e3):.2f}" if full else "")
    if census:
        print("kernels in the compiled full step:", census, "total", sum(census.values()))
        ROWS.append(dict(part="census", kernels=census))
    META = dict(batch=B, ctx=ctx, roofline_ms=roof * 1e3, copy_bytes_per_s=copy_bw, costs=costs)
    ROWS.append(dict(part="meta", **META))
    _flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
