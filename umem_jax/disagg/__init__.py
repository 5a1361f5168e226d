"""Prefill/decode disaggregation: a prefill worker computes a request's prompt, its memory moves as
whole page envelopes to a decode worker, which generates the rest; a router in front serves the
OpenAI API (docs/disaggregation.md).

  wire.py       page envelopes (engine/handoff.py) <-> one npz body, no pickle
  ledger.py     the decode side's transfers: ids, generations, deadlines, fencing
  decode.py     the decode worker's endpoints: reserve, receive, cancel, stream
  prefill.py    the prefill worker's endpoint: prefill, export, send, release on the ack
  worker.py     `umem-jax serve --disaggregation-mode prefill|decode`: the app of either
  router.py     `umem-jax router --prefill URL --decode URL`: tokenize, reserve, prefill, stream, retry
  router_app.py the router's OpenAI API (completions, chat completions, health, models, stats)
  keepalive.py  HTTP between them: a worker never closes a connection a client may still reuse
"""
