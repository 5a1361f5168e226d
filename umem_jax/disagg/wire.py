"""Page envelopes on the wire: one `np.savez` body (header JSON + one array per sub-pool), read
back with allow_pickle=False, so a peer can send bytes, never code."""

from __future__ import annotations

import io
import json

import numpy as np

from ..engine.handoff import Envelopes, TransferPlan
from ..memory.declarations import WORD_BYTES

HEAD_BYTES = 64 << 10  # more than the npz's archive and array headers and the JSON head take


def pack(env: Envelopes) -> bytes:
    head = {"fingerprint": env.fingerprint, "first_token": env.first_token, "computed": env.plan.computed,
            "pages": {k: list(v) for k, v in env.plan.pages.items()}, "state_slots": env.plan.state_slots}
    arrays = {f"pages/{k}": v for k, v in env.pages.items()}
    if env.state is not None:
        arrays["state"] = env.state
    buf = io.BytesIO()
    np.savez(buf, head=np.frombuffer(json.dumps(head).encode(), np.uint8), **arrays)
    return buf.getvalue()


def unpack(body: bytes) -> Envelopes:
    """Raises ValueError for a body that is not an envelope set."""
    try:
        with np.load(io.BytesIO(body), allow_pickle=False) as z:
            head = json.loads(z["head"].tobytes().decode())
            pages = {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith("pages/")}
            state = z["state"] if "state" in z.files else None
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"not a page-envelope body: {e}") from None
    plan = TransferPlan(int(head["computed"]), {k: tuple(v) for k, v in head["pages"].items()},
                        int(head["state_slots"]))
    return Envelopes(str(head["fingerprint"]), plan, int(head["first_token"]), pages, state)


def max_body_bytes(plan, tokens: int) -> int:
    """Bytes of the largest body `pack` makes for a prompt of at most `tokens` tokens under `plan`
    (a memory.Plan): its envelopes (the transfer plan's pages and state slots) plus HEAD_BYTES."""
    tp = TransferPlan.of(plan, tokens)
    rows = sum((end - first) * plan[name].rows_per_page for name, (first, end) in tp.pages.items())
    rows += tp.state_slots * (plan.state.rows_per_page if plan.state is not None else 0)
    return rows * plan.row_words * WORD_BYTES + HEAD_BYTES
