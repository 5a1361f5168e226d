"""The scheduler: which requests run each step, the pages they get, retraction and
preemption under pressure, and the prefix cache.

  scheduler.py       Scheduler: the queues, schedule() (prefill or decode), finish, retract; the
                     decode batch and the memory for each row's next token
  prefill.py         the prefill batch being shaped: candidates, chunks, padded shapes
  retraction.py      which running requests make room, and in what order
  request_memory.py  the pages and slots requests hold, taken and given back
                     (a request's scheduling state changes only through core/request.py's methods)
  prefix_sharing.py  the scheduler's side of the prefix cache: hits, hand-off, checkpoints
  prefix_cache.py    the radix tree of cached pages (radix_node.py: its nodes and hits;
                     cache_holdings.py: its refs and per-sub-pool accounting;
                     window_retention.py: which cached pages keep their window rows)
"""
