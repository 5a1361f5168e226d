"""Page envelopes on the wire, two ways:

  http  one `np.savez` body (header JSON + one array per sub-pool) POSTed to the decode worker,
        read back with allow_pickle=False, so a peer can send bytes, never code.  Works across
        hosts; costs a zip CRC over every byte on both sides plus the HTTP body.
  shm   (one host) the arrays copied into a POSIX shared-memory segment
        (multiprocessing.shared_memory) from the prefill worker's SegmentPool; the POST carries
        only a JSON reference: the segment's name, the header and each array's dtype, shape and
        offset.  The decode worker attaches, copies the arrays out and detaches before it
        acknowledges; the prefill worker reuses the segment after the ack (or the settled
        cancel), unlinks one whose transfer ended unsettled, and its resource tracker unlinks
        the rest when it exits.

`transport_for(choice, decode_url)`: "auto" is shm for a decode worker on a loopback address,
else http; a decode worker that cannot attach the segment (another host, or another /dev/shm
namespace) answers 422 and the prefill worker sends the same transfer again over http.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import urllib.parse

import numpy as np

from ..engine.handoff import Envelopes, TransferPlan
from ..memory.declarations import WORD_BYTES

HEAD_BYTES = 64 << 10  # more than the npz's archive and array headers and the JSON head take
TRANSPORTS = ("auto", "http", "shm")
SHM_PREFIX = "umem-disagg-"  # the only segments a decode worker attaches
SHM_ALIGN = 64


class NoSegment(ValueError):
    """The shared-memory segment named by a transfer is not on this host (the sender retries over http)."""


def _head(env: Envelopes) -> dict:
    return {"fingerprint": env.fingerprint, "first_token": env.first_token, "computed": env.plan.computed,
            "pages": {k: list(v) for k, v in env.plan.pages.items()}, "state_slots": env.plan.state_slots}


def _arrays(env: Envelopes) -> dict[str, np.ndarray]:
    arrays = {f"pages/{k}": v for k, v in env.pages.items()}
    if env.state is not None:
        arrays["state"] = env.state
    return arrays


def _envelopes(head: dict, arrays: dict[str, np.ndarray]) -> Envelopes:
    plan = TransferPlan(int(head["computed"]), {k: tuple(v) for k, v in head["pages"].items()},
                        int(head["state_slots"]))
    pages = {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith("pages/")}
    return Envelopes(str(head["fingerprint"]), plan, int(head["first_token"]), pages, arrays.get("state"))


def pack(env: Envelopes) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, head=np.frombuffer(json.dumps(_head(env)).encode(), np.uint8), **_arrays(env))
    return buf.getvalue()


def unpack(body: bytes) -> Envelopes:
    """Raises ValueError for a body that is not an envelope set."""
    try:
        with np.load(io.BytesIO(body), allow_pickle=False) as z:
            head = json.loads(z["head"].tobytes().decode())
            arrays = {k: z[k] for k in z.files if k != "head"}
        return _envelopes(head, arrays)
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise ValueError(f"not a page-envelope body: {e}") from None


# ------------------------------------------------------------------------------ shared memory

_MADE_HERE: set[str] = set()  # segments this process created (and its resource tracker tracks)


def _shm():
    from multiprocessing import shared_memory

    return shared_memory


def _attach(name: str):
    """Attach a segment another process made, untracked: Python < 3.13 registers attached segments
    with this process's resource tracker too, which would unlink them when this process exits,
    though their life is their maker's business (its tracker unlinks them if it dies)."""
    shm = _shm()
    try:
        return shm.SharedMemory(name=name, track=False)  # Python >= 3.13
    except TypeError:
        seg = shm.SharedMemory(name=name)
        if name not in _MADE_HERE:  # one process in both roles (tests): its one registration stays
            from multiprocessing import resource_tracker

            resource_tracker.unregister(seg._name, "shared_memory")  # noqa: SLF001 - the tracker's own key
        return seg


class SegmentPool:
    """The prefill worker's shared-memory segments, reused: a fresh segment costs a page fault per
    4 KiB on first write (on the 2-core CPU machine a 320 MB copy into a new segment took 230 ms,
    into a reused one 26 ms).  take(nbytes) gives a free segment of at least nbytes (at most twice
    that plus 64 MiB, so a small transfer does not pin a huge one) or makes one, rounded up to
    64 MiB; give(seg) returns it once the decode worker acknowledged or the cancel was settled;
    drop(seg) unlinks one whose transfer ended unsettled (a reader might still map it: unlinking
    leaves its mapping valid).  At most `keep` free segments are kept; the process's resource
    tracker unlinks whatever is left when it exits."""

    GRAIN = 64 << 20

    def __init__(self, keep: int = 4):
        self.keep, self.free = keep, []

    def take(self, nbytes: int):
        for i, seg in enumerate(self.free):
            if nbytes <= seg.size <= 2 * nbytes + self.GRAIN:
                return self.free.pop(i)
        size = max(-(-nbytes // self.GRAIN) * self.GRAIN, self.GRAIN)
        seg = _shm().SharedMemory(name=SHM_PREFIX + secrets.token_hex(12), create=True, size=size)
        _MADE_HERE.add(seg.name)
        try:
            # Take the pages now: /dev/shm is often small (64 MiB in a default container) and a write
            # past what it holds would kill the process with SIGBUS; this fails with OSError instead.
            os.posix_fallocate(seg._fd, 0, size)  # noqa: SLF001 - the segment's file descriptor
        except OSError as e:
            self.drop(seg)
            raise OSError(f"no room for a {size >> 20} MiB shared-memory segment in /dev/shm: {e}") from None
        return seg

    def give(self, seg) -> None:
        self.free.append(seg)
        while len(self.free) > self.keep:
            self.drop(self.free.pop(0))

    def drop(self, seg) -> None:
        _MADE_HERE.discard(seg.name)
        seg.close()
        try:
            seg.unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        while self.free:
            self.drop(self.free.pop())


def pack_shm(env: Envelopes, pool: SegmentPool):
    """Copy the envelopes into a segment of `pool` -> (segment, reference dict for the POST body).
    The caller gives the segment back (or drops it) once the transfer is settled.  Raises OSError
    when /dev/shm has no room for it (the caller sends an npz body instead)."""
    arrays = _arrays(env)
    offsets, total = {}, 0
    for k, a in arrays.items():
        offsets[k] = total
        total += -(-a.nbytes // SHM_ALIGN) * SHM_ALIGN
    seg = pool.take(max(total, 1))
    for k, a in arrays.items():
        np.ndarray(a.shape, a.dtype, buffer=seg.buf, offset=offsets[k])[...] = a
    ref = {"shm": seg.name, "size": total, "head": _head(env),
           "arrays": [{"key": k, "dtype": str(a.dtype), "shape": list(a.shape), "offset": offsets[k]}
                      for k, a in arrays.items()]}
    return seg, ref


def unpack_shm(ref: dict) -> Envelopes:
    """Attach the segment a reference names and copy its arrays out, so nothing here maps it after
    the call (its maker reuses it once acknowledged).  Raises NoSegment when it is not on this
    host, ValueError for a reference that is not one (wrong name, dtype, arrays outside it)."""
    try:
        name, arrays_ref, head = str(ref["shm"]), list(ref["arrays"]), dict(ref["head"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a shared-memory envelope reference: {e}") from None
    if not name.startswith(SHM_PREFIX) or "/" in name:
        raise ValueError(f"segment name {name!r} is not a page-envelope segment ({SHM_PREFIX}...)")
    try:
        seg = _attach(name)
    except FileNotFoundError:
        raise NoSegment(f"shared-memory segment {name} is not on this host") from None
    try:
        arrays = {}
        for a in arrays_ref:
            dtype, shape, off = np.dtype(a["dtype"]), tuple(int(x) for x in a["shape"]), int(a["offset"])
            if dtype != np.uint16 or min(shape, default=0) < 0 or off < 0:
                raise ValueError(f"array {a.get('key')!r}: {dtype}{list(shape)} at {off}")
            if off + int(np.prod(shape)) * dtype.itemsize > seg.size:
                raise ValueError(f"array {a.get('key')!r} ends past the segment ({seg.size} bytes)")
            arrays[str(a["key"])] = np.array(np.ndarray(shape, dtype, buffer=seg.buf, offset=off))  # a copy
        return _envelopes(head, arrays)
    except (KeyError, TypeError) as e:
        raise ValueError(f"not a shared-memory envelope reference: {e}") from None
    finally:
        seg.close()


def transport_for(choice: str, decode_url: str) -> str:
    """The transport a send takes: "http" / "shm" as asked; "auto": shm when the decode worker is
    on a loopback address (so on this host), else http."""
    if choice not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {choice!r}")
    if choice != "auto":
        return choice
    host = urllib.parse.urlsplit(decode_url).hostname or ""
    return "shm" if host in ("localhost", "::1") or host.startswith("127.") else "http"


def max_body_bytes(plan, tokens: int) -> int:
    """Bytes of the largest body `pack` makes for a prompt of at most `tokens` tokens under `plan`
    (a memory.Plan): its envelopes (the transfer plan's pages and state slots) plus HEAD_BYTES."""
    tp = TransferPlan.of(plan, tokens)
    rows = sum((end - first) * plan[name].rows_per_page for name, (first, end) in tp.pages.items())
    rows += tp.state_slots * (plan.state.rows_per_page if plan.state is not None else 0)
    return rows * plan.row_words * WORD_BYTES + HEAD_BYTES
