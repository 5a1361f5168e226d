"""Datasets: the prompts of `umem-jax bench serve` (and of the sweep's --dataset-name), by the
names `vllm bench serve` and `sglang.bench_serving` use.

    samples = sample(args, tokenizer, vocab_size)   # -> [SampleRequest(prompt, prompt_len, output_len, kind)]
    offsets = arrivals(len(samples), rate=4.0, burstiness=1.0, seed=0)   # seconds from the start

  random                   prompts of random token ids; with a tokenizer they are decoded to text
                           (vLLM's random dataset), without one sent as token ids
  random-ids               random token ids, always sent as ids (SGLang's name): exact prompt lengths
  generated-shared-prefix  --gsp-num-groups groups of --gsp-prompts-per-group prompts; a group's
                           prompts share one --gsp-system-prompt-len system prompt, then each has
                           its own --gsp-question-len question (SGLang's; --num-prompts is ignored)
  sharegpt                 first human turn -> prompt, first reply -> output length, from a local
                           ShareGPT JSON file (--dataset-path; nothing is downloaded)

Lengths of `random`: uniform integers in [L (1 - r), L (1 + r)] for --random-input-len /
--random-output-len L and --random-range-ratio r in [0, 1) (vLLM's rule; SGLang's ratio draws
from [L r, L] instead).  Token ids are drawn in [4, vocab_size): ids below 4 are the special
tokens (pad, bos, eos) of most vocabularies.  ShareGPT lengths are counted with the tokenizer;
without one they are estimated at 4 characters a token (the server's usage gives the real
counts of what ran).  Every draw is seeded by --seed: the same flags give the same prompts.
"""

from __future__ import annotations

import json
import math
import os
from typing import NamedTuple

import numpy as np

DATASETS = ("random", "random-ids", "generated-shared-prefix", "sharegpt")
LOW_ID = 4  # ids below this are special tokens in most vocabularies
CHARS_PER_TOKEN = 4  # ShareGPT length estimate without a tokenizer
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048  # vLLM's filter


class SampleRequest(NamedTuple):
    prompt: str | list[int]  # text, or token ids (sent as an OpenAI token-array prompt)
    prompt_len: int  # tokens: exact for ids, the tokenizer's count for text, else an estimate
    output_len: int  # max_tokens asked
    kind: str  # the dataset's short name, for reports


class ClientTokenizer:
    """The benchmark's own tokenizer (counts and decodes on the client): a tokenizer.json file,
    a directory holding one, or (transformers installed) any AutoTokenizer name or path."""

    def __init__(self, name: str):
        self.name = name
        path = os.path.join(name, "tokenizer.json") if os.path.isdir(name) else name
        if path.endswith(".json") and os.path.isfile(path):
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(path)
            self._encode = lambda text: tok.encode(text, add_special_tokens=False).ids
            self._decode = lambda ids: tok.decode(ids)
            self.vocab_size = tok.get_vocab_size()
            return
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ValueError(f"--tokenizer {name!r}: not a tokenizer.json file or a directory with one, and "
                             "transformers is not installed to load it by name") from None
        tok = AutoTokenizer.from_pretrained(name)
        self._encode = lambda text: tok.encode(text, add_special_tokens=False)
        self._decode = lambda ids: tok.decode(ids)
        self.vocab_size = len(tok)

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def decode(self, ids) -> str:
        return self._decode([int(i) for i in ids])

    def count(self, text: str) -> int:
        return len(self._encode(text)) if text else 0


# ------------------------------------------------------------------------------ flags


def add_arguments(p, *, default: str | None = "random") -> None:
    """The dataset flags, shared by `bench serve` (default random) and the sweep (default None:
    its --workload traces)."""
    p.add_argument("--dataset-name", default=default, choices=DATASETS,
                   help=f"where prompts come from (default {default or 'none: --workload'})")
    p.add_argument("--dataset-path", default=None, help="sharegpt: a local ShareGPT JSON file (no download)")
    p.add_argument("--num-prompts", type=int, default=1000, help="requests (not generated-shared-prefix)")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L (1 - r), L (1 + r)], 0 <= r < 1 (vLLM's rule)")
    p.add_argument("--gsp-num-groups", type=int, default=64)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    p.add_argument("--gsp-question-len", type=int, default=128)
    p.add_argument("--gsp-output-len", type=int, default=256)
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="output length of every sharegpt request (default: its reply's length)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json, a directory with one, or a transformers "
                   "name: decodes random prompts to text, counts sharegpt lengths and (without server usage) "
                   "output tokens")


def sample(args, tokenizer: ClientTokenizer | None, vocab_size: int, *, ids_only: bool = False) -> list[SampleRequest]:
    """The requests the flags in `args` ask for.  ids_only: every prompt as token ids (the
    offline sweep's engine takes ids), so text needs a tokenizer."""
    name, seed = args.dataset_name, args.seed
    as_ids = ids_only or tokenizer is None or name != "random"
    if name in ("random", "random-ids"):
        return random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, vocab_size, seed=seed,
                               tokenizer=None if as_ids else tokenizer, kind=name)
    if name == "generated-shared-prefix":
        return shared_prefix_requests(args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len,
                                      args.gsp_question_len, args.gsp_output_len, vocab_size, seed=seed)
    if name == "sharegpt":
        if ids_only and tokenizer is None:
            raise ValueError("--dataset-name sharegpt here needs --tokenizer (the engine takes token ids)")
        out = sharegpt_requests(args.dataset_path, args.num_prompts, tokenizer, output_len=args.sharegpt_output_len,
                                seed=seed)
        if ids_only:
            out = [SampleRequest(tokenizer.encode(r.prompt), r.prompt_len, r.output_len, r.kind) for r in out]
        return out
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


# ------------------------------------------------------------------------------ generators


def _lengths(rng, n: int, length: int, ratio: float, what: str) -> np.ndarray:
    if length < 1:
        raise ValueError(f"--random-{what}-len must be >= 1, got {length}")
    lo, hi = max(1, math.floor(length * (1 - ratio))), math.ceil(length * (1 + ratio))
    return rng.integers(lo, hi + 1, n)


def _ids(rng, n: int, vocab_size: int) -> list[int]:
    if vocab_size <= LOW_ID:
        raise ValueError(f"vocab size {vocab_size} leaves no token ids above {LOW_ID}")
    return rng.integers(LOW_ID, vocab_size, n).tolist()


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, *,
                    seed: int = 0, tokenizer: ClientTokenizer | None = None, kind: str = "random") -> list[SampleRequest]:
    """num prompts of random ids (lengths per the module docstring); with a tokenizer decoded to
    text, re-encoded and cut to the drawn length, then decoded again (what the server sees)."""
    if num < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng([seed, 11])
    ins, outs = _lengths(rng, num, input_len, range_ratio, "input"), _lengths(rng, num, output_len, range_ratio,
                                                                                  "output")
    vocab = tokenizer.vocab_size if tokenizer is not None else vocab_size
    out = []
    for i, o in zip(ins.tolist(), outs.tolist()):
        ids = _ids(rng, i, vocab)
        if tokenizer is None:
            out.append(SampleRequest(ids, i, o, kind))
            continue
        text = tokenizer.decode(tokenizer.encode(tokenizer.decode(ids))[:i])
        out.append(SampleRequest(text, tokenizer.count(text), o, kind))
    return out


def shared_prefix_requests(groups: int, per_group: int, system_len: int, question_len: int, output_len: int,
                           vocab_size: int, *, seed: int = 0) -> list[SampleRequest]:
    """groups x per_group prompts of token ids: system prompt of the group + own question,
    shuffled (seeded) so the groups interleave."""
    for flag, v in (("num-groups", groups), ("prompts-per-group", per_group), ("system-prompt-len", system_len),
                    ("question-len", question_len), ("output-len", output_len)):
        if v < 1:
            raise ValueError(f"--gsp-{flag} must be >= 1, got {v}")
    rng = np.random.default_rng([seed, 12])
    out = []
    for _ in range(groups):
        system = _ids(rng, system_len, vocab_size)
        out += [SampleRequest(system + _ids(rng, question_len, vocab_size), system_len + question_len, output_len,
                              "gsp") for _ in range(per_group)]
    return [out[i] for i in rng.permutation(len(out))]


def _turns(entry) -> list[str]:
    conv = entry.get("conversations", entry.get("conversation")) if isinstance(entry, dict) else None
    if not isinstance(conv, list):
        return []
    return [str(t.get("value", t.get("content", ""))) for t in conv if isinstance(t, dict)]


def sharegpt_requests(path: str | None, num: int, tokenizer: ClientTokenizer | None, *, output_len: int | None = None,
                      seed: int = 0) -> list[SampleRequest]:
    """Up to num (prompt, reply length) pairs from a ShareGPT file, shuffled (seeded), keeping
    vLLM's filter: prompt and reply >= 4 tokens, prompt <= 1024, prompt + reply <= 2048."""
    if not path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path: a local ShareGPT JSON file (no download)")
    if not os.path.isfile(path):
        raise ValueError(f"--dataset-path {path!r}: no such file (ShareGPT is read from a local JSON file)")
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):  # a user's file: ValueError, what the CLI reports
        raise ValueError(  # noqa: TRY004
            f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}} entries")
    count = tokenizer.count if tokenizer is not None else lambda s: math.ceil(len(s) / CHARS_PER_TOKEN)
    rng = np.random.default_rng([seed, 13])
    out = []
    for k in rng.permutation(len(data)).tolist():
        turns = _turns(data[k])
        if len(turns) < 2:
            continue
        p_len = count(turns[0])
        o_len = output_len if output_len is not None else count(turns[1])
        if p_len < SHAREGPT_MIN_LEN or (output_len is None and o_len < SHAREGPT_MIN_LEN):
            continue
        if p_len > SHAREGPT_MAX_PROMPT or p_len + o_len > SHAREGPT_MAX_TOTAL:
            continue
        out.append(SampleRequest(turns[0], p_len, o_len, "sharegpt"))
        if len(out) == num:
            break
    if not out:
        raise ValueError(f"{path}: no conversation passes the filter (two turns, 4..1024 prompt tokens, "
                         f"<= 2048 in all)")
    return out


# ------------------------------------------------------------------------------ arrivals


def arrivals(n: int, rate: float = math.inf, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds from the start: the first at 0, then gaps drawn from a gamma of
    shape `burstiness` and mean 1 / rate (burstiness 1: a Poisson process; < 1 burstier, > 1
    more regular; vLLM's rule).  rate inf: every request at 0 (a burst)."""
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng([seed, 14]).gamma(burstiness, 1.0 / (rate * burstiness), max(0, n - 1))
    return [0.0] + np.cumsum(gaps).tolist()


__all__ = ["DATASETS", "ClientTokenizer", "SampleRequest", "add_arguments", "arrivals", "random_requests", "sample",
           "shared_prefix_requests", "sharegpt_requests"]
