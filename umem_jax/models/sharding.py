"""Megatron-style split of a model over the `tp` axis: the per-device config and weights.

The split is written per layer class of this package (Attention, MLP, UngatedMLP, Mamba2Mixer,
GatedDeltaNet, MoE): a family built from these layers splits with no code of its own.

Each device runs the *same* model code on its slice: `local_config(cfg, tp)` is the model a
device sees (query, KV, Mamba2 and gated-DeltaNet heads and the MLP width divided by tp), so its
memory declarations -- hence the plan, page tables, slots and every host allocator decision --
are the same on every device.  `split_params` gives each weight as a stacked [tp, *local] array
(device r holds row r) or, for what every device needs whole, replicated:

    column-parallel (output dim split)   q/k/v_proj, gate/up_proj, Mamba2 in_proj, GDN in_proj_*,
                                          MoE experts' gate_up_proj / up_proj (and their biases)
    row-parallel (input dim split, psum)  o_proj, down_proj, out_proj, MoE experts' down_proj
    per head                              Mamba2 conv1d/A_log/D/dt_bias/norm, GDN conv1d/A_log/dt_bias,
                                          attention sinks, fp8 K/V scales (k_scale, v_scale)
    replicated                            embeddings, lm_head, every norm over the hidden size,
                                          q/k norms, GDN's per-head-dim norm, the MoE router (weight,
                                          bias, e_score_correction_bias), the shared expert's gate

A Linear's bias follows its weight: split with the columns of a column-parallel projection,
replicated for a row-parallel one (Linear adds it once, after the psum).  The MoE experts'
intermediate dimension is split like an MLP's: device r holds [gate_r | up_r] of every expert's
gate_up_proj (the two halves are split separately, so its local matrix is again gate | up) and
the matching rows of down_proj; Experts psums its routed sum, then adds the down bias once.  The
shared expert is an MLP and splits as one.

Expert parallelism (`expert_parallel=True`, vLLM's --enable-expert-parallel) splits the routed
experts whole instead: device r holds experts [r*E/tp, (r+1)*E/tp) at full width (gate_up_proj,
down_proj and both biases along the expert axis), computes only the (token, expert) pairs routed
to them and psums, so the collective is the same one all-reduce.  Each expert's matmuls keep
their full intermediate width (a split of Qwen3.5-MoE's 512 columns over 8 devices leaves 64);
tp must divide num_experts instead of the experts' width.  Attention, the MLPs and the shared
expert split as above.

Heads are split whole and in order: device r holds heads [r*H/tp, (r+1)*H/tp).  When a model
has fewer KV heads (or Mamba2 groups) than devices, each device holds the one its query heads
(Mamba2 heads) read, so a KV head lives on tp/H_kv devices.  Mamba2's in_proj packs
z | x | B | C | dt, so its rows (and the conv channels x | B | C) are gathered per piece; a
gated norm whose group spans devices adds its statistics over them (collectives.group_sum).

The row-parallel Linears and split norms of the per-device module are marked here
(`reduce_axis`), by the same table that splits their weights, so the two cannot disagree.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..parallel.collectives import TP_AXIS
from .attention import Attention
from .config import RECURRENT, ModelConfig
from .gdn_mixer import GatedDeltaNet
from .layers import MLP, UngatedMLP
from .mamba2_mixer import Mamba2Mixer
from .moe import MoE

# ----------------------------------------------------------------------------- config


def _divides(tp: int, n: int, what: str, why: str, *, or_multiple: bool = False) -> None:
    if n % tp == 0 or (or_multiple and tp % n == 0):
        return
    alt = f" (or be a multiple of it: each of them is then replicated on tp/{n} devices)" if or_multiple else ""
    raise ValueError(f"tensor_parallel_size={tp} must divide {what}={n}{alt}: {why}")


def _has_gdn(cfg: ModelConfig) -> bool:
    return RECURRENT in cfg.layer_types and hasattr(cfg, "linear_num_key_heads")


def _has_mamba2(cfg: ModelConfig) -> bool:
    return RECURRENT in cfg.layer_types and cfg.mamba is not None and not _has_gdn(cfg)


def check_tp(cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> None:
    """Raise ValueError (saying why) unless `tp` splits every layer of `cfg` into whole heads
    (and, with expert_parallel, the routed experts into whole experts)."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    if tp == 1:
        return
    _divides(tp, cfg.num_heads, "num_attention_heads", "each device computes whole query heads")
    _divides(tp, cfg.num_kv_heads, "num_key_value_heads",
             "each device keeps whole KV heads in its slice of every page", or_multiple=True)
    _divides(tp, cfg.intermediate_size, "intermediate_size", "the MLP is split by columns")
    if _has_mamba2(cfg):
        m = cfg.mamba
        _divides(tp, m.num_heads, "mamba_num_heads", "each device keeps whole Mamba2 heads in its state slots")
        _divides(tp, m.n_groups, "mamba n_groups", "B/C groups are split with the heads that read them",
                 or_multiple=True)
    if _has_gdn(cfg):
        _divides(tp, cfg.linear_num_key_heads, "linear_num_key_heads",
                 "each device keeps whole gated-DeltaNet key heads (and their value heads) in its state slots")
    moe = getattr(cfg, "moe", None)
    if moe is not None:
        if expert_parallel:
            _divides(tp, moe.num_experts, "num_experts", "expert parallelism gives each device whole experts")
        else:
            _divides(tp, moe.intermediate_size, "moe_intermediate_size", "every expert's MLP is split by columns")
        _divides(tp, moe.shared_intermediate_size, "shared_expert_intermediate_size",
                 "the shared expert is split by columns")


def local_config(cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> ModelConfig:
    """The config of the model one device of a `tp`-way split runs (checked by check_tp)."""
    check_tp(cfg, tp, expert_parallel)
    if tp == 1:
        return cfg
    kw = {"num_heads": cfg.num_heads // tp, "num_kv_heads": max(cfg.num_kv_heads // tp, 1),
              "intermediate_size": cfg.intermediate_size // tp}
    if _has_mamba2(cfg):
        m = cfg.mamba
        kw["mamba"] = dataclasses.replace(m, num_heads=m.num_heads // tp, n_groups=max(m.n_groups // tp, 1))
    if _has_gdn(cfg):
        kw.update(linear_num_key_heads=cfg.linear_num_key_heads // tp,
                  linear_num_value_heads=cfg.linear_num_value_heads // tp)
    moe = getattr(cfg, "moe", None)
    if moe is not None:
        routed = dict(expert_shards=tp) if expert_parallel else dict(intermediate_size=moe.intermediate_size // tp)
        kw["moe"] = dataclasses.replace(moe, shared_intermediate_size=moe.shared_intermediate_size // tp, **routed)
    return dataclasses.replace(cfg, **kw)


# ----------------------------------------------------------------------------- index rules


def _units(n: int, tp: int, r: int) -> np.ndarray:
    """Which of n heads (or groups) device r holds: its contiguous block, or when n < tp the
    one it shares with its tp/n neighbours."""
    if n % tp == 0:
        k = n // tp
        return np.arange(r * k, (r + 1) * k)
    return np.array([r // (tp // n)])


def _channels(units: np.ndarray, width: int, offset: int = 0) -> np.ndarray:
    """The channels [u*width, (u+1)*width) of every unit u, shifted by offset."""
    return offset + (units[:, None] * width + np.arange(width)[None, :]).reshape(-1)


def _rules(module, tp: int, r: int, ep: bool = False) -> tuple[dict, list, list]:
    """Device r's slice of one module's weights -> ({param path: (axis, indices)},
    [row-parallel Linear names (or Experts)], [(split norm name, group_shards)]).  Unknown
    modules: no rule.  A column-parallel Linear's bias is split with its rows.  ep: the MoE
    experts split whole (expert parallelism)."""
    split, linears, norms = _layer_rules(module, tp, r, ep)
    for (name, *leaf), (axis, idx) in list(split.items()):
        child = getattr(module, name, None) if leaf == ["weight"] and axis == 0 else None
        if getattr(child, "bias", None) is not None:
            split[(name, "bias")] = (0, idx)
    return split, linears, norms


def _moe_rules(module: MoE, tp: int, r: int, ep: bool) -> dict:
    """The routed experts' intermediate columns: [gate_r | up_r] of gate_up, rows of down; with
    ep, device r's whole experts (every expert leaf along axis 0)."""
    cfg = module.cfg
    name = module.experts.first_name
    if ep:
        mine = _units(cfg.num_experts, tp, r)
        leaves = [name, "down_proj"] + ([name + "_bias", "down_proj_bias"] if cfg.expert_bias else [])
        return {("experts", leaf): (0, mine) for leaf in leaves}
    i = cfg.intermediate_size
    cols = _units(i, tp, r)
    first = cols if cfg.expert_kind == "ungated" else np.concatenate([cols, i + cols])
    out = {("experts", name): (2, first), ("experts", "down_proj"): (1, cols)}
    if cfg.expert_bias:
        out[("experts", name + "_bias")] = (1, first)
    return out


def _layer_rules(module, tp: int, r: int, ep: bool = False) -> tuple[dict, list, list]:
    if isinstance(module, MoE):
        return _moe_rules(module, tp, r, ep), ["experts"], []
    if isinstance(module, Attention):
        hq, hkv, hd = module.num_heads, module.num_kv_heads, module.head_dim
        q_heads, kv_heads = _units(hq, tp, r), _units(hkv, tp, r)
        q_rows = module.q_proj.weight.shape[0] // hq  # hd, or 2*hd for Qwen3.5's query|gate heads
        out = {("q_proj", "weight"): (0, _channels(q_heads, q_rows)),
               ("k_proj", "weight"): (0, _channels(kv_heads, hd)),
               ("v_proj", "weight"): (0, _channels(kv_heads, hd)),
               ("o_proj", "weight"): (1, _channels(q_heads, hd))}
        if getattr(module, "sinks", None) is not None:
            out[("sinks",)] = (0, q_heads)
        out[("k_scale",)] = out[("v_scale",)] = (0, kv_heads)  # fp8 K/V scales, one per kv head
        return out, ["o_proj"], []
    if isinstance(module, (MLP, UngatedMLP)):
        n = module.up_proj.weight.shape[0]
        cols = _units(n, tp, r)
        out = {("up_proj", "weight"): (0, cols), ("down_proj", "weight"): (1, cols)}
        if isinstance(module, MLP):
            out[("gate_proj", "weight")] = (0, cols)
        return out, ["down_proj"], []
    if isinstance(module, Mamba2Mixer):
        h, p, n, g = module.num_heads, module.head_dim, module.state_size, module.n_groups
        d_inner = module.d_inner
        heads, groups = _units(h, tp, r), _units(g, tp, r)
        x = _channels(heads, p)
        conv = np.concatenate([x, _channels(groups, n, d_inner), _channels(groups, n, d_inner + g * n)])
        rows = np.concatenate([x, d_inner + conv, 2 * d_inner + 2 * g * n + heads])  # z | x B C | dt
        out = {("in_proj", "weight"): (0, rows), ("conv1d", "weight"): (0, conv), ("A_log",): (0, heads),
               ("D",): (0, heads), ("dt_bias",): (0, heads), ("norm", "weight"): (0, x),
               ("out_proj", "weight"): (1, x)}
        if module.conv1d.bias is not None:
            out[("conv1d", "bias")] = (0, conv)
        return out, ["out_proj"], ([("norm", tp // g)] if g < tp else [])
    if isinstance(module, GatedDeltaNet):
        key_heads, value_heads = _units(module.k_heads, tp, r), _units(module.v_heads, tp, r)
        kd, vd, key_dim = module.k_dim, module.v_dim, module.key_dim
        qkv = np.concatenate([_channels(key_heads, kd), _channels(key_heads, kd, key_dim),
                              _channels(value_heads, vd, 2 * key_dim)])
        return ({("in_proj_qkv", "weight"): (0, qkv), ("conv1d", "weight"): (0, qkv),
                 ("in_proj_z", "weight"): (0, _channels(value_heads, vd)), ("in_proj_b", "weight"): (0, value_heads),
                 ("in_proj_a", "weight"): (0, value_heads), ("A_log",): (0, value_heads),
                 ("dt_bias",): (0, value_heads), ("out_proj", "weight"): (1, _channels(value_heads, vd))},
                ["out_proj"], [])
    return {}, [], []


def _modules(module):
    """(path, submodule) of every module in the graph (paths as tuples of str/int keys)."""
    from flax import nnx

    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Module):
            yield tuple(path), node


def split_indices(module, tp: int, expert_parallel: bool = False) -> dict[tuple, tuple[int, list[np.ndarray]]]:
    """{param path: (axis, [indices of device r for r in range(tp)])} for every split weight of
    the (global) module; params not listed are replicated."""
    out: dict[tuple, tuple[int, list]] = {}
    for path, mod in _modules(module):
        for r in range(tp):
            for rel, (axis, idx) in _rules(mod, tp, r, expert_parallel)[0].items():
                out.setdefault(path + rel, (axis, []))[1].append(idx)
    return out


def mark_local(local_module, global_module, tp: int, expert_parallel: bool = False) -> None:
    """Set `reduce_axis` on the per-device module's row-parallel Linears and split norms, and
    `expert_axis` on its Experts under expert parallelism (the same table as split_indices;
    rank 0's answer, every rank has the same marks)."""
    local = dict(_modules(local_module))
    for path, mod in _modules(global_module):
        _, linears, norms = _rules(mod, tp, 0, expert_parallel)
        for name in linears:
            getattr(local[path], name).reduce_axis = TP_AXIS
            if expert_parallel and isinstance(mod, MoE):
                getattr(local[path], name).expert_axis = TP_AXIS
        for name, shards in norms:
            norm = getattr(local[path], name)
            norm.reduce_axis, norm.group_shards = TP_AXIS, shards


__all__ = ["check_tp", "local_config", "mark_local", "split_indices"]
