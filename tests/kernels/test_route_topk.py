"""The router's top-k kernel (pallas_kernels/route_topk.py), interpreted on CPU (compiled on a GPU),
against its XLA reference (jax.lax.top_k): every scoring, with and without the correction bias,
renormalisation and scaling, expert counts and k that are no power of two, row counts that leave
a partial block, ties (the lower expert id wins, as lax.top_k), and the model's route() choosing
the kernel under $UMEM_JAX_ROUTE.  Fresh random logits per case.  Interpret mode leaves
unwritten outputs NaN (weights) or garbage (ids), so every element is checked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _kernel_utils import cuda_lowering, no_triton_deprecation

from umem_jax.pallas_kernels.route_topk import ROUTE_ENV, route_backend, route_topk, route_topk_reference

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ON_GPU = jax.default_backend() == "gpu"

# (N, E, k, scoring, bias, norm, scale): the families' routers and shapes that stress the padding
CASES = [
    (1, 256, 8, "softmax", False, True, 1.0),       # Qwen3.5-MoE decode, one token
    (37, 256, 8, "softmax", False, True, 1.0),      # a partial last block of rows (block_rows 8)
    (5, 512, 10, "softmax", False, True, 1.0),      # Qwen3-Next: E = 512, k = 10
    (3, 32, 4, "topk_softmax", False, False, 1.0),  # gpt-oss-20b
    (19, 128, 4, "topk_softmax", False, False, 1.0),  # gpt-oss-120b
    (2, 128, 6, "sigmoid", True, True, 2.5),        # Nemotron 3 Nano: correction bias, scaling
    (16, 60, 4, "softmax", False, False, 1.0),      # Qwen1.5-MoE-like: E = 60, no renormalisation
    (7, 10, 3, "sigmoid", False, False, 1.0),       # E below the 16-column minimum tile
    (4, 8, 8, "softmax", False, True, 1.0),         # k = E: every expert
]


def logits_of(seed: int, shape) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32) * 2.0)


@pytest.mark.parametrize("N,E,k,scoring,bias,norm,scale", CASES)
def test_matches_reference(N, E, k, scoring, bias, norm, scale):
    rng = np.random.default_rng(N * 1000 + E + k)
    logits = logits_of(N + E * 7 + k, (N, E))
    cb = jnp.asarray(rng.standard_normal(E, np.float32) * 0.1) if bias else None
    kw = dict(k=k, scoring=scoring, correction_bias=cb, norm_topk_prob=norm, scale=scale)
    w_ref, ids_ref = route_topk_reference(logits, **kw)
    for rows in (None, 8) if N > 8 else (None,):  # the default (a row a program here), then blocks with a partial last
        with no_triton_deprecation():
            w, ids = route_topk(logits, interpret=not ON_GPU, block_rows=rows, **kw)
        assert w.shape == (N, k) and w.dtype == jnp.float32 and ids.shape == (N, k) and ids.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_ref))
        np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=2e-6, atol=1e-7)
    if norm or scoring == "topk_softmax":
        np.testing.assert_allclose(np.asarray(w).sum(-1), scale, rtol=1e-5)


# (N, E, k, scoring, bias, norm, scale, shared, gate): the shared experts' slots after the picks
SHARED_CASES = [
    (1, 256, 8, "softmax", False, True, 1.0, 1, True),   # Qwen3.5-MoE: one shared expert, sigmoid-gated
    (21, 512, 10, "softmax", False, True, 1.0, 1, True),  # Qwen3-Next, a partial block of rows
    (2, 128, 6, "sigmoid", True, True, 2.5, 2, False),   # Nemotron 3 Nano: the shared MLP as two slots, weight 1
    (5, 60, 4, "softmax", False, False, 1.0, 3, True),   # k + shared past a power of two
]


def test_rows_per_program_spreads_a_decode_batch():
    """One row a program until the rows give TARGET_PROGRAMS programs (a decode batch of 64 is 64
    programs, not 4), then blocks of up to BLOCK_ROWS; block_rows must be a power of two."""
    from umem_jax.pallas_kernels.route_topk import BLOCK_ROWS, TARGET_PROGRAMS, rows_per_program

    assert [rows_per_program(n) for n in (1, 7, 64, TARGET_PROGRAMS)] == [1, 1, 1, 1]
    assert rows_per_program(2 * TARGET_PROGRAMS) == 2 and rows_per_program(64 * TARGET_PROGRAMS) == BLOCK_ROWS
    with pytest.raises(ValueError, match="block_rows"):
        route_topk(logits_of(0, (4, 32)), k=2, scoring="softmax", block_rows=3, interpret=True)


@pytest.mark.parametrize("N,E,k,scoring,bias,norm,scale,shared,gate", SHARED_CASES)
def test_shared_slots_follow_the_picks(N, E, k, scoring, bias, norm, scale, shared, gate):
    """The gate's column (when present) never takes part in the pick; the slots after the k picks
    name E, E+1, .. with weight 1 or sigmoid(gate logit), unscaled; the picks are as without them."""
    rng = np.random.default_rng(N * 31 + E + shared)
    logits = logits_of(N * 3 + E + k + shared, (N, E + int(gate)))
    if gate:  # a gate logit above every expert's: a kernel that let it into the pick would choose it
        logits = logits.at[:, E].set(50.0 * rng.random(N, np.float32) + 10.0)
    cb = jnp.asarray(rng.standard_normal(E, np.float32) * 0.1) if bias else None
    kw = dict(k=k, scoring=scoring, correction_bias=cb, norm_topk_prob=norm, scale=scale)
    with no_triton_deprecation():  # N = 21 in blocks of 8: a partial last block
        w, ids = route_topk(logits, interpret=not ON_GPU, shared=shared, shared_gate=gate,
                            block_rows=8 if N > 8 else None, **kw)
    w_ref, ids_ref = route_topk_reference(logits, shared=shared, shared_gate=gate, **kw)
    plain_w, plain_ids = route_topk_reference(logits[:, :E], **kw)
    assert w.shape == ids.shape == (N, k + shared)
    for got_w, got_ids in ((w, ids), (w_ref, ids_ref)):
        np.testing.assert_array_equal(np.asarray(got_ids[:, :k]), np.asarray(plain_ids))
        np.testing.assert_array_equal(np.asarray(got_ids[:, k:]), np.broadcast_to(E + np.arange(shared), (N, shared)))
        np.testing.assert_allclose(np.asarray(got_w[:, :k]), np.asarray(plain_w), rtol=2e-6, atol=1e-7)
        want = 1 / (1 + np.exp(-np.asarray(logits[:, E:E + 1]))) if gate else np.ones((N, 1), np.float32)
        np.testing.assert_allclose(np.asarray(got_w[:, k:]), np.broadcast_to(want, (N, shared)), rtol=2e-6)
    with pytest.raises(ValueError, match="a gate needs slots"):
        route_topk_reference(logits, k=k, scoring=scoring, shared=0, shared_gate=True)


@pytest.mark.parametrize("shared,gate", [(0, False), (1, True)])
def test_padding_tokens_name_no_expert(shared, gate):
    """valid [..] False: every slot of that token gets id -1 and weight 0 (the expert GEMV then
    reads nothing for it); the valid tokens' choice is unchanged.  Leading dims [2, 9]."""
    E, k = 64, 6
    logits = logits_of(77 + shared, (2, 9, E + int(gate)))
    valid = jnp.asarray(np.random.default_rng(3).random((2, 9)) < 0.6)
    kw = dict(k=k, scoring="softmax", norm_topk_prob=True, shared=shared, shared_gate=gate)
    with no_triton_deprecation():
        w, ids = route_topk(logits, interpret=not ON_GPU, valid=valid, **kw)
    w_ref, ids_ref = route_topk_reference(logits, valid=valid, **kw)
    plain_w, plain_ids = route_topk_reference(logits, **kw)
    keep = np.asarray(valid)
    for got_w, got_ids in ((w, ids), (w_ref, ids_ref)):
        assert got_ids.shape == (2, 9, k + shared)
        assert np.all(np.asarray(got_ids)[~keep] == -1) and np.all(np.asarray(got_w)[~keep] == 0)
        np.testing.assert_array_equal(np.asarray(got_ids)[keep], np.asarray(plain_ids)[keep])
        np.testing.assert_allclose(np.asarray(got_w)[keep], np.asarray(plain_w)[keep], rtol=2e-6, atol=1e-7)
    with pytest.raises(ValueError, match="valid must be"):
        route_topk(logits, valid=valid[0], **kw)


@pytest.mark.parametrize("E,k,scoring,shared,gate,dtype", [
    (32, 4, "topk_softmax", 0, False, jnp.bfloat16),  # gpt-oss: the router's bf16 bias
    (60, 4, "softmax", 1, True, jnp.float32),          # a bias on the shared gate's column too
    (10, 3, "sigmoid", 0, False, jnp.float32),         # E below the 16-column tile
])
def test_the_router_bias_is_added_in_the_kernel(E, k, scoring, shared, gate, dtype):
    """logit_bias [E (+ 1)]: the choice of the logits plus the bias, as the reference gives it (and
    as route_topk gives it for logits with the bias added before); a wrong width is refused."""
    N = 11
    logits = logits_of(E + k, (N, E + int(gate)))
    lb = (jnp.asarray(np.random.default_rng(E).standard_normal(E + int(gate), np.float32)) * 1.5).astype(dtype)
    kw = dict(k=k, scoring=scoring, norm_topk_prob=scoring == "softmax", shared=shared, shared_gate=gate)
    with no_triton_deprecation():
        w, ids = route_topk(logits, interpret=not ON_GPU, logit_bias=lb, block_rows=8, **kw)
        w_added, ids_added = route_topk(logits + lb.astype(jnp.float32), interpret=not ON_GPU, block_rows=8, **kw)
    w_ref, ids_ref = route_topk_reference(logits, logit_bias=lb, **kw)
    plain_w, plain_ids = route_topk_reference(logits, **kw)
    assert not np.array_equal(np.asarray(ids_ref), np.asarray(plain_ids))  # the bias moves the choice
    for got_w, got_ids in ((w, ids), (w_added, ids_added)):
        np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(ids_ref))
        np.testing.assert_allclose(np.asarray(got_w), np.asarray(w_ref), rtol=2e-6, atol=1e-7)
    with pytest.raises(ValueError, match="logit_bias must be"):
        route_topk(logits, logit_bias=lb[:-1], **kw)


def test_ties_go_to_the_lower_expert_and_leading_dims_are_kept():
    """Equal logits (quantised to a few values) pick the lowest ids first, as lax.top_k does."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.integers(0, 3, size=(2, 3, 40)).astype(np.float32))  # many ties
    for scoring in ("softmax", "sigmoid", "topk_softmax"):
        kw = dict(k=5, scoring=scoring, norm_topk_prob=True, scale=1.0)
        with no_triton_deprecation():
            w, ids = route_topk(logits, interpret=not ON_GPU, **kw)
        w_ref, ids_ref = route_topk_reference(logits, **kw)
        assert ids.shape == (2, 3, 5)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_ref))
        np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=2e-6)


def test_bad_arguments_are_refused():
    x = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="scoring"):
        route_topk(x, k=2, scoring="argmax")
    with pytest.raises(ValueError, match="k=9"):
        route_topk(x, k=9, scoring="softmax")
    with pytest.raises(ValueError, match="correction_bias"):
        route_topk(x, k=2, scoring="sigmoid", correction_bias=jnp.zeros(7))


def test_route_follows_the_env_choice(monkeypatch):
    """models.moe.route takes the kernel under UMEM_JAX_ROUTE=pallas (interpreted here) and XLA
    under =xla, with the same experts and weights; groups (n_group > 1) stay in XLA."""
    from umem_jax.models.moe import MoEConfig, route

    cfg = MoEConfig(num_experts=64, top_k=6, intermediate_size=8, scoring="sigmoid", norm_topk_prob=True,
                    routed_scaling_factor=2.5, score_correction_bias=True)
    logits = logits_of(3, (4, 64))
    cb = jnp.asarray(np.random.default_rng(4).standard_normal(64, np.float32) * 0.1)
    got = {}
    for choice in ("pallas", "xla"):
        monkeypatch.setenv(ROUTE_ENV, choice)
        assert route_backend() == choice
        with no_triton_deprecation():
            got[choice] = route(logits, cfg, cb)
    np.testing.assert_array_equal(np.asarray(got["pallas"][1]), np.asarray(got["xla"][1]))
    np.testing.assert_allclose(np.asarray(got["pallas"][0]), np.asarray(got["xla"][0]), rtol=2e-6)
    # More experts than the kernel holds in registers: under =pallas the router stays in XLA
    # (the same picks as =xla, set last by the loop above), and the model is not refused.
    wide = MoEConfig(num_experts=2048, top_k=8, intermediate_size=8)
    w, ids = route(logits_of(5, (2, 2048)), wide)
    monkeypatch.setenv(ROUTE_ENV, "pallas")
    w2, ids2 = route(logits_of(5, (2, 2048)), wide)
    np.testing.assert_array_equal(np.asarray(ids2), np.asarray(ids))
    monkeypatch.setenv(ROUTE_ENV, "fastest")
    with pytest.raises(ValueError, match="UMEM_JAX_ROUTE"):
        route_backend()


def test_triton_kernel_lowers_for_cuda():
    """The kernel builds for CUDA (Triton lowering errors show here on any machine)."""
    with no_triton_deprecation():
        text = cuda_lowering(lambda x: route_topk(x, k=8, scoring="softmax", norm_topk_prob=True),
                             jnp.zeros((3, 256), jnp.float32))
    if text is None:
        pytest.skip("this jax cannot cross-lower for CUDA without a GPU (jax >= 0.11); the GPU run covers it")
    assert "umem_route_topk" in text
