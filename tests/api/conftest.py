"""The package's live server (`srv`): one engine and one uvicorn for every test in tests/api
that asks for it (building and warming an engine takes a while on CPU)."""

from __future__ import annotations

import httpx
import openai
import pytest
from _server_utils import MAX_SEQS, MODEL, LiveServer

from umem_jax.api.async_engine import AsyncLLMEngine
from umem_jax.api.metrics import EngineMetrics
from umem_jax.api.server import build_app
from umem_jax.engine.engine import EngineConfig, LLMEngine


@pytest.fixture(scope="package")
def srv():
    # max_model_len given: 4096 (the model's) does not fit 1 MiB, so prompts under it can be over the budget
    engine = LLMEngine(EngineConfig(model="tiny", arena_bytes=1 << 20, max_model_len=4096, max_num_seqs=MAX_SEQS,
                                    max_num_batched_tokens=2048, batch_buckets=(MAX_SEQS,), token_buckets=(32,),
                                    page_buckets=(8, 256)))
    aeng = AsyncLLMEngine(engine, max_waiting_requests=256, metrics=EngineMetrics(MODEL))
    server = LiveServer(build_app(aeng, [MODEL], model_root="tiny"))
    server.start()
    server.health_before_start = httpx.get(server.url + "/health").status_code
    aeng.start()
    assert aeng.wait_ready(300), aeng.error
    server.aeng = aeng
    server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=120)
    yield server
    server.stop()
    aeng.shutdown()
    assert aeng.error is None, aeng.error
