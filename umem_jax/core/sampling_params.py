"""SamplingParams: how one request picks its tokens, with vLLM's names and defaults."""

from __future__ import annotations

import dataclasses
import math

SEED_RANGE = (-(2**63), 2**64)  # a seed fits 64 bits, signed or unsigned
# Every stop string is matched against the new text of every step, and a stream holds back the
# longest one: bounded per request (SGLang allows 32 stop strings; vLLM 4 by default).
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256  # characters in one stop string
MAX_STOP_TOKEN_IDS = 256  # looked up on every sampled token
MAX_SAMPLES = 128  # n and best_of: samples of one prompt (OpenAI's limit on n)
# Below this temperature a request samples greedily (vLLM's _SAMPLING_EPS): dividing the logits by
# it would overflow to ties of inf, and a near-tie would be drawn at random where argmax is meant.
GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20  # alternatives per token (vLLM's default max_logprobs; the sampler's largest bucket)
MAX_LOGIT_BIAS = 300  # token ids one request may bias (the step's widest bias bucket)
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range of a bias: [-100, 100]

@dataclasses.dataclass
class SamplingParams:
    """Per-request sampling and stopping options.

    temperature 0 (or below GREEDY_BELOW) is greedy.  top_k <= 0 (or -1) means no top-k cut;
    top_p 1.0 and min_p 0.0 mean no nucleus / min-p cut.  Penalties follow vLLM: repetition_penalty divides positive logits
    (multiplies negative ones) of tokens seen in the prompt or output; presence/frequency penalties
    subtract from logits of tokens seen in the output.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # the stop string that ended the text stays in it (vLLM's name)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # the chosen token's logprob and this many top alternatives (None: none)
    prompt_logprobs: int | None = None  # per prompt token, its logprob and this many top alternatives (None: none)
    priority: int = 0
    best_of: int | None = None  # samples drawn, the n of highest mean token logprob returned (None: n)
    # added to these token ids' logits before sampling (OpenAI's: -100 bans, 100 all but forces);
    # logprobs still report the model's own distribution, as vLLM's do
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these token ids may be sampled (the others' logits -inf after the biases); logprobs
    # stay the model's own.  They take logit_bias' columns (at most MAX_LOGIT_BIAS ids)
    allowed_token_ids: list[int] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: max_model_len), before its length is checked
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True  # the output text leaves special tokens out (vLLM's default)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:  # JSON keys are strings ("50256"): token ids here
            try:
                self.logit_bias = {_token_id(k): float(v) for k, v in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias={_short(self.logit_bias)}: must map token ids to numbers") from None
        self.logit_bias = self.logit_bias or None
        if self.allowed_token_ids is not None:
            try:
                self.allowed_token_ids = sorted({_token_id(t) for t in self.allowed_token_ids})
            except (TypeError, ValueError):
                raise ValueError(f"allowed_token_ids={_short(self.allowed_token_ids)}: must be a list of token ids") \
                    from None
        self.validate()

    def validate(self) -> None:
        """Raise ValueError with the offending field for out-of-range values (an HTTP 400)."""
        checks = [
            (1 <= self.n <= MAX_SAMPLES, "n", f"must be in [1, {MAX_SAMPLES}]"),
            (self.best_of is None or self.n <= self.best_of <= MAX_SAMPLES, "best_of",
             f"must be >= n ({self.n}) and at most {MAX_SAMPLES}"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", "must be >= 0"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens"),
            (0.0 <= self.temperature < math.inf, "temperature", "must be finite and >= 0"),
            (self.top_k == -1 or self.top_k >= 0, "top_k", "must be -1 (off), 0 (off) or positive"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (0.0 < self.repetition_penalty < math.inf, "repetition_penalty", "must be finite and > 0"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", f"must be in [0, {MAX_LOGPROBS}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
             f"must be in [0, {MAX_LOGPROBS}]"),
            (self.seed is None or SEED_RANGE[0] <= self.seed < SEED_RANGE[1], "seed", "must be in [-2**63, 2**64)"),
            # an empty stop string matches everywhere, and a stream's hold-back would go negative
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings"),
            (len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings"),
            (all(len(s) <= MAX_STOP_CHARS for s in self.stop), "stop",
             f"a stop string has at most {MAX_STOP_CHARS} characters"),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
             f"at most {MAX_STOP_TOKEN_IDS} stop token ids"),
            (len(self.logit_bias or ()) <= MAX_LOGIT_BIAS, "logit_bias", f"at most {MAX_LOGIT_BIAS} token ids"),
            (all(-LOGIT_BIAS_LIMIT <= v <= LOGIT_BIAS_LIMIT for v in (self.logit_bias or {}).values()), "logit_bias",
             f"biases must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]"),
            (self.allowed_token_ids is None or len(self.allowed_token_ids) >= 1, "allowed_token_ids",
             "must list at least one token id"),
            (len(self.allowed_token_ids or ()) <= MAX_LOGIT_BIAS, "allowed_token_ids",
             f"at most {MAX_LOGIT_BIAS} token ids"),
            (self.truncate_prompt_tokens is None or self.truncate_prompt_tokens == -1
             or (not isinstance(self.truncate_prompt_tokens, bool) and self.truncate_prompt_tokens >= 1),
             "truncate_prompt_tokens", "must be -1 (max_model_len) or at least 1"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"{name}={_short(getattr(self, name))}: {why}")

    @property
    def num_samples(self) -> int:
        """Samples drawn for the prompt: best_of, else n."""
        return self.best_of or self.n

    @property
    def bias_ids(self) -> list[int]:
        """The token ids of the step's bias columns: logit_bias', or the allowed ones where only those
        may be drawn (a bias on any other id changes nothing then)."""
        return list(self.logit_bias or ()) if self.allowed_token_ids is None else self.allowed_token_ids

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _token_id(key) -> int:
    """A logit_bias key as a token id: an int, or a string of one (JSON object keys)."""
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise TypeError(key)
    return int(key)


def seed_word(seed: int) -> int:
    """A request's seed (64 bits, signed or not) as the sampler's key word (31 bits: it is packed
    into int32 sampling words).  Seeds in [0, 2**31) are kept; any other is hashed (splitmix64's
    finalizer), so seeds that differ only in their high bits or sign (5 and 5 + 2**32, -1 and
    2**31 - 1) draw different tokens, where masking the low bits made them draw the same."""
    if 0 <= seed < 2**31:
        return seed
    z = seed % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return (z ^ (z >> 31)) & 0x7FFFFFFF


def _short(value) -> str:
    """repr for an error message, cut short (a refused list may hold a million strings)."""
    if isinstance(value, dict) and len(value) > 8:
        value = list(value.items())
    if isinstance(value, list) and len(value) > 8:
        text = f"[{', '.join(repr(v)[:40] for v in value[:8])}, ...] ({len(value)} items)"
    else:
        text = repr(value)
    return text if len(text) <= 160 else f"{text[:140]}..."
