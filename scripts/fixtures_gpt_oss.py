"""The gpt-oss fixture (needs torch + transformers): tests/fixtures/gpt_oss_tiny.

    python scripts/make_fixtures.py --family gpt_oss

The model: 2 layers (sliding window 8, then full attention: gpt-oss's alternation), 4 q / 2 kv heads
of 16 with q/k/v/o biases and sinks, yarn RoPE as gpt-oss-20b has it (theta 150000, x32 over 4096,
untruncated), hidden 32, 4 experts top-2 of intermediate 32 (the smallest MXFP4 can block), untied
LM head, fp32.  Every parameter is re-randomised: norms ~N(1, 0.3), sinks ~N(0, 1), the experts'
gate_up ~N(0, 0.6) (so the SwiGLU clamp at +-7 bites), their biases ~N(0, 0.5), the rest ~N(0, 0.15).
The seed is the first (in steps of 10) whose routing margin (gap between each token's k-th and
(k+1)-th router logit) is >= 1e-4 and greedy margin (top-2 logit gap) >= 1e-3 in both the fp32
and the MXFP4 model, so fp32 rounding cannot flip a choice.

Files: config.json + model.safetensors (transformers' save_pretrained: experts as gate_up_proj
[E, d, 2I] with gate/up interleaved), expected.npz (per prompt: ids, 32 greedy ids, cache-free
logits over prompt + greedy), mxfp4.npz (every layer's experts quantised to MXFP4 as the hub
checkpoints store them, `model.layers.{i}.mlp.experts.{gate_up,down}_proj_{blocks,scales}`, and
`short_logits`: transformers' logits over the short sequence after it loaded that MXFP4 checkpoint
and dequantised it itself; `random_blocks` / `random_scales`: random bytes of 3 blocks a row, and
`random_dequant`: transformers' convert_moe_packed_tensors of them), rope_cases.json
(transformers' yarn inv_freq and attention factor for several rope_parameters).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
from fixture_kit import FIXTURES, NEW_TOKENS, PROMPTS

from umem_jax.models.mxfp4 import quantize_mxfp4

YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096}
TINY_GPT_OSS = dict(
    vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
    num_local_experts=4, num_experts_per_tok=2, rope_parameters=YARN, max_position_embeddings=131072,
    rms_norm_eps=1e-5, swiglu_limit=7.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
# yarn variants for rope_cases.json: (head_dim, max_position_embeddings, rope_parameters)
ROPE_CASES = [
    (64, 131072, YARN),
    (64, 131072, {k: v for k, v in YARN.items() if k != "truncate"}),  # absent truncate: floor / ceil
    (64, 163840, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                  "mscale": 0.707, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}),
    (128, 8192, {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "attention_factor": 1.2, "truncate": False,
                 "original_max_position_embeddings": 2048}),
]
MIN_ROUTING_MARGIN, MIN_GREEDY_MARGIN = 1e-4, 1e-3


def _rerandomise(model, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * r)
            elif name.endswith("sinks"):
                p.copy_(r)
            elif name.endswith("experts.gate_up_proj"):
                p.copy_(0.6 * r)
            elif "experts" in name and name.endswith("_bias"):
                p.copy_(0.5 * r)
            else:
                p.copy_(0.15 * r)


def _sequences(model) -> dict:
    """Per prompt: ids and greedy continuation (transformers' cached generate), the same rng as
    make_fixtures' other families."""
    import torch

    rng = np.random.default_rng(7)
    out = {}
    for name, n in PROMPTS.items():
        ids = torch.tensor(rng.integers(3, 128, size=(1, n)), dtype=torch.long)
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        out[name] = gen
    return out


def _margins(model, seqs: dict) -> tuple[float, float]:
    """(routing margin, greedy margin) of the cache-free forward over every sequence."""
    import torch

    k, gaps = model.config.num_experts_per_tok, []
    hook = lambda _m, _i, out: gaps.append(float((lambda t: (t[:, k - 1] - t[:, k]).min())(
        torch.topk(out[0].float(), k + 1, dim=-1).values)))
    handles = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("mlp.router")]
    greedy = []
    with torch.no_grad():
        for name, gen in seqs.items():
            lg = model(gen, use_cache=False).logits[0]
            top2 = torch.topk(lg[PROMPTS[name] - 1:], 2, dim=-1).values
            greedy.append(float((top2[:, 0] - top2[:, 1]).min()))
    for h in handles:
        h.remove()
    return min(gaps), min(greedy)


def _mxfp4_tensors(model) -> dict[str, np.ndarray]:
    """Every layer's expert weights as the hub stores them: [E, out, in] quantised along `in`."""
    out = {}
    for name, p in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(p.detach().numpy())  # [E, in, out] -> [E, out, G, 16]
            out[f"{name}_blocks"], out[f"{name}_scales"] = blocks, scales
    return out


def _load_mxfp4(model, quantised: dict, tmp: Path):
    """Save `model` with its experts replaced by `quantised`, as an MXFP4 checkpoint, and load it
    back in transformers (which dequantises it on CPU)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model.save_pretrained(tmp, safe_serialization=True)
    t = {k: v for k, v in load_file(tmp / "model.safetensors").items()
         if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    t.update({k: torch.from_numpy(v) for k, v in quantised.items()})
    save_file(t, tmp / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tmp / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp / "config.json").write_text(json.dumps(cfg))
    return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager").eval()


def random_dequant() -> dict[str, np.ndarray]:
    """Random MXFP4 bytes (3 blocks a row, so the block order shows) and transformers' dequantisation
    of them ([E, rows, G, 16] -> [E, G * 32, rows])."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(8)
    blocks = rng.integers(0, 256, size=(2, 4, 3, 16), dtype=np.uint8)
    scales = rng.integers(127 - 20, 127 + 20, size=(2, 4, 3), dtype=np.uint8)
    hf = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    return {"random_blocks": blocks, "random_scales": scales, "random_dequant": hf.numpy()}


def rope_cases() -> list[dict]:
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = []
    for head_dim, max_pos, params in ROPE_CASES:
        cfg = GptOssConfig(head_dim=head_dim, max_position_embeddings=max_pos, rope_parameters=dict(params))
        inv, scaling = ROPE_INIT_FUNCTIONS["yarn"](cfg)
        cases.append({"head_dim": head_dim, "max_position_embeddings": max_pos, "rope_parameters": params,
                      "inv_freq": inv.tolist(), "attention_scaling": float(scaling)})
    return cases


def make_gpt_oss(out: Path = FIXTURES / "gpt_oss_tiny", seed: int = 3000):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gpt_oss", **TINY_GPT_OSS)
    for s in range(seed, seed + 400, 10):
        torch.manual_seed(s)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
        _rerandomise(model, s + 1)
        seqs = _sequences(model)
        quantised = _mxfp4_tensors(model)
        with tempfile.TemporaryDirectory() as tmp:
            q_model = _load_mxfp4(model, quantised, Path(tmp))
        margins = [*_margins(model, seqs), *_margins(q_model, {"short": seqs["short"]})]
        print(f"  seed {s}: routing / greedy margins fp32 {margins[0]:.1e} / {margins[1]:.1e}, "
              f"mxfp4 {margins[2]:.1e} / {margins[3]:.1e}")
        if min(margins[0], margins[2]) >= MIN_ROUTING_MARGIN and min(margins[1], margins[3]) >= MIN_GREEDY_MARGIN:
            break
    else:
        raise RuntimeError("no seed gave clear routing and greedy margins")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    arrays = {}
    with torch.no_grad():
        for name, gen in seqs.items():
            n = PROMPTS[name]
            arrays[f"{name}_prompt"] = gen[0, :n].numpy().astype(np.int32)
            arrays[f"{name}_greedy"] = gen[0, n:].numpy().astype(np.int32)
            arrays[f"{name}_logits"] = model(gen, use_cache=False).logits[0].numpy().astype(np.float32)
        q_logits = q_model(seqs["short"], use_cache=False).logits[0].numpy().astype(np.float32)
    np.savez_compressed(out / "expected.npz", **arrays)
    np.savez_compressed(out / "mxfp4.npz", short_logits=q_logits, **quantised, **random_dequant())
    (out / "rope_cases.json").write_text(json.dumps(rope_cases(), indent=1) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1024:.0f} KB)")
