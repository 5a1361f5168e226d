"""Where the Qwen3.5-4B-like decode step (B=64, ctx 2048) spends its time beyond the bytes roofline.

    python3 -m benchmarks.bench_models --breakdown            # GPU, < 3 min
    python3 -m benchmarks.bench_models --breakdown --small    # CPU smoke (tiny shapes, meaningless times)

One model (random bf16 weights, made on the device), one arena, one batch of B requests at ctx
(page tables from the engine's allocator, as bench_models does); then the same donated step
compiled in variants, each timed (median of --trials runs of --iters back-to-back steps):

  full           the step with separate projections
  no_gdn         gated DeltaNet state kernels replaced by a stub (zeros out, arena untouched)
  no_attn        K/V write and paged decode attention stubbed
  no_head        LM head replaced by a [d, 128] projection (the final norm goes with it)
  no_kernels     no_gdn + no_attn: what remains is XLA (projections, norms, MLPs, glue)
  fused_proj     the step as the engine serves it: Model.fuse_projections() (attention q|k|v, MLP
                 gate|up, gated-DeltaNet qkv|z|b|a each one matmul: fewer, larger GEMM launches,
                 the same bytes), its logits checked against full's from the same state
and isolated kernels at the step's shapes: one GDN decode layer, one attention layer's decode
(K/V read at ctx), the LM head matmul.  The table gives ms, the difference to `full`, the bytes
each part must move and the rate that implies; the last line counts the kernels (fusions, custom
calls) of the compiled full step.  JSON to $OUT/model_breakdown.json (or --json).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from umem_jax.arena import Arena
from umem_jax.memory import plan as make_plan
from umem_jax.memory import size_arena
from umem_jax.models.config import FULL
from umem_jax.pallas_kernels._compat import silence_triton_deprecation
from umem_jax.pallas_kernels.gated_deltanet import gdn_decode, gdn_dims
from umem_jax.pallas_kernels.kv_write import write_kv
from umem_jax.pallas_kernels.paged_decode import paged_decode_attention

from .families import build_model, family_config
from .model_steps import Pager, decode_batch, param_counts, rel_err, step_costs
from .report import RowLog, json_path
from .copy_limit import copy_limit
from .timing import Chain, time_calls

GIB = 2**30
VARIANTS = ("full", "no_gdn", "no_attn", "no_head", "no_kernels", "fused_proj")


class patched:
    """Swap names the model modules look up at trace time; restore them on exit."""

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
    # A [d, 128] projection keeps the last layer's output live (XLA would drop it otherwise)
    # without reading the vocabulary-sized head.
    w = jnp.full((128, h.shape[-1]), 0.02, h.dtype)
    return jnp.einsum("...d,vd->...v", h, w).astype(jnp.float32)


def _kernel_swaps(kernel, stub) -> tuple:
    """(module, name, stub) for every loaded model module that calls `kernel` by a module-level
    name: the names its layers look up when the step is traced."""
    mods = [m for name, m in list(sys.modules.items()) if name.startswith("umem_jax.models") and m is not None]
    return tuple((m, n, stub) for m in mods for n, v in list(vars(m).items()) if v is kernel)


def swaps(model, variant: str) -> tuple:
    """The swaps of one variant; no_head patches the class in the model's MRO that defines logits."""
    gdn = _kernel_swaps(gdn_decode, _gdn_stub)
    attn = _kernel_swaps(paged_decode_attention, _attn_stub) + _kernel_swaps(write_kv, _write_stub)
    if variant == "no_head":
        owner = next(c for c in model.module_cls.__mro__ if "logits" in vars(c))
        return ((owner, "logits", _head_stub),)
    return {"no_gdn": gdn, "no_attn": attn, "no_kernels": gdn + attn}.get(variant, ())


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


class Setup:
    """The model, its plan and arena, the decode batch and the roofline of its step."""

    def __init__(self, a):
        self.cfg = cfg = family_config("qwen35", a.small)
        self.model = build_model(cfg)
        self.counts = param_counts(self.model.params)
        self.plan = make_plan(self.model.decls(), page_size=16)
        self.num_rows = size_arena(self.plan, int(a.arena_gib * GIB)).num_rows
        self.arena = Arena.create(self.plan, self.num_rows)
        self.B, self.ctx = a.batch, a.ctx
        self.batch = decode_batch(Pager(self.plan, self.num_rows), a.batch, a.ctx, cfg.vocab_size,
                                  -(-a.ctx // 16), seed=0)
        self.costs = step_costs(cfg, self.plan, self.counts["params"], self.counts["param_bytes"], B=a.batch, T=1,
                                start=a.ctx - 1)
        self.gdn_layers = [i for i, t in enumerate(cfg.layer_types) if t != FULL]
        self.attn_layers = [i for i, t in enumerate(cfg.layer_types) if t == FULL]
        sp, g = self.plan.state, self.kv_pool.geometry
        self.state_bytes = a.batch * sp.geometry.words * 2 * 2 if sp is not None else 0  # one layer, read + write
        self.kv_bytes = a.batch * a.ctx * (g.k_words + g.v_words) * 2  # one layer's read
        self.head_bytes = cfg.vocab_size * cfg.hidden_size * 2

    @property
    def kv_pool(self):
        return next(p for p in self.plan.token_pools)

    def attributed_bytes(self, variant: str):
        """Bytes of the part a variant leaves out (None: a variant that leaves nothing out)."""
        g = self.kv_pool.geometry
        return {"no_gdn": len(self.gdn_layers) * self.state_bytes,
                "no_attn": len(self.attn_layers) * (self.kv_bytes + self.B * (g.k_words + g.v_words) * 2),
                "no_head": self.head_bytes}.get(variant)

    def fresh_arena(self):
        return self.arena.replace(jnp.copy(self.arena.data))


def time_variant(s: Setup, name: str, a, steps: dict, log: RowLog):
    """Time one variant of the step on s.arena; the fused one is checked against full first."""
    model = s.model.fuse_projections() if name == "fused_proj" else s.model
    step = steps[name] = jax.jit(model.forward_fn(), donate_argnums=1)
    if name == "fused_proj":  # same logits as the unfused step, from the same state
        ref = steps.get("full") or jax.jit(s.model.forward_fn(), donate_argnums=1)
        want = np.asarray(ref(s.model.params, s.fresh_arena(), s.batch)[0])
        got = np.asarray(step(model.params, s.fresh_arena(), s.batch)[0])
        print(f"  fused_proj logits vs full: max rel err {rel_err(got, want):.2e}", flush=True)
    census = None
    with patched(*swaps(s.model, name)):
        def one(arena):
            logits, arena = step(model.params, arena, s.batch)
            return arena

        chain = Chain(one, s.arena)
        t = time_calls(chain, iters=a.iters, trials=a.trials, warmup=2)
        s.arena = chain.value
        if name == "full":
            census = kernel_census(step.lower(model.params, s.arena, s.batch).compile())
    log.add(dict(part=name, ms=t.median * 1e3, first_call_s=t.first_s, bytes=s.attributed_bytes(name)))
    print(f"  {name:<12} {t.median * 1e3:8.3f} ms  (first call {t.first_s:.1f} s)", flush=True)
    return census


def isolated_kernels(s: Setup, a, deadline: float, log: RowLog) -> None:
    """One GDN layer, one attention layer and the LM head alone, at the step's shapes."""
    def iso(name, fn, nbytes, count):
        if time.time() > deadline:
            print(f"  {name:<12} skipped: --budget reached", flush=True)
            return
        try:
            ms = time_calls(fn, iters=a.iters, trials=a.trials, warmup=2).median
        except Exception as e:  # noqa: BLE001
            print(f"  {name:<12} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            return
        log.add(dict(part=name, ms=ms * 1e3, bytes=nbytes, tbps=nbytes / ms / 1e12, per_step_ms=ms * 1e3 * count,
                     count=count))
        print(f"  {name:<12} {ms * 1e3:8.3f} ms x {count} per step = {ms * 1e3 * count:.3f} ms; "
              f"{nbytes / ms / 1e12:.2f} TB/s over {nbytes / 1e6:.1f} MB", flush=True)

    cfg, B, key = s.cfg, s.B, jax.random.key(1)
    if s.plan.state is not None:  # random layer weights of the layer's shapes: the kernel's time, not its values
        view = s.plan.state.state_view(s.gdn_layers[0])
        d = gdn_dims(view)
        conv_w = 0.5 * jax.random.normal(key, (d.conv_dim, d.conv_kernel), jnp.bfloat16)
        alog = 0.5 * jax.random.normal(key, (d.v_heads,), jnp.float32)
        dtb = 0.5 * jax.random.normal(jax.random.fold_in(key, 1), (d.v_heads,), jnp.float32)
        qkv = jax.random.normal(key, (B, d.conv_dim), jnp.bfloat16)
        ab = jax.random.normal(key, (B, d.v_heads), jnp.bfloat16)
        slots = s.batch.state_slots
        gdn_fn = jax.jit(lambda ar: gdn_decode(ar, slots, qkv, ab, ab, conv_w, alog, dtb, view=view), donate_argnums=0)

        def gdn_run():
            o, data = gdn_fn(s.arena.data)
            s.arena = s.arena.replace(data)
            return o
        iso("gdn_layer", gdn_run, s.state_bytes, len(s.gdn_layers))
    kv_view = s.kv_pool.kv_view(s.attn_layers[0])
    q = jax.random.normal(key, (B, cfg.num_heads, cfg.head_dim), jnp.bfloat16)
    table = s.batch.page_tables[s.kv_pool.name]
    attn_fn = jax.jit(lambda ar: paged_decode_attention(q, ar, table, s.batch.kv_lens, view=kv_view,
                                                        scale=cfg.head_dim ** -0.5))
    iso("attn_layer", lambda: attn_fn(s.arena.data), s.kv_bytes, len(s.attn_layers))
    h = jax.random.normal(key, (B, cfg.hidden_size), jnp.bfloat16)
    emb = jax.random.normal(key, (cfg.vocab_size, cfg.hidden_size), jnp.bfloat16)  # the head's bytes
    head_fn = jax.jit(lambda w: jnp.einsum("bd,vd->bv", h, w).astype(jnp.float32))
    iso("lm_head", lambda: head_fn(emb), s.head_bytes, 1)


def print_table(s: Setup, rows: list[dict], roof: float, copy_bw: float, seconds: float) -> None:
    full = next((r["ms"] for r in rows if r["part"] == "full"), None)
    print(f"\n== qwen3.5-4b-like decode B={s.B} ctx={s.ctx} ({seconds:.0f} s; copy {copy_bw / 1e12:.2f} TB/s) ==")
    print(f"{'part':<12} {'ms':>8} {'full - part':>12} {'bytes MB':>9} {'TB/s':>6}")
    for r in rows:
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


def parse(argv):
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.bench_models --breakdown",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--arena-gib", type=float, default=12.0)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--budget", type=float, default=160.0, help="seconds; no new variant starts past it")
    ap.add_argument("--small", action="store_true", help="tiny shapes, reference kernels (CPU smoke)")
    ap.add_argument("--json", default=None, help="rows here (default $OUT/model_breakdown.json if $OUT is set)")
    a = ap.parse_args(argv)
    if a.small:
        a.batch, a.ctx, a.arena_gib, a.iters, a.trials = 2, 64, 1 / 32, 1, 1
    return a


def main(argv=None) -> int:
    a = parse(argv)
    silence_triton_deprecation()
    t0 = time.time()
    deadline = t0 + a.budget
    s = Setup(a)
    copy = copy_limit((4 << 20) if a.small else (4 << 30), iters=10, trials=3)
    roof = s.costs["total_bytes"] / copy.bytes_per_s
    log = RowLog(json_path(a.json, "model_breakdown"), jax=jax.__version__, device=jax.devices()[0].device_kind)
    print(f"qwen3.5-4b-like decode B={s.B} ctx={s.ctx}: {s.counts['params'] / 1e9:.2f} B params; roofline "
          f"{roof * 1e3:.3f} ms ({s.costs['total_bytes'] / 1e9:.2f} GB at {copy.tbps:.2f} TB/s); setup "
          f"{time.time() - t0:.0f} s", flush=True)
    census, steps = None, {}
    for name in a.variants.split(","):
        if time.time() > deadline:
            print(f"  {name:<12} skipped: --budget reached", flush=True)
            continue
        try:
            census = time_variant(s, name, a, steps, log) or census
        except Exception as e:  # noqa: BLE001 - one GPU call: report and go on
            print(f"  {name:<12} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            if getattr(s.arena.data, "is_deleted", lambda: False)():
                s.arena = Arena.create(s.plan, s.num_rows)
    isolated_kernels(s, a, deadline, log)
    print_table(s, log.rows, roof, copy.bytes_per_s, time.time() - t0)
    if census:
        print("kernels in the compiled full step:", census, "total", sum(census.values()))
        log.add(dict(part="census", kernels=census))
    log.add(dict(part="meta", batch=s.B, ctx=s.ctx, roofline_ms=roof * 1e3, copy_bytes_per_s=copy.bytes_per_s,
                 costs=s.costs))
    return 0
