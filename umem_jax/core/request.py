"""Request: one prompt's life in the engine, and the outputs it reports (shaped like vLLM's).

A request's tokens are `prompt_token_ids + output_token_ids` (known on the host) plus
`num_pending` tokens already sampled on the device but not yet read back (the engine reads a
step's tokens only after launching the next step).  `num_computed` counts the leading tokens
whose KV / state is in the arena (or being written by a launched step).  Each step computes
tokens [num_computed, end) of one request; when `end` reaches every token the step samples one
more.  Decode is simply the case of one token left to compute.

Memory ownership: a request holds a list of virtual token page ids (`pages[i]` covers positions
[i * page_size, (i + 1) * page_size)) and its state slots.  It does not free them itself: the
scheduler's page owner does (refcounted: the prefix cache shares pages with requests).
"""

from __future__ import annotations

import dataclasses
import enum
import time

from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued: not admitted yet, or retracted (keeps its generated tokens)
    RUNNING = "running"  # holds arena memory: prefilling or decoding
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens (possibly lowered by the memory clip) or max_model_len
    FINISHED_ABORTED = "abort"  # refused (prompt over the memory budget) or aborted by the user

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_retractions: int = 0  # times the request was sent back to the queue for memory
    num_preemptions: int = 0  # ...of which by a higher-priority request


@dataclasses.dataclass
class Logprob:
    """One token's log probability at one position (vLLM's Logprob).  rank: 1 = the most likely
    token; decoded_token: its text (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# What the engine records per output token of a request that asks for logprobs: the chosen
# token's logprob and rank, then the top alternatives' ids and logprobs (most likely first).
TokenLogprobs = tuple[float, int, list[int], list[float]]


def logprob_dict(t: int, entry: TokenLogprobs, text) -> dict[int, Logprob]:
    """vLLM's shape of one position: {id: Logprob} of token t (the chosen or scored one), then
    the top alternatives not already in it.  text(id) -> the token's text (or None)."""
    lp, rank, ids, vals = entry
    d = {t: Logprob(lp, rank, text(t))}
    for r, (i, v) in enumerate(zip(ids, vals), 1):
        d.setdefault(i, Logprob(v, r, text(i)))
    return d


@dataclasses.dataclass
class CompletionOutput:
    """One generated sequence (vLLM's CompletionOutput).  logprobs: per output token, {token id:
    Logprob} of the chosen token and the top alternatives (None: not asked for)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt (vLLM's RequestOutput)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # why it was aborted, e.g. the memory-budget message
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (vLLM's field)
    prompt_logprobs: list | None = None  # per prompt token (None first): {id: Logprob} (core/prompt_logprobs.py)


class Request:
    """Host state of one request.  Fields the scheduler and runner touch every step are plain
    attributes (no properties with hidden cost on the hot path)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 *, arrival: int, seed: int, max_tokens: int, priority: int = 0, windows: tuple[str, ...] = ()):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival = arrival  # monotone arrival number: the tie-break of every ordering
        self.priority = priority  # lower value = served first (vLLM)
        self.seed = seed
        self.max_tokens = max_tokens  # after the memory clip
        self.min_tokens = min(params.min_tokens, max_tokens)
        self.stop_ids: list[int] = []  # EOS (unless ignore_eos) + stop_token_ids: banned before min_tokens
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.num_computed = 0
        self.num_pending = 0
        self.pending_row = -1  # row of the launched step whose token is pending
        self.pages: list[int] = []
        self.window_start = {w: 0 for w in windows}  # first page index still bound per window sub-pool
        self.slots: list[int] = []
        # prefix cache: checkpoints planned but not handed to the cache yet ((position, slot)),
        # the fork point of the last lookup, how far the pages are cached (node and depth)
        self.ckpts: list[tuple[int, int]] = []
        self.fork = 0
        self.cache_node = None
        self.cache_pages = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self._text = ""
        self._text_fed = 0  # output tokens the detokenizer has seen
        self.text_tokens = 0  # output tokens the text covers (the engine leaves a stop token out)
        self.detok = None  # an IncrementalDetokenizer, set by the engine when it has a tokenizer
        self.metrics = RequestMetrics(time.time())
        self.sample_index = 0  # which of its prompt's samples (n / best_of) it is
        self.num_logprobs: int | None = None  # top alternatives recorded per token (None: no logprobs)
        self.logprobs: list[TokenLogprobs] | None = None  # one entry per output token, when recorded
        self.prompt_lp = None  # a PromptLogprobs when the request asks for prompt_logprobs (core/prompt_logprobs.py)
        self.siblings: list[Request] = []  # the other samples of its prompt (n / best_of: engine/samples.py)
        # speculative method "mtp": the draft tokens its MTP head proposed after its last step, for
        # positions num_computed + 1 on (runner/mtp.py); None: its drafts are made in the step (a draft model)
        self.drafts: list[int] | None = None
        # speculation's record of this request (engine/speculative.py): verify steps that proposed
        # drafts, drafts proposed and accepted; spec_off: its drafts stopped paying, it decodes plainly
        self.spec_steps = self.spec_proposed = self.spec_accepted = 0
        self.spec_off = False
        # draft tokens the speculative steps in flight may still accept (their spec_lens, summed):
        # num_computed and the output count are lower bounds by that much until they are read
        # back (scheduler/speculation.py prices the worst case)
        self.spec_ahead = 0

    # ------------------------------------------------------------------ token counts
    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Every token of the request so far, device-pending ones included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_output(self) -> int:
        return len(self.output_token_ids) + self.num_pending

    @property
    def to_compute(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def decode_ready(self) -> bool:
        """One token left to compute, after at least one prefill pass (a request's first tokens
        always go through a prefill step: that is where recurrent state is reset)."""
        c = self.num_computed  # to_compute == 1, inlined: the scheduler asks every step
        return c > 0 and len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending == c + 1

    @property
    def wants_step(self) -> bool:
        return len(self.output_token_ids) + self.num_pending < self.max_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Host-known tokens [start, end) (never pending ones)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:  # decode: no copy of the history
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def text(self) -> str:
        """The output text so far.  Detokenized lazily: the engine says how many output tokens
        it covers (`text_tokens`) and the detokenizer catches up when the text is read -- every
        step for a stream or a stop-string check, once at the end otherwise."""
        if self._text_fed < self.text_tokens:
            self.sync_text()
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._text = value

    def sync_text(self) -> str:
        """Feed the detokenizer the covered output tokens it has not seen -> the text they add."""
        new = ""
        if self.detok is not None:
            new = "".join([self.detok.step(t) for t in self.output_token_ids[self._text_fed:self.text_tokens]])
            self._text += new
        self._text_fed = self.text_tokens
        return new

    # ------------------------------------------------------------------ state changes by the engine
    def mark_pending(self, row: int) -> None:
        """A launched step samples this request's next token, in row `row` of its output: the
        token stays on the device (pending) until the engine reads that step back."""
        self.pending_row = row
        self.num_pending += 1

    def read_pending(self) -> None:
        """The engine read one pending token back (it appends it, or drops it if the request
        finished meanwhile)."""
        self.num_pending -= 1

    def clip_max_tokens(self, n: int) -> None:
        """Lower max_tokens to `n` (the memory clip at arrival); min_tokens never exceeds it."""
        self.max_tokens = n
        self.min_tokens = min(self.min_tokens, n)

    def mark_finished(self, status: RequestStatus, stop_reason: int | str | None = None,
                      error: str | None = None) -> None:
        """Record how the request ended (after the scheduler gave back its memory, if it held any)."""
        self.status = status
        self.finish_reason = status.value
        self.stop_reason = stop_reason
        self.error = error

    # -------------------------------------------------------------- scheduling state
    # Only the scheduler changes these (status, num_computed, pages, slots, window_start and the
    # prefix-cache fields fork / ckpts / cache_node / cache_pages), and only through these
    # methods, so every transition of a request is read here.
    def mark_waiting(self) -> None:
        self.status = RequestStatus.WAITING

    def mark_running(self, cached_tokens: int) -> None:
        """Admitted: the first admission stamps the time and the prompt tokens the cache served."""
        self.status = RequestStatus.RUNNING
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = time.time()
            self.num_cached_tokens = cached_tokens

    def leave_queues(self, status: RequestStatus) -> None:
        """Out of the scheduler's queues with `status` (the engine records why: mark_finished)."""
        self.status = status

    def compute_to(self, end: int) -> None:
        """A launched step computes the request's tokens up to `end`."""
        self.num_computed = end

    def restart(self, *, preempted: bool) -> None:
        """Retracted: it keeps its tokens but computes them all again (no fork is known)."""
        self.num_computed = 0
        self.fork = 0
        if self.drafts is not None:  # proposed for a position it computes again: its next prefill proposes anew
            self.drafts = []
        self.metrics.num_retractions += 1
        if preempted:
            self.metrics.num_preemptions += 1

    def hold(self, pages: list[int], slots: list[int]) -> None:
        """New token page ids and state slots, after those it holds."""
        self.pages += pages
        self.slots += slots

    def drop_held_since(self, num_pages: int, num_slots: int) -> None:
        """Forget the page ids and slots past the first `num_pages` / `num_slots` (rolled back)."""
        del self.pages[num_pages:], self.slots[num_slots:]

    def pass_window(self, window: str, first_page: int) -> None:
        """Pages before `first_page` are out of every future query's `window`."""
        self.window_start[window] = first_page

    def forget_memory(self, windows: tuple[str, ...]) -> None:
        """Holds nothing any more: no pages, slots, planned checkpoints or cached prefix."""
        self.pages, self.slots, self.ckpts = [], [], []
        self.window_start = {name: 0 for name in windows}
        self.cache_node, self.cache_pages = None, 0

    def set_fork(self, fork: int) -> None:
        """Where the request leaves a cached path that goes on (0: nowhere known)."""
        self.fork = fork

    def resume_from(self, pages: list[int], window_start: dict[str, int], resume: int, node) -> None:
        """A cache hit: the request holds the shared `pages` (cached up to `node`) and skips their
        `resume` tokens."""
        self.pages = pages
        self.window_start.update(window_start)
        self.num_computed = resume
        self.cache_node, self.cache_pages = node, len(pages)

    def undo_resume(self) -> None:
        """The hit is dropped: nothing is computed."""
        self.num_computed = 0

    def plan_checkpoints(self, checkpoints: list[tuple[int, int]]) -> None:
        """State checkpoints ((position, slot), ...) its next pass writes, for the cache."""
        self.ckpts += checkpoints

    def take_planned_checkpoints(self) -> list[tuple[int, int]]:
        """The planned checkpoints, handed over: the request no longer holds their slots."""
        planned, self.ckpts = self.ckpts, []
        return planned

    def mark_cached(self, node, num_pages: int) -> None:
        """Its first `num_pages` pages are in the cache, the last one at `node`."""
        self.cache_node, self.cache_pages = node, num_pages

    def add_checkpoint(self, slot: int) -> None:
        """A checkpoint of the state after every token it computed, in `slot`."""
        self.ckpts.append((self.num_computed, slot))

    @property
    def sort_key(self) -> tuple[int, int]:
        """Most preferred first: higher priority (lower value), then earlier arrival."""
        return (self.priority, self.arrival)

    @property
    def finished(self) -> bool:
        return self.status.finished

    # ------------------------------------------------------------------ outputs
    def record_logprobs(self, num_logprobs: int | None) -> None:
        """Record the logprobs of every output token from now on, with `num_logprobs` alternatives."""
        self.num_logprobs = num_logprobs
        self.logprobs = None if num_logprobs is None else []

    def add_logprobs(self, arrays, row: int) -> None:
        """Record the logprobs of the token just sampled, from a step's read-back arrays (numpy:
        chosen logprob [B], rank [B], top ids [B, k], top logprobs [B, k]; row `row`)."""
        chosen, rank, ids, vals = arrays
        k = self.num_logprobs
        self.logprobs.append((float(chosen[row]), int(rank[row]), ids[row, :k].tolist(), vals[row, :k].tolist()))

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else float(sum(e[0] for e in self.logprobs))

    def logprobs_output(self) -> list[dict[int, Logprob]] | None:
        """vLLM's shape: per output token, {id: Logprob} of the chosen token, then the top ones."""
        if self.logprobs is None:
            return None
        return [logprob_dict(t, e, self._token_text) for t, e in zip(self.output_token_ids, self.logprobs)]

    def _token_text(self, t: int) -> str | None:
        return self.detok.tok.decode([t], False) if self.detok is not None else None

    def output(self) -> RequestOutput:
        comp = CompletionOutput(self.sample_index, self.text, list(self.output_token_ids),
                                cumulative_logprob=self.cumulative_logprob, logprobs=self.logprobs_output(),
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason)
        prompt_lp = None if self.prompt_lp is None else self.prompt_lp.output(self._token_text)
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), [comp], self.finished,
                             self.metrics, self.error, self.num_cached_tokens, prompt_lp)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={self.prompt_len}, out={self.num_output}"
                f"/{self.max_tokens}, computed={self.num_computed}, pages={len(self.pages)}, prio={self.priority})")


__all__ = ["CompletionOutput", "Logprob", "Request", "RequestMetrics", "RequestOutput", "RequestStatus", "TokenLogprobs",
           "logprob_dict"]
