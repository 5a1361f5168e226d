"""The tiny NemotronH MoE fixture (tests/fixtures/nemotron_h_moe_tiny), made with transformers.

    python scripts/make_fixtures.py --family nemotron_h_moe
    python scripts/fixtures_nemotron_moe.py          # the same

Six blocks "ME*-ME": every NemotronH block kind (Mamba2, MoE, NoPE attention, relu^2 MLP).  The MoE
blocks are Nemotron 3 Nano's kind at a tiny size: 8 relu^2 experts (no gate) of 8, top-2, one
shared relu^2 expert of 16, sigmoid routing with e_score_correction_bias, norm_topk_prob and
routed_scaling_factor 2.5 (Nano's), and grouped selection (4 groups of 2, the best 2 groups kept by
their top-2 sums; Nano itself has n_group = topk_group = 1, so the grouping is the code path the
family shares with DeepSeek-V3-style routers).  Every parameter is re-randomised, and so is the
e_score_correction_bias buffer (transformers initialises it to zeros, which would hide it).

transformers' save_pretrained writes the hub names: `backbone.layers.{i}.mixer.experts.{j}.up_proj.weight`
[I, d] / `...down_proj.weight` [d, I] per expert, `mixer.gate.weight` [E, d],
`mixer.gate.e_score_correction_bias` [E] and `mixer.shared_experts.{up,down}_proj.weight`.
expected.npz is fixture_kit.expected_hybrid's (prompt, greedy, cache-free and step logits, the
state after prefill); the script refuses a seed whose routing has a near tie (an expert choice a
rounding difference could flip).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixture_kit import FIXTURES, NEW_TOKENS, PROMPTS, build_tiny, expected_hybrid

NAME = "nemotron_h_moe_tiny"
TINY_NEMOTRON_H_MOE = {
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 32, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8,
    "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"],
    "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 2, "conv_kernel": 4,
    "chunk_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
    "moe_shared_expert_intermediate_size": 16, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "time_step_min": 1e-3, "tie_word_embeddings": False, "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 0, "max_position_embeddings": 512,
}
HUB_KEYS = {"hybrid_override_pattern": "ME*-ME", "num_hidden_layers": 6, "mamba_n_groups": 2, "mamba_d_conv": 4,
            "mamba_chunk_size": 16, "mamba_dt_min": 1e-3, "torch_dtype": "float32"}
SEED = 2026
MIN_MARGIN = 1e-4  # smallest allowed gap at a routing decision (fp32 rounding is ~1e-7)


def _randomise_bias(model, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=gen))


def routing_margins(model, sequences) -> float:
    """Smallest gap, over every token of `sequences` at every MoE block, between the last chosen
    and the first unchosen group score and expert score (transformers' own rule, recomputed)."""
    import torch

    worst = [float("inf")]

    def hook(router, args, _out):
        x = args[0].reshape(-1, router.hidden_dim).float()
        s = torch.sigmoid(x @ router.weight.float().T) + router.e_score_correction_bias
        g = s.view(len(s), router.num_group, -1).topk(2, dim=-1)[0].sum(-1).sort(-1, descending=True)[0]
        if router.topk_group < router.num_group:
            worst[0] = min(worst[0], float((g[:, router.topk_group - 1] - g[:, router.topk_group]).min()))
        keep = s.view(len(s), router.num_group, -1).topk(2, dim=-1)[0].sum(-1).topk(router.topk_group, -1)[1]
        mask = torch.zeros(len(s), router.num_group, dtype=torch.bool).scatter_(1, keep, True)
        masked = s.masked_fill(~mask.repeat_interleave(s.shape[1] // router.num_group, 1), float("-inf"))
        top = masked.sort(-1, descending=True)[0]
        worst[0] = min(worst[0], float((top[:, router.top_k - 1] - top[:, router.top_k]).min()))

    routers = [m for n, m in model.named_modules() if n.endswith("mixer.gate")]
    handles = [r.register_forward_hook(hook) for r in routers]
    with torch.no_grad():
        for seq in sequences:
            model(torch.as_tensor(seq[None]), use_cache=False)
    for h in handles:
        h.remove()
    return worst[0]


def make(out: Path, seed: int = SEED):
    model = build_tiny("nemotron_h", TINY_NEMOTRON_H_MOE, out, seed, HUB_KEYS)
    _randomise_bias(model, seed + 2)
    model.save_pretrained(out, safe_serialization=True)  # again: the bias is not a parameter
    expected_hybrid(model, out / "expected.npz")
    e = np.load(out / "expected.npz")
    seqs = [np.concatenate([e[f"{n}_prompt"], e[f"{n}_greedy"]]).astype(np.int64) for n in PROMPTS]
    assert all(len(s) == PROMPTS[n] + NEW_TOKENS for s, n in zip(seqs, PROMPTS))
    margin = routing_margins(model, seqs)
    print(f"  {NAME}: min routing margin {margin:.2e}")
    if margin < MIN_MARGIN:
        raise SystemExit(f"seed {seed}: a routing decision has margin {margin:.1e} < {MIN_MARGIN}; pick another")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=FIXTURES)
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args()
    make(args.out / NAME, args.seed)
    print("wrote", args.out / NAME)


if __name__ == "__main__":
    main()
