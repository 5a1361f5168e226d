"""OpenAI-compatible wire format: the request models (pydantic v2) and the error body.

Shapes follow the OpenAI API as vLLM serves it, because that is what `vllm bench serve`,
`sglang.bench_serving` and the `openai` client parse:

  POST /v1/completions       CompletionRequest      -> CompletionResponse | CompletionChunk stream
  POST /v1/chat/completions  ChatCompletionRequest  -> ChatCompletionResponse | ChatCompletionChunk stream
  GET  /v1/models            -> ModelList (max_model_len included)
  POST /tokenize, /detokenize  (tokenize.py)
  errors                     -> ErrorResponse {"error": {"message", "type", "param", "code"}}

Requests accept unknown fields (extra="allow") so vLLM / SGLang extras that this engine does not
use (`user`, ...) are not a 4xx.  Fields whose meaning the engine cannot honour (suffix, tools,
response_format other than text, ...) are refused with a 400 naming the field: silently
ignoring them would return something else than was asked for.  `logit_bias` is honoured (token
ids as JSON keys, biases in [-100, 100], at most 300), and so are vLLM's `allowed_token_ids`,
`truncate_prompt_tokens` (not with echo: the echoed text would not be the prompt scored),
`skip_special_tokens` and `return_tokens_as_token_ids`.  Completions
take `echo` (with `max_tokens: 0` too: the prompt scored, nothing generated) and vLLM's
`prompt_logprobs` (api/echo.py); chat takes prompt_logprobs too, not streamed (as vLLM), and
vLLM's `continue_final_message` (the answer goes on from the last message) with `echo` (the
answer starts with that message when it has the answer's role) and `chat_template_kwargs` (the
template's variables; a request's own `chat_template` is refused, as vLLM does by default).
"""

from __future__ import annotations

import uuid
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..core.sampling_params import MAX_LOGPROBS, SamplingParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ------------------------------------------------------------------------------ errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "RequestTooLargeError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """The OpenAI error object (type names and int code as vLLM writes them)."""
    return ErrorResponse(error=ErrorInfo(message=message, type=ERROR_TYPES.get(status, "APIError"),
                                         param=param, code=status)).model_dump()


# ------------------------------------------------------------------------------ requests


# vLLM / SGLang request extras that change the output, which this engine does not do: set to anything
# but their default (None, or the value given) they are refused with a 400 naming them, not ignored.
UNHONOURED_EXTRAS = {
    **dict.fromkeys(("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                     "json_schema", "regex", "ebnf", "bad_words", "logits_processors",
                     "length_penalty", "chat_template", "documents")),
    "use_beam_search": False, "spaces_between_special_tokens": True,
}


def _unhonoured(extras: dict | None) -> str | None:
    """The first extra field (vLLM's / SGLang's) set to an output-changing value, or None."""
    for name, value in (extras or {}).items():
        if name not in UNHONOURED_EXTRAS:
            continue
        default = UNHONOURED_EXTRAS[name]
        if value != default and (default is not None or value not in (None, False, "", [], {})):
            return name
    return None


def _valid_unicode(value):
    """`value` (strings, nested in lists and dicts) if every string can be encoded in UTF-8: a JSON
    string may carry a lone UTF-16 surrogate (\\ud800), which no tokenizer takes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"not valid Unicode text: a lone surrogate {value[e.start]!r} at character {e.start}") \
                from None
    elif isinstance(value, (list, tuple)) and value and not isinstance(value[0], int):  # list[int]: token ids
        for v in value:
            _valid_unicode(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _valid_unicode(k)
            _valid_unicode(v)
    return value


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown extras are ignored, not a 422

    @field_validator("*", mode="after")
    @classmethod
    def _unicode(cls, value):
        return _valid_unicode(value)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(_Request):
    """Fields shared by completions and chat: vLLM's names, SGLang's max_new_tokens alias."""

    model: str | None = None
    max_tokens: int | None = None
    max_new_tokens: int | None = None  # SGLang
    min_tokens: int = 0
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # vLLM
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM: only these may be sampled
    truncate_prompt_tokens: int | None = None  # vLLM: the prompt's last k tokens only (-1: max_model_len)
    skip_special_tokens: bool = True  # vLLM: special tokens left out of the text
    return_tokens_as_token_ids: bool = False  # vLLM: logprobs' tokens written "token_id:N"
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    response_format: dict[str, Any] | str | None = None

    def _max_tokens(self) -> tuple[str, int | None]:
        """(the field the output limit comes from, its value)."""
        return ("max_tokens", self.max_tokens) if self.max_tokens is not None else ("max_new_tokens",
                                                                                     self.max_new_tokens)

    def unsupported(self) -> str | None:
        """The first field set to something the engine cannot do, or None."""
        return _unhonoured(self.model_extra)

    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: alternatives per token (None: no logprobs)."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: alternatives per prompt token (None: the prompt is not scored)."""
        return None

    def _engine_max_tokens(self, max_tokens: int | None) -> int | None:
        """The output limit the engine is given for the asked one."""
        return max_tokens

    def refused_format(self) -> str | None:
        """Why response_format cannot be honoured (None: plain text, which it can)."""
        rf = self.response_format
        kind = rf.get("type", "text") if isinstance(rf, dict) else rf
        if rf is None or kind == "text":
            return None
        return (f"response_format: type {kind!r} is not supported yet (no structured output: the output would not "
                "be held to the format); leave it out or use type 'text'")

    def sampling_params(self) -> SamplingParams:
        """-> SamplingParams; raises ValueError ("field=value: why", the request's field) for
        out-of-range values."""
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise ValueError(f"best_of={self.best_of}: best_of > n cannot be streamed (the best are known at the end)")
        kw = {k: v for k, v in dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                      min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                                      presence_penalty=self.presence_penalty,
                                      frequency_penalty=self.frequency_penalty).items() if v is not None}
        field, max_tokens = self._max_tokens()
        try:
            return SamplingParams(n=self.n, best_of=self.best_of, max_tokens=self._engine_max_tokens(max_tokens),
                                  min_tokens=self.min_tokens, seed=self.seed, stop=self.stop,
                                  stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                                  logprobs=self.num_logprobs(), prompt_logprobs=self.num_prompt_logprobs(),
                                  include_stop_str_in_output=self.include_stop_str_in_output,
                                  logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids,
                                  truncate_prompt_tokens=self.truncate_prompt_tokens,
                                  skip_special_tokens=self.skip_special_tokens, **kw)
        except ValueError as e:  # SamplingParams names its max_tokens; the request may have used an alias
            if field != "max_tokens" and str(e).startswith("max_tokens="):
                raise ValueError(field + str(e)[len("max_tokens"):]) from None
            raise

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: vLLM's stream_options.continuous_usage_stats (with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


Prompt = Union[str, list[int], list[str], list[list[int]]]


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    max_tokens: int | None = 16  # the legacy OpenAI default
    echo: bool = False  # the choice's text (and logprobs) start with the prompt's
    suffix: str | None = None
    logprobs: int | None = None  # the chosen token's logprob plus this many top alternatives per token
    prompt_logprobs: int | None = None  # vLLM's extra: per prompt token its logprob and this many alternatives

    def _max_tokens(self) -> tuple[str, int | None]:
        # an explicit max_new_tokens (SGLang) wins over the OpenAI default of 16
        if "max_tokens" not in self.model_fields_set and self.max_new_tokens is not None:
            return "max_new_tokens", self.max_new_tokens
        return "max_tokens", self.max_tokens

    def sampling_params(self) -> SamplingParams:
        if self.echo and self.truncate_prompt_tokens is not None:
            raise ValueError(f"truncate_prompt_tokens={self.truncate_prompt_tokens}: not supported with echo (the "
                             "echoed text would not be the prompt the model saw)")
        return super().sampling_params()

    def prompts(self) -> list[str | list[int]]:
        """One prompt or a batch -> a list (each a string or a list of token ids)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0 (lm-eval's scoring request): the prompt back, nothing generated."""
        return self.echo and self._max_tokens()[1] == 0

    @property
    def echo_logprobs(self) -> int | None:
        """Alternatives per prompt token in the choice's logprobs (echo with logprobs; else None)."""
        return self.logprobs if self.echo else None

    def num_prompt_logprobs(self) -> int | None:
        """The prompt is scored for echo's logprobs and for prompt_logprobs: the larger k of the
        two (each is cut to its own k when written)."""
        k = self.prompt_logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:  # checked here: max() below would hide a bad one
            raise ValueError(f"prompt_logprobs={k}: must be in [0, {MAX_LOGPROBS}]")
        asked = [x for x in (k, self.echo_logprobs) if x is not None]
        return max(asked) if asked else None

    def _engine_max_tokens(self, max_tokens: int | None) -> int | None:
        # the engine draws at least one token: max_tokens 0 with echo draws one, which is not returned
        if self.echo_only:
            if self.min_tokens:
                raise ValueError(f"min_tokens={self.min_tokens}: must be 0 with max_tokens 0")
            return 1
        return max_tokens

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        return super().unsupported()


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None  # required; null only for an assistant turn (OpenAI's rule)

    @model_validator(mode="after")
    def _content_given(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role!r} message needs content")
        return self

    def text(self) -> str:
        """The message as text: parts of type "text" joined; any other part is refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"content parts of type {part.type!r} are not supported (text only)")
        return "".join(part.text or "" for part in self.content)


class ChatTemplateFields(_Request):
    """How chat messages are rendered by the chat template: a chat completion's fields that
    /tokenize takes too, so both render a body alike."""

    add_generation_prompt: bool = True
    # vLLM's extra: continue the last message (not a new turn; add_generation_prompt must be false)
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables (Qwen's enable_thinking, ...)
    reasoning_effort: str | None = None  # OpenAI's: a template variable of that name (gpt-oss's template reads it)

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's extra variables: chat_template_kwargs, and reasoning_effort unless
        they set it."""
        if self.reasoning_effort is not None and self.reasoning_effort not in ("low", "medium", "high"):
            raise ValueError(f"reasoning_effort={self.reasoning_effort!r}: must be low, medium or high")
        effort = {} if self.reasoning_effort is None else {"reasoning_effort": self.reasoning_effort}
        return {**effort, **(self.chat_template_kwargs or {})} or None


class ChatCompletionRequest(_SamplingRequest, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    # vLLM's extra: echo the last message (the answer starts with it when it has the answer's role)
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's extra: the templated prompt's scores (response level; not streamed)

    def _max_tokens(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return super()._max_tokens()

    def conversation(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def response_role(self) -> str:
        """The answer's role: the assistant's after a generation prompt, else the last message's
        (the answer goes on from it, as vLLM has it)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echoed(self) -> str:
        """What echo puts before the generated text: the last message's, if it has the answer's role."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == self.response_role() else ""

    def num_logprobs(self) -> int | None:
        """logprobs=true: the chosen token's logprob and `top_logprobs` alternatives (default 0)."""
        k = self.top_logprobs
        if k is not None and not self.logprobs:
            raise ValueError(f"top_logprobs={k}: needs logprobs=true")
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs={k}: must be in [0, {MAX_LOGPROBS}]")
        return (k or 0) if self.logprobs else None

    def num_prompt_logprobs(self) -> int | None:
        k = self.prompt_logprobs  # its range: SamplingParams.validate
        if k is not None and self.stream:  # as vLLM: the scores come with the whole response
            raise ValueError(f"prompt_logprobs={k}: not available with stream=true on /v1/chat/completions")
        return k

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        return super().unsupported()
