"""max_tokens over HTTP (issue 20): what vLLM users expect -- a 400 naming max_model_len when the
prompt and max_tokens cannot fit, under the name the request used; the same words as offline
(tests/engine/test_defaults.py); what /v1/models advertises is what the engine serves; the
per-band gauges split held into requests and cache."""

from __future__ import annotations

import httpx
import openai
import pytest
from _server_utils import MODEL, drained, engine_call, wait_idle
from prometheus_client.parser import text_string_to_metric_families

from umem_jax.engine.engine import MAX_TOKENS_MESSAGE


def _max_model_len(srv) -> int:
    return engine_call(srv, lambda e: e.max_model_len)


@pytest.mark.parametrize("max_tokens", [10**9, 4096])
def test_completion_max_tokens_over_max_model_len_is_400(srv, max_tokens):
    n = _max_model_len(srv)
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=max_tokens)
    assert e.value.status_code == 400 and e.value.body["param"] == "max_tokens"
    assert e.value.body["message"] == MAX_TOKENS_MESSAGE.format(max_tokens, n, 3, n - 3)
    assert f"max_model_len={n}" in e.value.body["message"]
    assert drained(srv) == (0, 0, 0)  # nothing was queued


def test_chat_max_tokens_over_max_model_len_is_400(srv):
    n = _max_model_len(srv)
    msgs = [{"role": "user", "content": "hi"}]
    for field in ("max_completion_tokens", "max_tokens"):
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs, field: 10**9},
                       timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field, r.text  # the name the request used
        msg = err["message"]
        assert msg.startswith(f"{field}=1000000000 is too large") and f"max_model_len={n}" in msg
        assert f"leave {field} unset" in msg and (field == "max_tokens" or "max_tokens" not in msg)


def test_models_advertise_the_served_max_model_len(srv):
    raw = httpx.get(srv.url + "/v1/models").json()
    assert raw["data"][0]["max_model_len"] == _max_model_len(srv)


def test_band_gauges_split_held_into_requests_and_cache(srv):
    srv.client.completions.create(model=MODEL, prompt=list(range(3, 70)), max_tokens=2, temperature=0)
    wait_idle(srv)  # the engine thread refreshes the gauges as it goes idle
    bands = engine_call(srv, lambda e: e.stats()["bands"])
    got = {}
    for fam in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text):
        for smp in fam.samples:
            if "band" in smp.labels:
                got[(smp.name, smp.labels["band"])] = smp.value
    for name, b in bands.items():
        assert b["held"] == b["requests"] + b["cache"] and b["requests"] == 0  # idle: what is held is the cache's
        for key, metric in (("requests", "umem:arena_band_held_requests"), ("cache", "umem:arena_band_held_cache"),
                            ("cache_bytes", "umem:arena_band_held_cache_bytes"),
                            ("available", "umem:arena_band_available"),
                            ("available_bytes", "umem:arena_band_available_bytes")):
            assert got[(metric, name)] == b[key], (metric, name)
    assert sum(b["cache"] for b in bands.values()) > 0  # the prompt's whole pages stay cached
