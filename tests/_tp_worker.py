"""Tensor-parallel checks that need several devices, run in a subprocess by
test_tensor_parallel.py (XLA_FLAGS must give the CPU 4 devices before jax starts).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/_tp_worker.py tiny dense [...]

Each section raises AssertionError with the reason on a mismatch; the last line printed is a
JSON summary.  Sections:
  tiny             the tiny hybrid (window + Mamba2 with 1 group + full attention, 2 KV heads)
                   through the real engine at TP=1, 2 and 4: identical greedy tokens; the arena
                   split P("tp") with one [1, rows, words] shard per device; the compiled decode
                   step aliases every shard (check_in_place) and the shards' buffers stay put
                   over a second round of requests (page moves at idle included)
  dense            NemotronH and Qwen3.5 fixtures (transformers-checked weights): cache-free
                   logits of the sharded model at TP=2 (and NemotronH at TP=4: its 2 groups
                   split over 4 devices) against TP=1
  arena-fixtures   the same splits: greedy tokens through the arena (hand-paged steps)
  engine-fixtures  the two fixtures through the engine, TP=2 against TP=1
  moe              a tiny MoE layer (gpt-oss, Qwen3-Next and Nemotron-H style) at TP=2 and 4
                   against TP=1, sort + ragged_dot and gather dispatch; the same layers with
                   expert parallelism (experts split whole) on every dispatch path, the Pallas
                   expert GEMV (interpreted) too
  expert-parallel  gpt-oss and Qwen3.5-MoE fixtures through the engine at TP=2 with
                   enable_expert_parallel: greedy tokens equal to TP=1's; Qwen3.5-MoE's MTP head
                   (an MoE layer of its own) split likewise, greedy equal to TP=1 without it
  speculative      a draft model split as the target, at TP=2: the tiny hybrid (Mamba2 state)
                   with an attention-only draft, greedy equal to TP=1 without speculation,
                   penalties and logprobs too; the attention-only model drafting for itself
                   (every draft accepted); Qwen3.5's MTP head split as the target at TP=2,
                   greedy equal to TP=1 with and without it
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

HERE = Path(__file__).parent
# One bucket per dimension: each engine compiles exactly one prefill and one decode step.
SETTINGS = {"arena_bytes": 1 << 20, "max_num_seqs": 4, "max_num_batched_tokens": 16, "page_size": 4,
            "max_model_len": 64, "batch_buckets": (4,), "token_buckets": (16,), "page_buckets": (16,),
            "kernel_impl": "reference"}
# Lengths around the window (16) and the chunk (16): chunked prefill, window pages retired.
PROMPTS = [[5, 17, 42, 99, 7, 8, 9, 10, 11], [3, 4, 5], list(range(20, 41))]


def _greedy(model, tp: int, prompts=PROMPTS, n: int = 10, **kw):
    from umem_jax import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=tp, **{**SETTINGS, **kw})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return llm, [o.outputs[0].token_ids for o in outs]


def _shard_pointers(arena) -> list[int]:
    return [s.data.unsafe_buffer_pointer() for s in arena.data.addressable_shards]


def tiny() -> dict:
    from jax.sharding import PartitionSpec as P

    from umem_jax.arena import check_in_place
    from umem_jax.models.config import FULL, RECURRENT, SLIDING
    from umem_jax.models.tiny import tiny_model

    # Three layers (one of each kind) keep the compiles short; G=1 < tp and 2 KV heads < 4
    # exercise the split norm and the replicated KV heads.
    model = tiny_model(seed=3, layer_types=(SLIDING, RECURRENT, FULL))
    _, want = _greedy(model, 1)
    out = {"tokens": want}
    for tp in (2, 4):
        llm, got = _greedy(model, tp)
        assert got == want, f"TP={tp} greedy {got} != TP=1 {want}"
        runner = llm.llm_engine.runner
        arena = runner.arena
        data = arena.data
        assert data.shape == (tp, arena.num_rows, arena.row_words), data.shape
        assert data.sharding.spec == P("tp"), data.sharding
        shards = data.addressable_shards
        assert len({s.device for s in shards}) == tp and all(s.data.shape == (1, *data.shape[1:]) for s in shards)
        # The decode step as the engine compiled it: every shard donated and aliased, no copy.
        lay = next(s for s in runner.shapes if s.T == 1)
        compiled = runner.lower(lay).compile()
        seen = check_in_place(compiled, arena)
        # And at run time: a second round (compaction moves at idle, steps) keeps every buffer.
        before = _shard_pointers(runner.arena)
        _, again = _greedy_again(llm)
        assert again == want, f"TP={tp} second round {again} != {want}"
        assert _shard_pointers(runner.arena) == before, "an arena shard moved: not updated in place"
        out[f"tp{tp}"] = {"alias_bytes": seen["alias_bytes"], "shard_bytes": arena.shard_nbytes,
                          "moved_pages": runner.num_moved_pages}
    return out


def _greedy_again(llm):
    from umem_jax import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    return llm, [o.outputs[0].token_ids for o in outs]


def _fixture_models():
    from umem_jax.models.loader import load_model

    return {"nemotron_h": (load_model(HERE / "fixtures" / "nemotron_h_tiny"), (2, 4)),
            "qwen3_5": (load_model(HERE / "fixtures" / "qwen3_5_tiny"), (2,))}


def dense() -> dict:
    """Sharded cache-free logits == unsplit (fp32: only the psum's order of addition differs)."""
    from umem_jax.models.sharded_model import shard_model

    out = {}
    toks = jnp.asarray(np.random.default_rng(0).integers(3, 120, size=(2, 12)), jnp.int32)
    for name, (model, tps) in _fixture_models().items():
        ref = np.asarray(model.dense_logits(model.params, toks))
        for tp in tps:
            sm = shard_model(model, tp)
            got = np.asarray(sm.dense_logits(sm.params, toks))
            err = float(np.abs(got - ref).max() / np.abs(ref).max())
            assert err < 1e-5, f"{name} TP={tp} dense logits differ: rel {err}"
            assert (got.argmax(-1) == ref.argmax(-1)).all(), f"{name} TP={tp} dense argmax differs"
            out[f"{name}_tp{tp}"] = err
    return out


def arena_fixtures() -> dict:
    """Greedy through the arena (hand-paged prefill chunks and decode steps) == unsplit."""
    from _model_arena import generate

    from umem_jax.memory import plan as make_plan
    from umem_jax.models.sharded_model import shard_model

    out = {}
    prompts = [np.arange(3, 23), np.arange(40, 47)]
    run = lambda m: generate(m, make_plan(m.decls(kv_dtype="float32"), page_size=4), prompts, 8, chunk=8,
                             num_rows=8192).tokens
    for name, (model, tps) in _fixture_models().items():
        want = run(model)
        for tp in tps:
            got = run(shard_model(model, tp))
            assert got == want, f"{name} TP={tp} arena greedy {got} != {want}"
            out[f"{name}_tp{tp}"] = got
    return out


def engine_fixtures() -> dict:
    out = {}
    for name, (model, _) in _fixture_models().items():
        _, want = _greedy(model, 1, max_model_len=64)
        _, got = _greedy(model, 2, max_model_len=64)
        assert got == want, f"{name} engine TP=2 greedy {got} != TP=1 {want}"
        out[name] = want
    return out


def _moe_layer(cfg, d: int, seed: int = 0):
    """A MoE layer of `cfg` with every weight random (biases too), built abstractly."""
    from flax import nnx

    from umem_jax.models.moe import MoE

    rng = np.random.default_rng(seed)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(d, cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))))
    leaves = [jnp.asarray(rng.standard_normal(s.shape, np.float32) / np.sqrt(s.shape[-2] if s.ndim > 1 else 4))
              for s in jax.tree.leaves(state)]
    return nnx.merge(graphdef, jax.tree.unflatten(jax.tree.structure(state), leaves))


def _moe_sharded(full, tp: int, ep: bool = False, join: bool = False):
    """full's TP split by sharding.py (ep: expert parallelism): a jitted (x, valid) -> output
    under shard_map over tp devices.  join: each device's layer joins its shared expert slice to
    its experts (MoE.fuse_projections, as a fused model's layers do) before it runs."""
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from umem_jax.models.moe import MoE
    from umem_jax.models.sharding import mark_local, split_indices
    from umem_jax.parallel.mesh import shard_map, tp_mesh

    cfg = full.cfg
    routed = dict(expert_shards=tp) if ep else dict(intermediate_size=cfg.intermediate_size // tp)
    local_cfg = dataclasses.replace(cfg, shared_intermediate_size=cfg.shared_intermediate_size // tp, **routed)
    d = full.gate.weight.shape[1]
    local = nnx.eval_shape(lambda: MoE(d, local_cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    mark_local(local, full, tp, ep)
    assert local.experts.reduce_axis == "tp" and local.experts.expert_axis == ("tp" if ep else None)
    local_def, local_state = nnx.split(local)
    rules = split_indices(full, tp, ep)
    flat, treedef = jax.tree_util.tree_flatten_with_path(nnx.split(full)[1])
    parts, stacked = [], []
    for (path, leaf), want in zip(flat, jax.tree.leaves(local_state)):
        key = tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)
        key = key[:-1] if key[-1] == "value" else key
        rule = rules.get(key)
        host = np.asarray(leaf)
        got = host if rule is None else np.stack([np.take(host, i, axis=rule[0]) for i in rule[1]])
        assert (got.shape if rule is None else got.shape[1:]) == want.shape, (key, got.shape, want.shape)
        parts.append(jnp.asarray(got))
        stacked.append(rule is not None)

    def body(leaves, x, valid):
        own = [a[0] if s else a for a, s in zip(leaves, stacked)]
        layer = nnx.merge(local_def, jax.tree.unflatten(treedef, own))
        if join:
            layer.fuse_projections()
        return layer(x, valid)

    specs = [P("tp") if s else P() for s in stacked]
    run = jax.jit(shard_map(body, tp_mesh(tp), (specs, P(), P()), P()))
    return lambda x, valid: run(parts, x, valid)


def moe() -> dict:
    """A tiny MoE layer (routed experts with biases, shared expert with its gate) split over
    TP=2 and 4 by sharding.py's rules == the unsplit layer, both dispatch paths."""
    from flax import nnx

    from umem_jax.models import experts as experts_lib
    from umem_jax.models import moe as moe_lib

    configs = {
        "gpt_oss": moe_lib.MoEConfig(num_experts=6, top_k=2, intermediate_size=16, scoring="topk_softmax",
                                     router_bias=True, expert_kind="gpt_oss", expert_bias=True, swiglu_limit=1.5),
        "qwen_next": moe_lib.MoEConfig(num_experts=7, top_k=3, intermediate_size=8, shared_intermediate_size=16,
                                       shared_expert_gate=True),
        "nemotron": moe_lib.MoEConfig(num_experts=8, top_k=2, intermediate_size=8, scoring="sigmoid",
                                      score_correction_bias=True, n_group=2, topk_group=1, expert_kind="ungated",
                                      activation="relu2", shared_intermediate_size=8, shared_expert_kind="ungated"),
    }
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 9, 32), np.float32))
    valid = jnp.asarray(rng.random((2, 9)) < 0.7)
    keep = np.asarray(valid)
    out, default_rows = {}, experts_lib.GATHER_ROWS
    def unsplit(layer, xs, ok):  # the unsplit layer jitted whole, traced now (so it reads the dispatch globals);
        graphdef, state = nnx.split(layer)  # op by op, each op compiled alone: 2.5x the time, the same numbers
        return np.asarray(jax.jit(lambda s, a, b: nnx.merge(graphdef, s)(a, b))(state, xs, ok))
    for name, cfg in configs.items():
        full = _moe_layer(cfg, 32)
        for rows in (0, 10**9):  # ragged, then gather (read when the layer is traced)
            experts_lib.GATHER_ROWS = rows
            want = unsplit(full, x, valid)  # once per path
            for tp in (2, 4):
                got = np.asarray(_moe_sharded(full, tp)(x, valid))
                err = float(np.abs(got - want)[keep].max() / np.abs(want).max())
                assert err < 1e-5, f"MoE {name} TP={tp} gather_rows={rows}: rel {err}"
                out[f"{name}_tp{tp}_{'gather' if rows else 'ragged'}"] = err
    experts_lib.GATHER_ROWS = default_rows
    # Expert parallelism: 8 experts (whole per device at TP=2 and 4), every dispatch path; the
    # expert GEMV on 3 tokens (its rows path serves up to ROWS_MAX (token, expert) rows).
    paths = {"ragged": (x, valid), "gather": (x, valid), "rows": (x[:, :3], valid[:, :3])}
    for name, cfg in configs.items():
        full = _moe_layer(dataclasses.replace(cfg, num_experts=8), 32, seed=1)
        for path, (xs, ok) in paths.items():
            experts_lib.GATHER_ROWS, experts_lib.FEW_ROWS_PATH = (10**9 if path == "gather" else 0), (
                "rows" if path == "rows" else None)
            want = unsplit(full, xs, ok)
            for tp in (2, 4):
                got = np.asarray(_moe_sharded(full, tp, ep=True)(xs, ok))
                mask = np.asarray(ok)
                err = float(np.abs(got - want)[mask].max() / np.abs(want).max())
                assert err < 1e-5, f"MoE {name} EP={tp} {path}: rel {err}"
                assert np.all(got[~mask] == 0.0) or cfg.shared_intermediate_size, f"{name} EP={tp} {path}: padding rows"
                out[f"{name}_ep{tp}_{path}"] = err
    # The shared expert joined per device (its slice of columns as pseudo-experts of the local
    # width): in the expert GEMV ("rows") and dense beside ragged_dot, at TP=2 and EP=2.
    for name in ("qwen_next", "nemotron"):
        full = _moe_layer(dataclasses.replace(configs[name], num_experts=8), 32, seed=2)
        for (tp, ep), path in itertools.product(((2, False), (2, True)), ("rows", "ragged")):
            xs, ok = paths[path]
            experts_lib.GATHER_ROWS, experts_lib.FEW_ROWS_PATH = 0, ("rows" if path == "rows" else None)
            want = unsplit(full, xs, ok)
            got = np.asarray(_moe_sharded(full, tp, ep=ep, join=True)(xs, ok))
            mask = np.asarray(ok)
            err = float(np.abs(got - want)[mask].max() / np.abs(want).max())
            assert err < 1e-5, f"MoE {name} joined {'EP' if ep else 'TP'}={tp} {path}: rel {err}"
            out[f"{name}_joined_{'ep' if ep else 'tp'}{tp}_{path}"] = err
    experts_lib.GATHER_ROWS, experts_lib.FEW_ROWS_PATH = default_rows, None
    return out


def expert_parallel() -> dict:
    """The MoE fixtures served at TP=2 with the experts split whole: greedy equal to TP=1."""
    from umem_jax.models.loader import load_model

    import tempfile

    from _mtp_fixtures import write_mtp_checkpoint

    out = {}
    for name in ("gpt_oss_tiny", "qwen3_5_moe_tiny"):
        model = load_model(str(HERE / "fixtures" / name))
        _, want = _greedy(model, 1, max_model_len=64)
        llm, got = _greedy(model, 2, max_model_len=64, enable_expert_parallel=True)
        experts = llm.llm_engine.model.config.moe
        assert experts.expert_shards == 2 and experts.local_experts == experts.num_experts // 2, experts
        assert got == want, f"{name} TP=2 with expert parallelism greedy {got} != TP=1 {want}"
        llm.llm_engine.check_idle()
        out[name] = want
    # Qwen3.5-MoE's MTP head has an MoE layer of its own: split whole as the target's.
    path = str(write_mtp_checkpoint(Path(tempfile.mkdtemp()), "qwen3_5_moe_tiny"))
    mtp = {"method": "mtp", "num_speculative_tokens": 3, "min_acceptance": 0.0}
    _, want = _greedy(path, 1, n=12)
    llm, got = _greedy(path, 2, n=12, speculative_config=mtp, enable_expert_parallel=True)
    head = llm.llm_engine.runner.speculator.draft
    assert head.config.moe is not None and head.config.moe.expert_shards == 2, head.config
    assert got == want, f"mtp TP=2 with expert parallelism {got} != TP=1 without speculation {want}"
    assert llm.llm_engine.stats()["speculative"]["num_verify_rows"] > 0
    llm.llm_engine.check_idle()
    out["qwen3_5_moe_tiny_mtp"] = got
    return out


def speculative() -> dict:
    from umem_jax import LLM, SamplingParams
    from umem_jax.models.config import FULL, RECURRENT, SLIDING
    from umem_jax.models.tiny import tiny_model

    # The tiny hybrid at three layers (one of each kind, as in `tiny`) and its attention-only
    # variant at two (window + full): a draft step is k + 1 draft forwards, so the compiles
    # (most of this section's time) scale with the layers; the kinds are what is checked.
    target = tiny_model(seed=3, layer_types=(SLIDING, RECURRENT, FULL))
    draft = tiny_model(seed=4, with_mamba=False, layer_types=(SLIDING, FULL))
    spec = {"method": "draft", "model": draft, "num_speculative_tokens": 3, "min_acceptance": 0.0}
    _, want = _greedy(target, 1, n=12)
    llm, got = _greedy(target, 2, n=12, speculative_config=spec)
    assert got == want, f"speculative TP=2 {got} != TP=1 {want}"
    st = llm.llm_engine.stats()["speculative"]
    assert st["num_verify_rows"] > 0, st
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.5, logprobs=2)
    plain = LLM(target, tensor_parallel_size=1, **SETTINGS).generate(PROMPTS, params)
    spec_out = llm.generate(PROMPTS, params)
    for a, b in zip(spec_out, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, (a.outputs[0].token_ids, b.outputs[0].token_ids)
        for t, da, db in zip(a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(da[t].logprob - db[t].logprob) < 1e-4, (da[t], db[t])
    llm.llm_engine.check_idle()
    # An attention-only target drafting for itself: every draft accepted, the rollback never needed.
    attn = draft
    _, want = _greedy(attn, 1, n=12)
    same, got = _greedy(attn, 2, n=12, speculative_config={**spec, "model": attn})
    assert got == want, f"self-drafted TP=2 {got} != TP=1 {want}"
    own = same.llm_engine.stats()["speculative"]
    assert own["acceptance_rate"] == 1.0, own
    # A draft that agrees with the target on some tokens only (its weights with noise): partial
    # acceptance, so rejected positions roll back and overlapped steps shift by 0..k at TP=2.
    from _engine_utils import noisy_copy

    noisy = noisy_copy(attn, 0.2)
    partial, got = _greedy(attn, 2, n=12, speculative_config={**spec, "model": noisy})
    assert got == want, f"noisy-drafted TP=2 {got} != TP=1 {want}"
    st = partial.llm_engine.stats()["speculative"]
    # Method mtp: Qwen3.5's head (its attention layer split as the target's) at TP=2 and 1.
    import tempfile

    from _mtp_fixtures import write_mtp_checkpoint

    path = str(write_mtp_checkpoint(Path(tempfile.mkdtemp()), "qwen3_5_tiny"))
    mtp = {"method": "mtp", "num_speculative_tokens": 3, "min_acceptance": 0.0}
    _, want = _greedy(path, 1, n=12)
    _, one = _greedy(path, 1, n=12, speculative_config=mtp)
    two, got = _greedy(path, 2, n=12, speculative_config=mtp)
    assert one == want and got == want, f"mtp TP=2 {got} / TP=1 {one} != without speculation {want}"
    # Again with the head's drafts replaced by the right continuation (a random head proposes
    # what the target never takes): verifies that accept, at TP=2.
    eng = two.llm_engine
    eng.config.async_scheduling = False  # the drafts are handed over on the host: read every step back
    before = eng.stats()["speculative"]["num_accepted_tokens"]
    expected = {tuple(p): list(p) + list(w) for p, w in zip(PROMPTS, want)}
    ids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) for p in PROMPTS]
    outs = {}
    while eng.has_unfinished_requests():
        outs.update((o.request_id, o) for o in eng.step())
        for req in eng.scheduler.running:
            if req.drafts and req.decode_ready:
                seq = expected[tuple(req.prompt_token_ids)]
                req.drafts = seq[req.num_computed + 1:req.num_computed + 4]
    assert [outs[i].outputs[0].token_ids for i in ids] == want
    heads = eng.stats()["speculative"]
    assert heads["num_accepted_tokens"] - before > 12, (before, heads)
    eng.check_idle()
    return {"acceptance_rate": st["acceptance_rate"], "mean_accepted_length": st["mean_accepted_length"],
            "mtp_acceptance_rate": heads["acceptance_rate"]}


SECTIONS = {"tiny": tiny, "dense": dense, "arena-fixtures": arena_fixtures, "engine-fixtures": engine_fixtures,
            "moe": moe, "expert-parallel": expert_parallel, "speculative": speculative}

if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    assert len(jax.devices()) >= 4, f"needs 4 devices (XLA_FLAGS), got {jax.devices()}"
    summary = {}
    for section in sys.argv[1:]:
        t = time.time()
        summary[section] = SECTIONS[section]()
        summary[section + "_seconds"] = round(time.time() - t, 1)
    print(json.dumps(summary))
