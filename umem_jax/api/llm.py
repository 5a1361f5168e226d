"""LLM: the offline API (vLLM's shape).

    from umem_jax import LLM, SamplingParams
    llm = LLM(model="tiny", arena_bytes=16 << 20)
    outs = llm.generate(["Hello", [1, 72, 105]], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text, outs[0].outputs[0].token_ids)

Keyword arguments are EngineConfig fields (engine/config.py); unknown ones are an error.
"""

from __future__ import annotations

import dataclasses

from ..core.request import RequestOutput
from ..core.sampling_params import SamplingParams
from ..engine.engine import EngineConfig, LLMEngine
from ..models.loader import DEFAULT_MODEL


class LLM:
    def __init__(self, model=DEFAULT_MODEL, **kwargs):
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown LLM arguments {unknown}; known: {sorted(known)}")
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (entries no request holds) -> whether it is now empty."""
        return self.llm_engine.reset_prefix_cache()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 priority: list[int] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for one prompt or a list (strings, token-id lists, or {"prompt": ...} /
        {"prompt_token_ids": ...} dicts) -> one RequestOutput per prompt, in order.

        Every prompt is validated before any is queued: a bad one raises ValueError naming it,
        and nothing is queued.

        A request that fails while it runs (an exception its own work raised in the engine: see
        engine/isolation.py) does not take the others with it: its RequestOutput comes back in
        its place, finished with finish_reason "abort" and `error` saying what raised, and every
        other prompt gets its full result (as a prompt over the memory budget does; check
        `out.error`).  Only a failure of the engine itself raises (EngineDeadError), and the
        engine then refuses further work.
        """
        del use_tqdm
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        prios = list(priority) if priority is not None else [0] * len(prompts)
        if len(params) != len(prompts) or len(prios) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params and {len(prios)} priorities")
        engine = self.llm_engine
        reqs = []
        for i, (p, sp, pr) in enumerate(zip(prompts, params, prios)):
            try:
                reqs.append(engine.prepare(p, sp, priority=pr))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return self._run([engine.enqueue(r) for r in reqs])

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Chat messages ([{"role", "content"}, ...], or a list of such conversations) through
        the tokenizer's chat template; continue_final_message (with add_generation_prompt=False):
        the output goes on from the last message instead of starting a turn of its own;
        chat_template_kwargs: more of the template's variables (Qwen's enable_thinking, ...)."""
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        ids = [tok.encode_chat(c, add_generation_prompt, continue_final_message, chat_template_kwargs) for c in convs]
        return self.generate([{"prompt_token_ids": i} for i in ids], sampling_params)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        engine, want, done = self.llm_engine, set(ids), {}
        while want - set(done):
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"requests {sorted(want - set(done))} vanished from the engine")
            for out in engine.step():
                done[out.request_id] = out
        while engine.probing or (engine.has_inflight and not engine.scheduler.has_work()):
            engine.step()  # drain the last overlap row (and a probe) so the engine is idle (and checked)
        return [done[i] for i in ids]


__all__ = ["LLM"]
