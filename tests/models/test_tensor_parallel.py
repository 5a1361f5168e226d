"""Tensor parallelism: the split of every model family over a `tp` mesh axis.

In this process (one CPU device): which tensor_parallel_size is refused and why, the per-device
config, and that the weight split gives every device whole heads and covers every weight.

With several devices (a subprocess: XLA_FLAGS must be set before jax starts, see _tp_worker.py):
the tiny hybrid through the real engine at TP=2 and TP=4 gives the same greedy tokens as TP=1,
the arena is [tp, rows, words] split P("tp"), and the compiled step keeps every shard in place;
the NemotronH and Qwen3.5 fixtures' sharded cache-free logits match TP=1 (with --long also their
greedy tokens through the arena and through the engine).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _options import long_tests_enabled

from umem_jax.models.config import FULL, RECURRENT, SLIDING, MambaConfig
from umem_jax.models.sharding import check_tp, local_config, split_indices
from umem_jax.models.tiny import tiny_config

HERE = Path(__file__).parents[1]  # tests/
FIXTURES = HERE / "fixtures"


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("cfg,tp,match", [
    (tiny_config(), 3, "must divide num_attention_heads=4"),
    (tiny_config(num_heads=12, num_kv_heads=3), 2, r"num_key_value_heads=3 \(or be a multiple"),
    (tiny_config(intermediate_size=130), 4, "intermediate_size=130"),
    (tiny_config(mamba=MambaConfig(num_heads=6, head_dim=16, state_size=16)), 4, "mamba_num_heads=6"),
    (tiny_config(mamba=MambaConfig(num_heads=12, head_dim=16, state_size=16, n_groups=3)), 4, "mamba n_groups=3"),
    (tiny_config(), 0, "positive integer"),
])
def test_tp_that_splits_a_head_is_refused(cfg, tp, match):
    with pytest.raises(ValueError, match=match):
        check_tp(cfg, tp)


def test_engine_refuses_before_touching_devices():
    """Qwen3.5 fixture: 2 gated-DeltaNet key heads cannot go to 4 devices (one device here: the
    refusal must come from the model's shape, before any mesh is made)."""
    from umem_jax import LLM

    with pytest.raises(ValueError, match="linear_num_key_heads=2"):
        LLM(str(FIXTURES / "qwen3_5_tiny"), tensor_parallel_size=4, arena_bytes=1 << 20)


def test_cli_refusal_exit_code(capsys):
    from umem_jax.cli import main

    rc = main(["generate", str(FIXTURES / "qwen3_5_tiny"), "--prompt", "x", "--tensor-parallel-size", "4"])
    assert rc == 2 and "linear_num_key_heads=2" in capsys.readouterr().err


def test_mesh_wants_the_devices():
    from umem_jax.parallel.mesh import tp_mesh

    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        tp_mesh(1024)


# ----------------------------------------------------------------------------- the split


def test_local_config_divides_every_head_count():
    cfg = tiny_config(layer_types=(SLIDING, RECURRENT, FULL))
    two, four = local_config(cfg, 2), local_config(cfg, 4)
    assert (two.num_heads, two.num_kv_heads, two.intermediate_size) == (2, 1, 64)
    assert (four.num_heads, four.num_kv_heads) == (1, 1)  # 2 KV heads on 4 devices: each holds the one it reads
    assert (two.mamba.num_heads, two.mamba.n_groups) == (2, 1) and four.mamba.num_heads == 1
    assert local_config(cfg, 1) is cfg
    # Everything else (vocab, hidden, window, rope) is the model's.
    same = [f.name for f in dataclasses.fields(cfg) if f.name not in ("num_heads", "num_kv_heads",
                                                                      "intermediate_size", "mamba")]
    assert all(getattr(four, n) == getattr(cfg, n) for n in same)


def _qwen_and_nemotron():
    from umem_jax.models.loader import load_model

    return load_model(FIXTURES / "qwen3_5_tiny"), load_model(FIXTURES / "nemotron_h_tiny")


@pytest.fixture(scope="module")
def fixture_models():
    return _qwen_and_nemotron()


@pytest.mark.parametrize("tp", [2, 4])
def test_split_gives_whole_heads_and_covers_every_weight(fixture_models, tp):
    """Every split weight's devices together hold each row/column exactly once (when the heads
    divide) or each exactly tp/n times (fewer heads or groups than devices); the leaves the split
    does not list are the replicated ones (embeddings, norms over the hidden size)."""
    from flax import nnx

    for model in fixture_models:
        if tp == 4 and model.config.architecture.startswith("Qwen3_5"):
            continue  # refused (2 key heads), see above
        module = nnx.merge(model.graphdef, model.params)
        rules = split_indices(module, tp)
        flat = {tuple(k): v for k, v in nnx.to_flat_state(model.params)}
        for path, (axis, parts) in rules.items():
            n = flat[path].get_value().shape[axis]
            counts = np.bincount(np.concatenate(parts), minlength=n)
            assert len(counts) == n and counts.min() >= 1, path
            assert len(set(counts.tolist())) <= 2, path  # B/C groups may be replicated, the rest is split once
            assert len({len(p) for p in parts}) == 1, path
        names = {p[-2] if p[-1] in ("weight", "bias") else p[-1] for p in rules}
        assert {"o_proj", "out_proj", "down_proj", "in_proj_qkv" if "Qwen" in model.config.architecture
                else "in_proj"} <= names
        replicated = [".".join(map(str, p)) for p in flat if p not in rules]
        assert all("norm" in p or "embed" in p or "lm_head" in p for p in replicated), replicated


def test_mamba2_in_proj_rows_follow_the_packing():
    """NemotronH fixture at TP=4: 4 heads of 16, 2 groups of N; device 3 holds head 3 and group 1."""
    from flax import nnx

    from umem_jax.models.loader import load_model

    model = load_model(FIXTURES / "nemotron_h_tiny")
    mixer = nnx.merge(model.graphdef, model.params).layers[0].mixer
    h, p, n, g = mixer.num_heads, mixer.head_dim, mixer.state_size, mixer.n_groups
    di = h * p
    axis, parts = split_indices(mixer, 4)[("in_proj", "weight")]
    rows = parts[3]
    want = np.concatenate([np.arange(3 * p, 4 * p), di + np.arange(3 * p, 4 * p), 2 * di + np.arange(n, 2 * n),
                           2 * di + g * n + np.arange(n, 2 * n), [2 * di + 2 * g * n + 3]])
    assert axis == 0 and rows.tolist() == want.tolist()


# ----------------------------------------------------------------------------- several devices


def _run_worker(sections: list[str], timeout: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    env["JAX_PLATFORMS"] = "cpu"
    # The worker imports this checkout's umem_jax whether or not (or wherever) it is installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), env.get("PYTHONPATH", "")) if p)
    # Six step compilations are most of this test's time, and most of each is XLA:CPU's LLVM
    # code generation.  JAX_DISABLE_MOST_OPTIMIZATIONS only turns that down (jax/_src/compiler.py:
    # xla_backend_optimization_level=0, no expensive LLVM passes); the HLO passes that decide
    # copies and buffer aliasing run as always, so what is checked here is unchanged (the TP=2
    # decode step compiled fully optimised gave the same tokens, alias and temp bytes).
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    proc = subprocess.run([sys.executable, str(HERE / "_tp_worker.py"), *sections], env=env, cwd=HERE.parent,
                          capture_output=True, text=True, timeout=timeout, check=False)  # the assert says why
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tp2_and_tp4_match_tp1_on_several_devices(request):
    sections = ["tiny", "dense"]
    if long_tests_enabled(request.config):
        sections += ["arena-fixtures", "engine-fixtures"]
    got = _run_worker(sections, timeout=1800)
    tiny = got["tiny"]
    for tp in (2, 4):
        assert tiny[f"tp{tp}"]["alias_bytes"] >= tiny[f"tp{tp}"]["shard_bytes"]
        assert tiny[f"tp{tp}"]["moved_pages"] > 0  # page moves ran per shard too
    assert set(got["dense"]) == {"nemotron_h_tp2", "nemotron_h_tp4", "qwen3_5_tp2"}


def test_speculation_with_a_split_draft_or_head_matches_tp1():
    """Methods draft and mtp at TP=2: the draft model or the MTP head split over the devices as
    the target (the worker's `speculative` section says what is checked)."""
    got = _run_worker(["speculative"], timeout=900)["speculative"]
    assert 0.0 < got["acceptance_rate"] < 1.0 and got["mtp_acceptance_rate"] > 0.0, got


# ----------------------------------------------------------------------------- MoE


def test_moe_split_gives_each_device_its_gate_and_up_columns():
    """gate_up_proj [E, d, 2I] at TP=2: device r holds gate columns [r*I/2, (r+1)*I/2) then the
    same up columns (offset I), so its local matrix is again gate | up; down_proj rows match;
    the router and the down bias stay whole."""
    from flax import nnx

    from umem_jax.models.moe import MoE, MoEConfig

    cfg = MoEConfig(num_experts=5, top_k=2, intermediate_size=8, expert_kind="gpt_oss", expert_bias=True,
                    scoring="topk_softmax", router_bias=True)
    rules = split_indices(nnx.eval_shape(lambda: MoE(16, cfg, dtype=np.float32, rngs=nnx.Rngs(0))), 2)
    axis, parts = rules[("experts", "gate_up_proj")]
    assert axis == 2 and [p.tolist() for p in parts] == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert rules[("experts", "gate_up_proj_bias")][0] == 1
    assert rules[("experts", "down_proj")][0] == 1 and rules[("experts", "down_proj")][1][1].tolist() == [4, 5, 6, 7]
    assert not {("gate", "weight"), ("gate", "bias"), ("experts", "down_proj_bias")} & set(rules)


def test_moe_tp_that_splits_an_expert_unevenly_is_refused():
    from umem_jax.models.moe import MoEConfig

    @dataclasses.dataclass(frozen=True)
    class WithMoE(type(tiny_config())):
        moe: MoEConfig | None = None

    cfg = WithMoE(**{f.name: getattr(tiny_config(), f.name) for f in dataclasses.fields(tiny_config())},
                  moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=12, shared_intermediate_size=6))
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=6"):
        check_tp(cfg, 4)
    two = local_config(cfg, 2)
    assert (two.moe.intermediate_size, two.moe.shared_intermediate_size, two.moe.num_experts) == (6, 3, 4)


def test_moe_layer_tp2_and_tp4_match_tp1_on_several_devices():
    """Split by width (ragged, gather) and whole experts (ragged, gather, the expert GEMV); the
    shared expert joined to each device's experts (TP=2, EP=2; rows and ragged)."""
    got = _run_worker(["moe"], timeout=600)["moe"]
    assert len(got) == 12 + 18 + 8 and max(got.values()) < 1e-5


def test_moe_fixtures_with_expert_parallelism_match_tp1():
    got = _run_worker(["expert-parallel"], timeout=600)["expert-parallel"]
    assert set(got) == {"gpt_oss_tiny", "qwen3_5_moe_tiny", "qwen3_5_moe_tiny_mtp"}


def test_expert_parallel_split_gives_each_device_whole_experts():
    """gate_up_proj [E, d, 2I] at TP=2 with expert parallelism: device r holds experts
    [r*E/2, (r+1)*E/2) whole, biases too; the router stays whole; tp must divide E."""
    from flax import nnx

    from umem_jax.models.moe import MoE, MoEConfig

    cfg = MoEConfig(num_experts=6, top_k=2, intermediate_size=8, expert_kind="gpt_oss", expert_bias=True,
                    scoring="topk_softmax", router_bias=True, shared_intermediate_size=4)
    rules = split_indices(nnx.eval_shape(lambda: MoE(16, cfg, dtype=np.float32, rngs=nnx.Rngs(0))), 2,
                          expert_parallel=True)
    for leaf in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        axis, parts = rules[("experts", leaf)]
        assert axis == 0 and [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5]], leaf
    assert rules[("shared_expert", "up_proj", "weight")][0] == 0  # the shared expert: split by width as ever
    assert not {("gate", "weight"), ("gate", "bias")} & set(rules)

    @dataclasses.dataclass(frozen=True)
    class WithMoE(type(tiny_config())):
        moe: MoEConfig | None = None

    model_cfg = WithMoE(**{f.name: getattr(tiny_config(), f.name) for f in dataclasses.fields(tiny_config())}, moe=cfg)
    two = local_config(model_cfg, 2, expert_parallel=True)
    assert (two.moe.num_experts, two.moe.local_experts, two.moe.intermediate_size) == (6, 3, 8)
    with pytest.raises(ValueError, match="num_experts=6"):
        check_tp(model_cfg, 4, expert_parallel=True)
    check_tp(dataclasses.replace(model_cfg, moe=dataclasses.replace(cfg, intermediate_size=12)), 4)  # by width: fine


def test_expert_parallel_on_a_model_without_moe_is_refused():
    from umem_jax import LLM

    with pytest.raises(ValueError, match="no MoE layers"):
        LLM("tiny", enable_expert_parallel=True, arena_bytes=1 << 20)
