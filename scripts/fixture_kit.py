"""What every fixture family shares (scripts/make_fixtures.py and the fixtures_*.py families): the
fixtures folder, the prompts and greedy length of the expected files, a tiny transformers model
built with every parameter re-randomised, and its expected.npz.  Needs torch + transformers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


PROMPTS = {"short": 21, "long": 30}  # prompt lengths, both longer than the window
NEW_TOKENS = 32



def rerandomise(model, seed: int):
    """Every parameter random, so no neutral init hides a bug: zero-centred norms ~N(0, 0.3),
    ones-init norms ~N(1, 0.3), A_log = log U(0.1, 4) (decays the recurrence keeps), dt_bias ~N(0, 1),
    D ~N(1, 0.3), everything else ~N(0, 0.15)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    rand = lambda shape: torch.randn(shape, generator=gen)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(0.1 + 3.9 * torch.rand(p.shape, generator=gen)))
            elif name.endswith("dt_bias"):
                p.copy_(rand(p.shape))
            elif name.endswith(".D"):
                p.copy_(1 + 0.3 * rand(p.shape))
            elif "norm" in name:
                # Qwen3.5's zero-centred norms multiply by (1 + w); the gated norms and all NemotronH
                # norms by w (ones at init).
                ones = "nemotron" in type(model).__name__.lower() or "linear_attn.norm" in name
                p.copy_((1.0 if ones else 0.0) + 0.3 * rand(p.shape))
            else:
                p.copy_(0.15 * rand(p.shape))


def build_tiny(model_type: str, fields: dict, out: Path, seed: int, hub_keys: dict | None = None):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    rerandomise(model, seed + 1)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if hub_keys:
        hub = {k: v for k, v in json.loads((out / "config.json").read_text()).items()
               if k not in ("layers_block_type", "layer_types", "dtype", "time_step_limit")}
        hub.update(hub_keys)
        (out / "config_hub.json").write_text(json.dumps(hub, indent=2, sort_keys=True))
    return model


def small_dt_bias(model) -> dict[str, np.ndarray]:
    """dt_bias of every Mamba2 mixer with heads 1 and 3 pushed to ~-8 (softplus ~3e-4 < 1e-3); the
    heads are picked so no greedy step is a near tie (min top-2 margin > 1e-2)."""
    out = {}
    for name, p in model.named_parameters():
        if name.endswith("dt_bias"):
            v = p.detach().numpy().copy()
            v[[1, 3]] = -8.0 + 0.5 * v[[1, 3]]
            out[name] = v.astype(np.float32)
    return out


def expected_hybrid(model, out_file: Path, *, vocab: int = 128):
    """Per prompt: ids, greedy ids (generate: cached prefill then 1-token decode), the cache-free
    logits over prompt + greedy, generate's per-step logits (the cached path, which differs from
    cache-free where NemotronH's prefill-only dt clamp bites), and every recurrent layer's conv /
    recurrent state after prefilling the prompt (HF layouts: conv [C, K], rec as the cache holds it)."""
    import torch

    rng = np.random.default_rng(7)
    arrays = {}
    for name, n in PROMPTS.items():
        ids = torch.tensor(rng.integers(3, vocab, size=(1, n)), dtype=torch.long)
        with torch.no_grad():
            res = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                                 eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
            gen = res.sequences
            full = model(gen, use_cache=False).logits[0].float().numpy()
            cache = model(ids, use_cache=True).past_key_values
        arrays[f"{name}_prompt"] = ids[0].numpy().astype(np.int32)
        arrays[f"{name}_greedy"] = gen[0, n:].numpy().astype(np.int32)
        arrays[f"{name}_logits"] = full.astype(np.float32)
        arrays[f"{name}_step_logits"] = torch.stack(res.logits, 1)[0].float().numpy()
        for i, layer in enumerate(cache.layers):
            if hasattr(layer, "recurrent_states"):
                arrays[f"{name}_conv{i}"] = layer.conv_states[0][0].float().numpy()
                arrays[f"{name}_rec{i}"] = layer.recurrent_states[0][0].float().numpy()
        step = arrays[f"{name}_step_logits"]
        top2 = np.sort(step, axis=-1)[:, -2:]
        print(f"  {out_file.name} {name}: min greedy margin {float((top2[:, 1] - top2[:, 0]).min()):.2e}, "
              f"max |cache-free - cached| {float(np.abs(full[n - 1:-1] - step).max()):.2e}")
    np.savez_compressed(out_file, **arrays)
