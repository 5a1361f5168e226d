"""The MoE block (models/moe.py): the router against a plain numpy re-derivation of each scoring
mode, the sort + ragged_dot dispatch and the gather path against the dense per-token reference
(moe_reference) in fp32 and bf16, padding rows, and a jitted block with no host round trip; the
few-rows Pallas expert GEMV path ("rows") the same way.

Fresh random weights and inputs per case (seeded parametrisations); every expert and router
bias is set to random values, since the zero init would hide a bias that is dropped or doubled.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from umem_jax.models import experts as experts_lib
from umem_jax.models import router as router_lib
from umem_jax.models.moe import MoE, MoEConfig, expert_activation, moe_reference, route, route_weights
from umem_jax.pallas_kernels import dispatch_plan as plan_lib
from umem_jax.pallas_kernels.dispatch_plan import PLAN_ENV
from umem_jax.pallas_kernels.route_topk import ROUTER_DOT_ENV

HIDDEN = 32


def build(cfg: MoEConfig, seed: int, dtype=jnp.float32, hidden: int = HIDDEN) -> MoE:
    """A block with every parameter random (biases included), std chosen so activations are O(1).
    Built abstractly and filled from numpy: no device program per weight shape."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(hidden, cfg, dtype=dtype, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    leaves = []
    for leaf in jax.tree.leaves(state):
        std = 1.0 / np.sqrt(leaf.shape[-2]) if leaf.ndim >= 2 else 0.5
        leaves.append(jnp.asarray(std * rng.standard_normal(leaf.shape, np.float32)).astype(leaf.dtype))
    return nnx.merge(graphdef, jax.tree.unflatten(jax.tree.structure(state), leaves))


def inputs(seed: int, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32)).astype(dtype)


def jitted(fn, m: MoE, *args, **kw):
    """fn(m, *args) under one jit (one compile per case, instead of one per eager op)."""
    graphdef, state = nnx.split(m)
    return jax.jit(lambda state, *args: fn(nnx.merge(graphdef, state), *args, **kw))(state, *args)


def block(m, x, valid=None):
    return m(x, valid)


def use_path(monkeypatch, path: str) -> None:
    """Make the block's default dispatch take `path` ("ragged", "pallas" interpreted: the argsort
    and tile metadata, "planned": the Pallas path with dispatch_plan ordering the rows, "gather")."""
    monkeypatch.setattr(experts_lib, "GATHER_ROWS", 10**9 if path == "gather" else 0)
    grouped = {"gather": None, "planned": "pallas"}.get(path, path)
    monkeypatch.setattr(experts_lib, "GROUPED_PATH", grouped)
    monkeypatch.setenv(PLAN_ENV, "pallas" if path == "planned" else "xla")


def rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


# ----------------------------------------------------------------------------- configs

BASE = {"num_experts": 8, "top_k": 2, "intermediate_size": 16}
CONFIGS = {
    "qwen_softmax": MoEConfig(**BASE),
    "softmax_unnormed_scaled": MoEConfig(**BASE, norm_topk_prob=False, routed_scaling_factor=2.5),
    "qwen_next_shared_gate": MoEConfig(**BASE, shared_intermediate_size=24, shared_expert_gate=True),
    "shared_no_gate": MoEConfig(**BASE, shared_intermediate_size=24),
    "gpt_oss": MoEConfig(num_experts=7, top_k=3, intermediate_size=16, scoring="topk_softmax", router_bias=True,
                         expert_kind="gpt_oss", expert_bias=True, swiglu_limit=1.5),
    "nemotron_sigmoid_grouped": MoEConfig(num_experts=12, top_k=3, intermediate_size=16, scoring="sigmoid",
                                          score_correction_bias=True, n_group=4, topk_group=2,
                                          routed_scaling_factor=1.7, expert_kind="ungated", activation="relu2",
                                          shared_intermediate_size=20, shared_expert_kind="ungated"),
    "sigmoid_unnormed": MoEConfig(num_experts=9, top_k=2, intermediate_size=8, scoring="sigmoid",
                                  norm_topk_prob=False, score_correction_bias=True),
    "softmax_grouped_bias": MoEConfig(num_experts=8, top_k=2, intermediate_size=8, n_group=2, topk_group=1,
                                      router_bias=True, expert_bias=True),
    "k1_odd_E": MoEConfig(num_experts=5, top_k=1, intermediate_size=8),
    "k_equals_E": MoEConfig(num_experts=5, top_k=5, intermediate_size=8, expert_kind="gpt_oss", expert_bias=True,
                            scoring="topk_softmax"),
    "many_empty_experts": MoEConfig(num_experts=37, top_k=2, intermediate_size=8, expert_kind="ungated",
                                    activation="relu2", expert_bias=True),
}


# ----------------------------------------------------------------------------- router


def np_route(logits: np.ndarray, cfg: MoEConfig, bias: np.ndarray | None):
    """The routing written out in numpy, float64: (weights [N, k], experts [N, k])."""
    logits = logits.astype(np.float64)
    k = cfg.top_k
    if cfg.scoring == "topk_softmax":
        ids = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
        top = np.take_along_axis(logits, ids, -1)
        w = np.exp(top - top.max(-1, keepdims=True))
        return w / w.sum(-1, keepdims=True) * cfg.routed_scaling_factor, ids
    if cfg.scoring == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
    choice = scores + (0.0 if bias is None else bias.astype(np.float64))
    if cfg.n_group > 1:
        n, size = choice.shape[0], cfg.num_experts // cfg.n_group
        groups = choice.reshape(n, cfg.n_group, size)
        group_score = np.sort(groups, axis=-1)[..., -min(2, size):].sum(-1)
        keep = np.argsort(-group_score, axis=-1)[:, :cfg.topk_group]
        mask = np.zeros((n, cfg.n_group), bool)
        np.put_along_axis(mask, keep, True, -1)
        choice = np.where(np.repeat(mask, size, -1), choice, -np.inf)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(scores, ids, -1)
    if cfg.norm_topk_prob:
        w = w / w.sum(-1, keepdims=True)
    return w * cfg.routed_scaling_factor, ids


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_router_logits_as_a_reduction(dtype, monkeypatch):
    """$UMEM_JAX_ROUTER_DOT=reduce: a decode batch's logits (2..REDUCE_ROWS rows) as one reduction
    in fp32, the same numbers as the GEMM (bias included); one row and larger batches keep the GEMM."""
    m = build(CONFIGS["gpt_oss"], seed=45, dtype=dtype)
    graphdef, state = nnx.split(m.gate)

    def logits(x, how):
        monkeypatch.setenv(ROUTER_DOT_ENV, how)
        fn = lambda state, x: nnx.merge(graphdef, state).logits(x)  # a new function: a new trace
        return fn, jax.jit(fn)(state, x)

    for n, reduces in ((1, False), (12, True), (router_lib.REDUCE_ROWS, True), (router_lib.REDUCE_ROWS + 1, False)):
        x = inputs(n, (n, HIDDEN), dtype)
        fn, got = logits(x, "reduce")
        prims = _primitives(jax.make_jaxpr(fn)(state, x).jaxpr)
        assert ("dot_general" not in prims) == reduces, n
        _, want = logits(x, "dot")
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("route_env", ["pallas", "xla"])
def test_the_router_bias_reaches_the_choice(route_env, monkeypatch):
    """gpt-oss's router has a bias: Router() passes it to route(), which the top-k kernel adds as it
    loads the logits (no XLA add after the matmul: the step's jaxpr has none) and XLA adds itself;
    either way the choice is that of the biased logits (Router.logits)."""
    from umem_jax.pallas_kernels.route_topk import ROUTE_ENV

    m = build(CONFIGS["gpt_oss"], seed=46, dtype=jnp.float32)
    gate = m.gate
    gate.bias = nnx.Param(inputs(9, gate.bias[...].shape, jnp.float32) * 3.0)  # large enough to move picks
    x = inputs(3, (7, HIDDEN), jnp.float32)
    monkeypatch.setenv(ROUTE_ENV, route_env)
    w, ids = gate(x)
    want_w, want_ids = route(gate.logits(x), gate.cfg)
    plain_w, plain_ids = route(gate.logits(x, with_bias=False), gate.cfg)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(w), np.asarray(want_w), rtol=2e-6, atol=1e-7)
    assert not np.array_equal(np.asarray(ids), np.asarray(plain_ids))
    if route_env == "pallas":
        graphdef, state = nnx.split(gate)
        prims = _primitives(jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x).jaxpr)
        assert "add" not in prims, prims


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_router_matches_numpy(name, seed):
    cfg = CONFIGS[name]
    n = 48
    logits = np.asarray(inputs(seed, (n, cfg.num_experts))) * 3.0
    bias = np.asarray(inputs(seed + 7, (cfg.num_experts,))) * 0.3 if cfg.score_correction_bias else None
    w, ids = route(jnp.asarray(logits), cfg, None if bias is None else jnp.asarray(bias))
    want_w, want_ids = np_route(logits, cfg, bias)
    w, ids = np.asarray(w), np.asarray(ids)
    assert ids.dtype == np.int32 and w.dtype == np.float32 and ids.shape == (n, cfg.top_k)
    # Same chosen set per token (order of equal-rank picks is not part of the contract) ...
    got_order, want_order = np.argsort(ids, -1), np.argsort(want_ids, -1)
    np.testing.assert_array_equal(np.take_along_axis(ids, got_order, -1), np.take_along_axis(want_ids, want_order, -1))
    # ... and the same weight for each chosen expert.
    np.testing.assert_allclose(np.take_along_axis(w, got_order, -1), np.take_along_axis(want_w, want_order, -1),
                               rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_route_weights_of_other_experts_follow_the_same_rule(name):
    """route_weights (what a check forcing one path's experts on another uses) gives route's own
    choice route's weights, and any other choice the weights the numpy rule gives that choice."""
    cfg = CONFIGS[name]
    seed = np.random.randint(1 << 30)
    logits = inputs(seed, (24, cfg.num_experts)) * 3.0
    w, ids = route(logits, cfg)
    np.testing.assert_allclose(np.asarray(route_weights(logits, ids, cfg)), np.asarray(w), rtol=2e-6, atol=1e-7)
    rng = np.random.default_rng(seed)
    other = np.stack([rng.choice(cfg.num_experts, cfg.top_k, replace=False) for _ in range(24)]).astype(np.int32)
    got = np.asarray(route_weights(logits, jnp.asarray(other), cfg))
    lg = np.asarray(logits, np.float64)
    if cfg.scoring == "topk_softmax":
        chosen = np.take_along_axis(lg, other, -1)
        want = np.exp(chosen - chosen.max(-1, keepdims=True))
        want /= want.sum(-1, keepdims=True)
    else:
        scores = (np.exp(lg - lg.max(-1, keepdims=True)) / np.exp(lg - lg.max(-1, keepdims=True)).sum(-1, keepdims=True)
                  if cfg.scoring == "softmax" else 1.0 / (1.0 + np.exp(-lg)))
        want = np.take_along_axis(scores, other, -1)
        if cfg.norm_topk_prob:
            want /= want.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, want * cfg.routed_scaling_factor, rtol=1e-5, atol=1e-7)


def test_correction_bias_changes_selection_not_weights():
    """A large correction bias on expert 3 makes every token choose it, with its plain sigmoid score."""
    cfg = MoEConfig(num_experts=6, top_k=2, intermediate_size=8, scoring="sigmoid", norm_topk_prob=False,
                    score_correction_bias=True)
    logits = inputs(3, (20, 6))
    bias = jnp.zeros((6,)).at[3].set(10.0)
    w, ids = route(logits, cfg, bias)
    assert bool(jnp.all(jnp.any(ids == 3, axis=-1)))
    np.testing.assert_allclose(np.asarray(w), np.asarray(jnp.take_along_axis(jax.nn.sigmoid(logits), ids, -1)),
                               rtol=1e-6)


# ----------------------------------------------------------------------------- dispatch


GATHER_CASES = ["gpt_oss", "nemotron_sigmoid_grouped", "qwen_next_shared_gate", "k_equals_E"]  # every kind
PALLAS_CASES = ["gpt_oss", "many_empty_experts"]  # the Triton kernel, interpreted (slow on CPU)


@pytest.mark.parametrize("name,path", [(n, "ragged") for n in sorted(CONFIGS)] + [(n, "gather") for n in GATHER_CASES]
                         + [(n, p) for n in PALLAS_CASES for p in ("pallas", "planned")])
def test_dispatch_matches_reference_fp32(name, path, monkeypatch):
    cfg = CONFIGS[name]
    m = build(cfg, seed=sum(map(ord, name)))
    x = inputs(5, (3, 11, HIDDEN))
    use_path(monkeypatch, path)
    got, want = jitted(block, m, x), jitted(moe_reference, m, x)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert rel(got, want) < 1e-5


@pytest.mark.parametrize("name,path", [(n, "ragged") for n in ("qwen_next_shared_gate", "gpt_oss",
                                                                  "nemotron_sigmoid_grouped", "k1_odd_E")]
                         + [(n, p) for n in ("gpt_oss", "nemotron_sigmoid_grouped") for p in ("planned",)])
def test_dispatch_matches_reference_bf16(name, path, monkeypatch):
    """bf16 weights and activations: both sides accumulate in fp32 and round the expert hidden
    to bf16 once, so they differ by a few bf16 ulps of the output."""
    use_path(monkeypatch, path)
    cfg = CONFIGS[name]
    m = build(cfg, seed=11, dtype=jnp.bfloat16)
    x = inputs(6, (4, 16, HIDDEN), jnp.bfloat16)
    got, want = jitted(block, m, x), jitted(moe_reference, m, x)
    assert got.dtype == jnp.bfloat16
    assert rel(got, want) < 2e-2
    # And both are close to the fp32 block with the same (bf16-rounded) weights.
    m32 = nnx.merge(*_cast(m, jnp.float32))
    assert rel(got, jitted(moe_reference, m32, x.astype(jnp.float32))) < 3e-2


def _cast(m, dtype):
    graphdef, state = nnx.split(m)
    return graphdef, jax.tree.map(lambda a: a.astype(dtype), state)


@pytest.mark.parametrize("k", [1, 2])
def test_every_token_on_one_expert(k):
    """All 64 tokens route to expert 0 (one group holds every row; the others are empty)."""
    cfg = MoEConfig(num_experts=6, top_k=k, intermediate_size=8, expert_bias=True, router_bias=True)
    m = build(cfg, seed=21)
    m.gate.bias[...] = jnp.array([50.0, 0, 0, 0, 0, 0]) + m.gate.bias[...]
    x = inputs(8, (64, HIDDEN))
    _, ids = m.gate(x)
    assert bool(jnp.all(ids[:, 0] == 0))
    assert rel(jitted(block, m, x), jitted(moe_reference, m, x)) < 1e-5


@pytest.mark.parametrize("path", ["ragged", "gather", "pallas", "planned"])
def test_padding_rows_do_not_touch_valid_rows(path, monkeypatch):
    """Padding rows filled with NaN and huge values: valid rows are exactly what they are without
    the padding; padding rows come back finite or not, but are never read."""
    use_path(monkeypatch, path)
    cfg = CONFIGS["gpt_oss"]
    m = build(cfg, seed=31)
    x = inputs(9, (2, 12, HIDDEN))
    valid = jnp.asarray(np.random.default_rng(0).random((2, 12)) < 0.6)
    junk = jnp.where(jnp.arange(2 * 12).reshape(2, 12, 1) % 2 == 0, jnp.nan, 1e6)
    padded = jnp.where(valid[..., None], x, junk)
    got = np.asarray(jitted(block, m, padded, valid))
    alone = np.asarray(jitted(block, m, x[valid]))  # only the valid rows, no padding at all
    np.testing.assert_allclose(got[np.asarray(valid)], alone, rtol=1e-6, atol=1e-6)
    ref = np.asarray(jitted(moe_reference, m, x))
    np.testing.assert_allclose(got[np.asarray(valid)], ref[np.asarray(valid)], rtol=1e-5, atol=1e-5)


def test_gpt_oss_activation_formula():
    """gate = min(gate, limit); up = clip(up, -limit, limit); (up + 1) * gate * sigmoid(alpha * gate)."""
    cfg = MoEConfig(num_experts=2, top_k=1, intermediate_size=5, expert_kind="gpt_oss")
    h = np.asarray(inputs(12, (7, 10))) * 6.0
    gate, up = h[:, :5], h[:, 5:]
    g = np.minimum(gate, cfg.swiglu_limit)
    u = np.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
    want = (u + 1.0) * g / (1.0 + np.exp(-cfg.swiglu_alpha * g))
    np.testing.assert_allclose(np.asarray(expert_activation(jnp.asarray(h), cfg)), want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- jit


def _primitives(jaxpr) -> set[str]:
    """Every primitive of a jaxpr and its sub-jaxprs (not inside a Pallas kernel: its loops run
    on the device as the kernel's own)."""
    out = set()
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        if eqn.primitive.name == "pallas_call":
            continue
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out |= _primitives(inner)
    return out


@pytest.mark.parametrize("name", ["nemotron_sigmoid_grouped", "gpt_oss", "qwen_next_shared_gate"])
def test_jitted_block_has_no_host_round_trip(name, monkeypatch):
    """No callbacks, and no while loop either: an XLA while loop on the GPU copies its predicate
    to the host every iteration (a binary-search searchsorted did, before compare_all)."""
    m = build(CONFIGS[name], seed=41)
    graphdef, state = nnx.split(m)
    x, valid = inputs(13, (2, 8, HIDDEN)), jnp.ones((2, 8), bool).at[1, 5:].set(False)
    want = jitted(moe_reference, m, x)
    for path in ("ragged", "gather", "pallas", "planned"):
        use_path(monkeypatch, path)
        fn = lambda state, x, valid: nnx.merge(graphdef, state)(x, valid)
        prims = _primitives(jax.make_jaxpr(fn)(state, x, valid).jaxpr)
        assert not {p for p in prims if "callback" in p or p in ("outfeed", "infeed", "while")}, (path, prims)
        assert ("pallas_call" in prims) == (path in ("pallas", "planned"))
        assert ("sort" in prims) == (path in ("ragged", "pallas"))  # the plan orders the rows by counting
        if path in ("pallas", "planned"):
            continue  # interpreted on CPU: checked against the reference above
        got = jax.jit(fn)(state, x, valid)
        np.testing.assert_allclose(np.asarray(got)[np.asarray(valid)], np.asarray(want)[np.asarray(valid)],
                                   rtol=1e-5, atol=1e-5)


def test_plan_takes_only_batches_up_to_its_rows(monkeypatch):
    """The planned path orders up to dispatch_plan.MAX_ROWS rows; a larger batch (a prefill) sorts,
    whose tiles spread one expert's many rows over programs."""
    m = build(CONFIGS["gpt_oss"], seed=43)
    graphdef, state = nnx.split(m)
    use_path(monkeypatch, "planned")
    x = inputs(14, (12, HIDDEN))  # 12 tokens x top-3 = 36 rows
    for limit, sorts in ((36, False), (35, True)):
        monkeypatch.setattr(plan_lib, "MAX_ROWS", limit)
        fn = lambda state, x: nnx.merge(graphdef, state)(x)  # a new function: JAX caches a trace by its function
        assert ("sort" in _primitives(jax.make_jaxpr(fn)(state, x).jaxpr)) == sorts, limit


def test_auto_path_picks_gather_for_few_rows(monkeypatch):
    """The default dispatch: N*k <= GATHER_ROWS gathers (no ragged_dot in the program)."""
    m = build(CONFIGS["qwen_softmax"], seed=51)
    graphdef, state = nnx.split(m)
    fn = lambda state, x: nnx.merge(graphdef, state)(x)
    monkeypatch.setattr(experts_lib, "GATHER_ROWS", 4)
    monkeypatch.setattr(experts_lib, "GROUPED_PATH", None)
    few = _primitives(jax.make_jaxpr(fn)(state, inputs(1, (2, HIDDEN))).jaxpr)
    more = _primitives(jax.make_jaxpr(fn)(state, inputs(1, (3, HIDDEN))).jaxpr)
    assert "ragged_dot_general" not in few and "sort" not in few
    assert "ragged_dot_general" in more and "sort" in more  # off the GPU the default grouped path is ragged_dot


# ----------------------------------------------------------------------------- the rows path


def use_rows(monkeypatch, rows_max: int = 64) -> None:
    """Make the block's default dispatch take the Pallas expert GEMV (interpreted) up to rows_max."""
    monkeypatch.setattr(experts_lib, "FEW_ROWS_PATH", "rows")
    monkeypatch.setattr(experts_lib, "ROWS_MAX", rows_max)


ROWS_CASES = ["gpt_oss", "nemotron_sigmoid_grouped", "qwen_next_shared_gate", "softmax_grouped_bias", "k1_odd_E"]


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("name", ROWS_CASES)
def test_rows_path_matches_reference_fp32(name, tokens, monkeypatch):
    """Both projections by the expert GEMV (gate_up with its bias, ungated experts, the down bias
    once after): one decode token and a few, whose experts repeat across tokens; with one token
    the activation runs as the down GEMV's prologue (FUSED_ACTIVATION), else as an XLA op."""
    use_rows(monkeypatch)
    monkeypatch.setattr(experts_lib, "FUSED_ACTIVATION", tokens == 1)
    m = build(CONFIGS[name], seed=sum(map(ord, name)) + tokens)
    x = inputs(tokens, (tokens, HIDDEN))
    got, want = jitted(block, m, x), jitted(moe_reference, m, x)
    assert got.shape == x.shape and rel(got, want) < 1e-5


@pytest.mark.parametrize("name", ["gpt_oss", "nemotron_sigmoid_grouped"])
def test_rows_path_matches_reference_bf16(name, monkeypatch):
    use_rows(monkeypatch)
    m = build(CONFIGS[name], seed=61, dtype=jnp.bfloat16)
    x = inputs(14, (4, HIDDEN), jnp.bfloat16)
    got, want = jitted(block, m, x), jitted(moe_reference, m, x)
    assert got.dtype == jnp.bfloat16 and rel(got, want) < 2e-2


def test_few_rows_dispatch_default_and_rows(monkeypatch):
    """The default is the backend's choice (None: the rows kernel on a GPU, where it beat the
    gather at every measured row count up to ROWS_MAX, gather elsewhere); with FEW_ROWS_PATH =
    "rows" up to ROWS_MAX rows run the kernel, then gather, then the sort."""
    assert experts_lib.FEW_ROWS_PATH is None and experts_lib.ROWS_MAX == 16
    monkeypatch.setattr(experts_lib, "FEW_ROWS_PATH", "gather")
    m = build(CONFIGS["qwen_softmax"], seed=81)  # top_k 2
    graphdef, state = nnx.split(m)

    def prims(n):  # a fresh function per trace: make_jaxpr caches traces of one function by shape
        return _primitives(jax.make_jaxpr(lambda state, x: nnx.merge(graphdef, state)(x))(
            state, inputs(1, (n, HIDDEN))).jaxpr)

    monkeypatch.setattr(experts_lib, "GATHER_ROWS", 8)
    monkeypatch.setattr(experts_lib, "GROUPED_PATH", None)
    assert "pallas_call" not in prims(2) and "sort" not in prims(2)  # gather
    use_rows(monkeypatch, rows_max=4)
    assert experts_lib.few_rows_path(4) == "rows" and experts_lib.few_rows_path(6) == "gather"
    assert experts_lib.few_rows_path(9) is None
    monkeypatch.setattr(experts_lib, "FEW_ROWS_PATH", None)  # the backend's choice: gather off the GPU
    assert experts_lib.few_rows_path(4) == ("rows" if jax.default_backend() == "gpu" else "gather")
    monkeypatch.setattr(experts_lib, "FEW_ROWS_PATH", "rows")
    assert "pallas_call" in prims(2) and "sort" not in prims(2)
    assert "pallas_call" not in prims(3) and "sort" not in prims(3)
    assert "sort" in prims(5)
    monkeypatch.setattr(experts_lib, "FEW_ROWS_PATH", "scatter")
    with pytest.raises(ValueError, match="FEW_ROWS_PATH"):
        experts_lib.few_rows_path(2)


@pytest.mark.parametrize("kw,match", [
    ({"scoring": "relu"}, "scoring"), ({"expert_kind": "geglu"}, "expert_kind"), ({"top_k": 9}, "top_k"),
    ({"n_group": 3}, "n_group"), ({"n_group": 4, "topk_group": 5}, "topk_group"),
    ({"n_group": 4, "topk_group": 1, "top_k": 3}, "exceeds"), ({"shared_expert_kind": "moe"}, "shared_expert_kind"),
])
def test_unsupported_configs_say_what(kw, match):
    with pytest.raises((ValueError, NotImplementedError), match=match):
        MoEConfig(**{**BASE, **kw})


def test_config_is_hashable():
    assert hash(CONFIGS["gpt_oss"]) == hash(dataclasses.replace(CONFIGS["gpt_oss"]))


# ----------------------------------------------------------------------------- the shared expert joined

# shared widths that are multiples of the routed experts' (2 and 3 pseudo-experts), with and without a gate
JOINABLE = {
    "qwen_gate_m2": MoEConfig(**BASE, shared_intermediate_size=32, shared_expert_gate=True),
    "nemotron_ungated_m3": MoEConfig(num_experts=12, top_k=3, intermediate_size=8, scoring="sigmoid",
                                     score_correction_bias=True, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                     expert_kind="ungated", activation="relu2", shared_intermediate_size=24,
                                     shared_expert_kind="ungated"),
    "sigmoid_no_gate_m1": MoEConfig(num_experts=9, top_k=2, intermediate_size=8, scoring="sigmoid",
                                    norm_topk_prob=False, score_correction_bias=True, shared_intermediate_size=8),
}


def joined(m: MoE) -> MoE:
    """A copy of m with its shared expert joined to the routed ones (MoE.fuse_projections)."""
    graphdef, state = nnx.split(m)
    twin = nnx.merge(graphdef, jax.tree.map(jnp.array, state))
    assert twin.fuse_projections()
    return twin


@pytest.mark.parametrize("path,tokens", [("rows", 1), ("rows", 3), ("gather", 2), ("ragged", 7)])
@pytest.mark.parametrize("name", sorted(JOINABLE))
def test_joined_shared_expert_matches_the_separate_one(name, path, tokens, monkeypatch):
    """The router's shared slots (ids E.., weight = the gate's sigmoid or 1) and the pseudo-experts
    give the block's output with the shared expert run apart: inside the expert GEMV ("rows"), or
    dense beside the gather and grouped paths; the parameters are the same count, none left over."""
    cfg = JOINABLE[name]
    m = build(cfg, seed=sum(map(ord, name)) + tokens)
    x = inputs(tokens + 40, (tokens, HIDDEN))
    want = jitted(block, m, x)
    if path == "rows":
        use_rows(monkeypatch)
    else:
        monkeypatch.setattr(experts_lib, "FEW_ROWS_PATH", "gather")
        use_path(monkeypatch, path)
    j = joined(m)
    m_count = cfg.shared_intermediate_size // cfg.intermediate_size
    assert j.shared_expert is None and j.shared_expert_gate is None
    assert j.shared_first.shape[1] == m_count == j.shared_down.shape[0]  # [d, m, F], [m, I, d]
    size = lambda mod: sum(a.size for a in jax.tree.leaves(nnx.state(mod)))
    assert size(j) == size(m)
    w, ids = jitted(lambda mod, x: mod.gate(x), j, x)
    k, E = cfg.top_k, cfg.num_experts
    assert ids.shape == (tokens, k + m_count)
    np.testing.assert_array_equal(np.asarray(ids[:, k:]), np.broadcast_to(E + np.arange(m_count), (tokens, m_count)))
    got = jitted(block, j, x)
    assert rel(got, want) < 1e-5
    assert rel(jitted(moe_reference, j, x), want) < 1e-5


@pytest.mark.parametrize("name", ["gpt_oss", "qwen_gate_m2"])
def test_rows_path_padding_rows_do_not_touch_valid_rows(name, monkeypatch):
    """Padding tokens (NaN and huge x) name no expert in the kernel (the router gives them id -1,
    shared slots included): valid rows equal the block run on the valid tokens alone."""
    use_rows(monkeypatch)
    m = build(CONFIGS[name], seed=71) if name in CONFIGS else joined(build(JOINABLE[name], seed=91))
    x = inputs(15, (2, 5, HIDDEN))
    valid = jnp.asarray(np.random.default_rng(1).random((2, 5)) < 0.6).at[0, 0].set(True).at[1, 0].set(False)
    junk = jnp.where(jnp.arange(10).reshape(2, 5, 1) % 2 == 0, jnp.nan, 1e6)
    got = np.asarray(jitted(block, m, jnp.where(valid[..., None], x, junk), valid))
    keep = np.asarray(valid)
    np.testing.assert_allclose(got[keep], np.asarray(jitted(block, m, x[valid])), rtol=1e-6, atol=1e-6)
    assert np.all(got[~keep] == 0)


def test_joined_bf16_rows_path(monkeypatch):
    """bf16: the joined rows path against the separate shared expert, within bf16 rounding (the
    shared hidden is now rounded once, from fp32, as the routed experts' is)."""
    use_rows(monkeypatch)
    m = build(JOINABLE["qwen_gate_m2"], seed=93, dtype=jnp.bfloat16)
    x = inputs(17, (2, HIDDEN), jnp.bfloat16)
    assert rel(jitted(block, joined(m), x), jitted(block, m, x)) < 2e-2


@pytest.mark.parametrize("cfg", [
    MoEConfig(**BASE, shared_intermediate_size=24, shared_expert_gate=True),  # 24 is no multiple of 16
    MoEConfig(**BASE, expert_kind="ungated", activation="relu2", shared_intermediate_size=32),  # gated shared MLP
    MoEConfig(**BASE),  # no shared expert
], ids=["width", "kind", "none"])
def test_shared_expert_that_cannot_join_stays_apart(cfg):
    m = build(cfg, seed=95)
    graphdef_before = nnx.split(m)[0]
    assert not m.fuse_projections()
    assert nnx.split(m)[0] == graphdef_before and m.shared_first is None
