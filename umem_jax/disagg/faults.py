"""Fault injection for the disaggregation tests, off unless the worker starts with
UMEM_JAX_DISAGG_FAULTS=1: POST /disagg/faults {"stall_install_s": 5, "match": "slow-"} makes
every transfer whose id contains `match` wait that long at that point (`times`: how many
transfers, per point)."""

from __future__ import annotations

import asyncio
import os

from fastapi import APIRouter, Request

from ..api.errors import error

router = APIRouter()
POINTS = ("stall_install_s", "ack_delay_s", "stall_send_s", "poison")


class Faults:
    def __init__(self):
        self.enabled = os.environ.get("UMEM_JAX_DISAGG_FAULTS") == "1"
        self.rules: list[dict] = []

    def take(self, point: str, transfer_id: str):
        """The value a rule gives `point` for this transfer (and one use of that rule), or None."""
        for r in self.rules:
            left = r.setdefault("left", {})  # uses left per point: one rule may set several
            if point in r and r.get("match", "") in transfer_id and left.get(point, r.get("times", 1)) > 0:
                left[point] = left.get(point, r.get("times", 1)) - 1
                return r[point]
        return None

    async def sleep(self, point: str, transfer_id: str) -> None:
        s = self.take(point, transfer_id)
        if s:
            await asyncio.sleep(float(s))


@router.post("/disagg/faults")
async def set_faults(raw: Request):
    faults: Faults = raw.app.state.disagg.faults
    if not faults.enabled:
        return error(404, "fault injection is off (start the worker with UMEM_JAX_DISAGG_FAULTS=1)")
    body = await raw.json()
    bad = [k for r in body.get("rules", []) for k in r if k not in (*POINTS, "match", "times")]
    if bad:
        return error(400, f"unknown fault points {bad}; known: {list(POINTS)}")
    faults.rules = [dict(r) for r in body.get("rules", [])]
    return {"rules": faults.rules}
