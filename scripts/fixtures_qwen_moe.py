"""The Qwen MoE hybrid fixtures (needs torch + transformers): tests/fixtures/qwen3_5_moe_tiny and
tests/fixtures/qwen3_next_tiny.

    python scripts/make_fixtures.py --family qwen_moe

Both: 4 layers (gated DeltaNet x2, gated attention, gated DeltaNet), GDN 2 key heads serving 4 value
heads of 8, attention 2 q heads / 1 kv head of 16 (partial RoPE: 4 dims), untied LM head, fp32, every
parameter re-randomised (fixture_kit.rerandomise).  The MoE blocks: 8 experts, top-2, a shared
expert with its sigmoid gate.
  * qwen3_5_moe_text: every layer MoE, top-k weights renormalised (Qwen3.5-MoE always does).
  * qwen3_next: layer 1 a dense SwiGLU MLP (mlp_only_layers=[1]), norm_topk_prob=False (the 80B
    has True; the Qwen3.5-MoE fixture covers that), and the GDN's fused in_proj_qkvz / in_proj_ba.
transformers 5.23's save_pretrained writes one tensor per expert (`mlp.experts.{j}.gate_proj.weight`),
the hub layout, so the committed checkpoints are in it; the tests build the fused layout from them.
Each fixture's expected.npz is fixture_kit.expected_hybrid's (prompts, greedy ids, cache-free and
cached logits, GDN states after prefill).  Each takes the first seed whose smallest routing margin
(the gap between a token's k-th and (k+1)-th router probability) is >= 1e-4 and smallest greedy
margin (top-2 logits) >= 1e-3, so fp32 rounding (~1e-6) cannot flip an expert choice or a token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from fixture_kit import FIXTURES, PROMPTS, build_tiny, expected_hybrid

_COMMON = dict(
    vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, tie_word_embeddings=False, max_position_embeddings=512,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4, shared_expert_intermediate_size=8,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
TINY_QWEN3_5_MOE = dict(
    _COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                              "mrope_section": [1, 1, 0], "mrope_interleaved": True})
TINY_QWEN3_NEXT = dict(
    _COMMON, intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False,
    rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.25})


def margins(model, vocab: int = 128) -> tuple[float, float]:
    """(routing, greedy) margins over the fixture's prompts and greedy continuations (the same rng
    as expected_hybrid): the smallest gap between a token's k-th and (k+1)-th router probability in
    any MoE layer, and between the top two logits of any greedy step."""
    import torch

    k = model.config.num_experts_per_tok
    gaps = []

    def hook(_module, _inputs, output):
        probs = torch.softmax(output[0].float(), dim=-1)  # the router returns (logits, scores, indices)
        top = torch.topk(probs, k + 1, dim=-1).values
        gaps.append(float((top[:, k - 1] - top[:, k]).min()))

    handles = [m.register_forward_hook(hook) for name, m in model.named_modules() if name.endswith("mlp.gate")]
    rng = np.random.default_rng(7)
    greedy = []
    with torch.no_grad():
        for _, n in PROMPTS.items():
            ids = torch.tensor(rng.integers(3, vocab, size=(1, n)), dtype=torch.long)
            res = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, return_dict_in_generate=True, output_logits=True)
            model(res.sequences, use_cache=False)
            top2 = torch.topk(torch.stack(res.logits, 1)[0].float(), 2, dim=-1).values
            greedy.append(float((top2[:, 0] - top2[:, 1]).min()))
    for h in handles:
        h.remove()
    return min(gaps), min(greedy)


MIN_ROUTING_MARGIN, MIN_GREEDY_MARGIN = 1e-4, 1e-3


def make(model_type: str, fields: dict, out: Path, seed: int):
    """The first seed from `seed` on (in steps of 10) whose margins are at least the minimums."""
    for s in range(seed, seed + 300, 10):
        model = build_tiny(model_type, fields, out, s)
        routing, greedy = margins(model)
        print(f"  {out.name} seed {s}: min routing margin {routing:.2e}, min greedy margin {greedy:.2e}")
        if routing >= MIN_ROUTING_MARGIN and greedy >= MIN_GREEDY_MARGIN:
            break
    else:
        raise RuntimeError(f"no seed in [{seed}, {seed + 300}) gives margins >= {MIN_ROUTING_MARGIN}, "
                           f"{MIN_GREEDY_MARGIN}")
    expected_hybrid(model, out / "expected.npz")


def main(out: Path = FIXTURES):
    make("qwen3_5_moe_text", TINY_QWEN3_5_MOE, out / "qwen3_5_moe_tiny", 2026)
    make("qwen3_next", TINY_QWEN3_NEXT, out / "qwen3_next_tiny", 2027)


if __name__ == "__main__":
    main()
