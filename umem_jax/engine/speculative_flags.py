"""The command line's speculative decoding flags, as vLLM and SGLang users know them.

    --speculative-config JSON          vLLM: '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 3}'
    --speculative-method draft|mtp     (SGLang's --speculative-algorithm STANDALONE|NEXTN|MTP also works)
    --num-speculative-tokens K         (SGLang: --speculative-num-draft-tokens is K+1, the verified tokens)
    --speculative-draft-model PATH     (SGLang: --speculative-draft-model-path)
    --speculative-min-acceptance RATE  ours: below it a request stops speculating (default 0.3, 0: never)

The separate flags override the JSON's fields.  `from_flags` turns them into the dict that
EngineConfig(speculative_config=...) takes (None: speculation off); SpeculativeConfig checks
the values.  No JAX here: the CLI imports it before choosing a platform.
"""

from __future__ import annotations

import argparse
import json

# method names of vLLM (draft_model) and SGLang (--speculative-algorithm) -> ours
METHOD_ALIASES = {"draft": "draft", "draft_model": "draft", "standalone": "draft", "mtp": "mtp", "nextn": "mtp",
                  "deepseek_mtp": "mtp", "qwen3_next_mtp": "mtp"}
_JSON_FIELDS = ("method", "model", "num_speculative_tokens", "min_acceptance")


def add_flags(p: argparse.ArgumentParser) -> None:
    """The speculative decoding flags of serve / generate."""
    g = p.add_argument_group("speculative decoding (off by default)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='vLLM\'s form: {"method": "draft_model" | "mtp", "model": PATH, "num_speculative_tokens": K}')
    g.add_argument("--speculative-method", "--speculative-algorithm", dest="speculative_method", default=None,
                   help="draft (a separate draft model; SGLang's STANDALONE) | mtp (the target's MTP layers; "
                   "SGLang's NEXTN)")
    g.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="draft tokens proposed and verified per decode step, 1..8 (default 3)")
    g.add_argument("--speculative-num-draft-tokens", type=int, default=None, metavar="K1",
                   help="SGLang's count of verified tokens per step: K1 = K + 1")
    g.add_argument("--speculative-draft-model", "--speculative-draft-model-path", dest="speculative_draft_model",
                   default=None, metavar="PATH", help="the draft model: a checkpoint or a built-in name")
    g.add_argument("--speculative-min-acceptance", type=float, default=None, metavar="RATE",
                   help="a request whose drafts are accepted at a lower rate over its first 8 verifies (and on) "
                   "stops speculating and decodes plainly (default 0.3; 0: never)")


def from_flags(args) -> dict | None:
    """The speculative_config the flags ask for -> dict, or None (no flag given)."""
    out = {}
    text = getattr(args, "speculative_config", None)
    if text:
        try:
            out = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(out, dict):
            raise ValueError("--speculative-config must be a JSON object")
        unknown = sorted(set(out) - set(_JSON_FIELDS))
        if unknown:
            raise ValueError(f"--speculative-config fields {unknown} are not supported (known: {list(_JSON_FIELDS)})")
    k1 = getattr(args, "speculative_num_draft_tokens", None)
    flags = {"method": getattr(args, "speculative_method", None), "model": getattr(args, "speculative_draft_model", None),
             "num_speculative_tokens": getattr(args, "num_speculative_tokens", None),
             "min_acceptance": getattr(args, "speculative_min_acceptance", None)}
    if flags["num_speculative_tokens"] is None and k1 is not None:
        flags["num_speculative_tokens"] = k1 - 1
    out.update({k: v for k, v in flags.items() if v is not None})
    if not out:
        return None
    if "method" in out:
        out["method"] = method_name(out["method"])
    return out


def method_name(method) -> str:
    """Our name of a vLLM / SGLang method name (case-insensitive); unknown names are kept, so
    SpeculativeConfig refuses them by name."""
    return METHOD_ALIASES.get(str(method).lower(), method)


__all__ = ["METHOD_ALIASES", "add_flags", "from_flags", "method_name"]
