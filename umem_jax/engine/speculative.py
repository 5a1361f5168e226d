"""Speculative decoding in the engine: the draft (a draft model or the target's MTP head), what is
refused, and applying a verify.

    LLM("tiny-attention", speculative_config={"method": "draft", "model": "tiny-attention",
                                              "num_speculative_tokens": 3})
    LLM("path/to/Qwen3.5", speculative_config={"method": "mtp", "num_speculative_tokens": 3})

Method "mtp" (SGLang's NEXTN) drafts with the checkpoint's own multi-token-prediction layers
(Qwen3.5, Qwen3.5-MoE, Qwen3-Next `mtp.*`; NemotronH `mtp.layers.*`: models/mtp.py), read from
the target's checkpoint directory (or the directory speculative_config `model` names, or a head
Model given there); they share the target's embedding and LM head.  A checkpoint without them
is refused at startup naming what is missing.  The head's drafts ride on the host between steps
(Request.drafts; runner/mtp.py): one jitted call per step verifies, catches the head up on the
accepted tokens and proposes the next drafts.  Its attention layers are planned as model
"draft" like a draft model's, so their K/V fuse into the target's full-attention envelopes.
Its entry at a page's last position is made from the token after the page, so the prefix cache
keys pages with that token (`cache_lookahead`; scheduler/radix_node.py says what a hit loses).

The draft's layers are declared as model "draft" beside the target's (`plan_decls`), so the
plan fuses them into the target's page envelopes where lifetime and geometry match and gives a
window length the target lacks its own window sub-pool; the demand model prices a decode step
as a pass of k+1 tokens.  A decode step is launched before the previous one is read back (its
rows' positions depend on how many drafts were accepted, so it reads those counts on the device
and its memory is placed for the worst case).  The runner's side: runner/speculative.py; the
scheduler's: scheduler/speculation.py.

A target with recurrent layers (Mamba2 / gated DeltaNet) holds k speculative state slots per
request beside its working slot (`speculative_demand`: priced by the demand model, so admission,
the memory clip and retraction stay one model); a verify keeps the state after each verified
position there and the accepted one becomes the working slot (scheduler/speculation.py).

Refused at startup, with the reason: a draft with recurrent layers (its k+1 decode passes
advance its state in place; keeping the draft's state after each pass is not built), a draft
whose vocabulary differs from the target's, a draft layer whose geometry differs from the
target's sub-pool of the same lifetime, method "mtp" on a target without MTP layers (or a
checkpoint without their weights, or with more than one), a draft or head whose heads do not
split over tensor_parallel_size devices (each is split as the target is),
max_num_batched_tokens < k+1.  Nothing per request: n > 1 and best_of samples are requests of
their own (engine/samples.py), each speculating alone.  Penalties apply at each verified
position with the counts it follows (runner/speculative.verify_penalties; the draft proposes
without them, which the acceptance rule allows).  Logprobs are every emitted token's, from the verify's
raw logits at its position (as a plain step reports them: before bans and sampling).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ..core.request import Request, RequestStatus
from ..memory.declarations import LayerDecl
from ..models.config import RECURRENT
from ..runner.mtp import valid_drafts
from ..scheduler.speculation import commit_state
from .isolation import EngineDeadError


class SpeculationError(ValueError):
    """A speculative_config this engine cannot serve; the message says why."""


def check_config(cfg) -> None:
    """Refusals that need no model (called before the target is loaded or split)."""
    spec = cfg.speculative_config
    if cfg.max_num_batched_tokens < spec.num_speculative_tokens + 1:
        raise SpeculationError(f"max_num_batched_tokens={cfg.max_num_batched_tokens} is below num_speculative_tokens"
                               f"+1={spec.num_speculative_tokens + 1}: a verify is a pass of k+1 tokens")


def load_draft(cfg, target):
    """The draft Model of cfg.speculative_config (a draft model, or the target's MTP head),
    checked against the target -> Model."""
    from ..models import loader
    from ..models.model import Model

    spec = cfg.speculative_config
    check_config(cfg)
    if spec.method == "mtp":
        return _load_mtp(cfg, target)
    m = spec.model
    draft = m if isinstance(m, Model) else loader.load_model(loader.HF_NAMES.get(str(m), str(m)), dtype=cfg.dtype)
    _refuse_recurrent(draft.config, "draft")
    if draft.config.vocab_size != target.config.vocab_size:
        raise SpeculationError(f"the draft's vocabulary ({draft.config.vocab_size} tokens) differs from the "
                               f"target's ({target.config.vocab_size}): a draft must share the target's tokenizer")
    if cfg.tensor_parallel_size > 1:  # split as the target: its layers live in the same per-device arena
        from ..models.sharded_model import shard_model

        try:
            draft = shard_model(draft, cfg.tensor_parallel_size, expert_parallel=cfg.enable_expert_parallel)
        except ValueError as e:
            raise SpeculationError(f"the draft cannot be split over {cfg.tensor_parallel_size} devices: {e}") from None
    if cfg.fuse_projections:
        draft = draft.fuse_projections(donate=draft is not m)
    return draft


def _load_mtp(cfg, target):
    """The target's MTP head: the Model speculative_config `model` gives, else read from `model`
    (a checkpoint directory) or the target's own checkpoint; random for load_format "dummy"."""
    from ..models import mtp
    from ..models.model import Model

    m = cfg.speculative_config.model
    full = getattr(target, "full_config", None)  # a split target: the head is read at the full shapes, then split
    base = target if full is None else dataclasses.replace(target, config=full)
    try:
        if isinstance(m, Model):
            mtp.head_class(base.config)
            head = m
        elif cfg.load_format == "dummy" and m is None:
            head = mtp.random_head(base, cfg.seed)
        else:
            head = mtp.load_head(base, m)
        if full is not None:
            from ..models.sharded_model import shard_model

            head = shard_model(head, cfg.tensor_parallel_size, expert_parallel=cfg.enable_expert_parallel)
    except ValueError as e:
        raise SpeculationError(f"speculative method 'mtp': {e}") from None
    return head.fuse_projections(donate=head is not m) if cfg.fuse_projections else head


def _refuse_recurrent(mc, who: str) -> None:
    if any(t == RECURRENT for t in mc.layer_types):
        raise SpeculationError(
            f"speculative decoding with a {who} that has recurrent layers ({mc.architecture}: Mamba2 / gated "
            "DeltaNet state) is not supported yet: its k+1 draft passes advance its state in place, and keeping "
            "the draft's state after each pass (to commit the accepted one) is not built; use a draft without "
            "recurrent layers (the target may have them)")


def speculative_demand(cfg, plan) -> dict:
    """DemandModel arguments under speculation: a decode step is a pass of k+1 tokens, and with
    async scheduling of up to 2k+1 (a step placed while one is in flight holds the rows of both
    worst cases: scheduler/speculation.py); with recurrent state every request also holds k
    speculative state slots (the state after each verified position), taken with its working
    slot and held to the end.  An MTP head's K/V rows are in the plan's page envelopes (priced
    with every page); its chained passes past the verified positions take nothing: without a
    page of the row they write to the sink."""
    k = cfg.speculative_config.num_speculative_tokens
    out = {"decode_pass": min(2 * k + 1, cfg.max_num_batched_tokens) if cfg.async_scheduling else k + 1}
    if plan.state is not None:
        out["extra_state_slots"] = cfg.extra_state_slots + k
    return out


def cache_lookahead(spec) -> int:
    """Tokens past a cached page that the page's bytes depend on: the prefix cache keys a page
    with them, so a hit shares only pages made with the request's own next tokens
    (scheduler/radix_node.py).  An MTP head's entry at i is made from token i + 1 (models/mtp.py):
    1.  A draft model's entry at i, like the target's, depends on tokens <= i: 0 (hits as without
    speculation)."""
    return 1 if spec is not None and spec.method == "mtp" else 0


def plan_decls(target_decls: list[LayerDecl], draft, kv: str) -> list[LayerDecl]:
    """The target's declarations and the draft's, tagged "draft", planned as one model."""
    return list(target_decls) + [dataclasses.replace(d, model="draft") for d in draft.decls(kv)]


@dataclasses.dataclass
class SpecStats:
    """Speculation counters: verify rows, drafts proposed / accepted, per position, times (an MTP
    head drafts inside the verify's jitted call: its time is all verify_s, draft_s stays 0).
    Steps overlap, so a step's time is measured only on every Speculator.TIME_EVERY-th step
    (it waits for the draft, then the verify); the steps in between count the last measured
    figures: draft_s and verify_s are estimates of device-bound time, not wall time."""

    k: int
    rows: int = 0  # decode rows verified
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens appended (accepted drafts + corrected / bonus tokens)
    draft_s: float = 0.0
    verify_s: float = 0.0
    switched_off: int = 0  # requests whose drafts stopped paying (SpeculativeConfig.min_acceptance)
    proposed_at: np.ndarray = None
    accepted_at: np.ndarray = None

    def __post_init__(self):
        self.proposed_at = np.zeros(self.k, np.int64)
        self.accepted_at = np.zeros(self.k, np.int64)

    def as_dict(self) -> dict:
        per = np.divide(self.accepted_at, np.maximum(self.proposed_at, 1))
        return {"num_speculative_tokens": self.k, "num_verify_rows": self.rows, "num_draft_tokens": self.proposed,
                "num_accepted_tokens": self.accepted,
                "mean_accepted_length": self.accepted / self.rows if self.rows else 0.0,
                "mean_tokens_per_step": self.emitted / self.rows if self.rows else 0.0,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "acceptance_per_position": [round(float(x), 4) for x in per],
                "draft_time_s": self.draft_s, "verify_time_s": self.verify_s,
                "num_requests_switched_off": self.switched_off}

    def summary(self) -> str:
        """One line for people: mean accepted length and the acceptance of each draft position."""
        d = self.as_dict()
        per = ", ".join(f"{x:.2f}" for x in d["acceptance_per_position"])
        return (f"speculative: k={self.k}, {d['mean_accepted_length']:.2f} drafts accepted per step "
                f"({d['mean_tokens_per_step']:.2f} tokens), acceptance {d['acceptance_rate']:.2f}, per position "
                f"[{per}], draft {self.draft_s:.3f} s, verify {self.verify_s:.3f} s")


def apply_verify(engine, launched) -> list:
    """Read back a speculative decode step and apply it: per row, the accepted drafts and the
    corrected / bonus token through the stop rules, then the rollback of the rest -> outputs of
    the requests that finished."""
    try:
        out = np.asarray(launched.tokens)
        lp = None if launched.logprobs is None else [np.asarray(x) for x in launched.logprobs]  # [B, k+1, ...]
    except Exception as e:
        raise EngineDeadError(f"a step's tokens could not be read back (a device error): {e!r}") from e
    st = engine.spec_stats
    k = st.k
    st.draft_s += launched.draft_s
    st.verify_s += launched.verify_s
    lens = launched.batch.spec_lens or [0] * len(launched.batch.rows)  # as scheduled: what the memory was placed for
    outs, now = [], time.time()
    for i, (row, placed) in enumerate(zip(launched.batch.rows, lens)):
        req: Request = row.req
        req.read_pending()
        if req.finished:
            continue
        n, s = int(out[i, 0]), int(out[i, -1])  # accepted, verified (an MTP head may verify fewer than placed)
        st.rows += 1
        st.proposed += s
        st.accepted += n
        st.proposed_at[:s] += 1
        st.accepted_at[:n] += 1
        _judge(engine, req, n, s)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        try:
            for j, t in enumerate(out[i, 1:n + 2].tolist()):
                if req.logprobs is not None:  # the logprobs of emitted token j (verify position j)
                    req.add_logprobs([x[:, j] for x in lp], i)
                engine._append(req, t)
                st.emitted += 1
                if req.finished:
                    break
            if req.finished:
                req.metrics.finished_time = now
                outs.append(req.output())
                engine._requests.pop(req.request_id, None)
            elif req.status != RequestStatus.RUNNING:  # retracted while in flight: it computes everything again
                req.spec_ahead = max(0, req.spec_ahead - placed)
            else:
                commit_state(req, n, s)
                engine.scheduler.settle_speculation(req, n, placed)
                if launched.next_drafts:  # the MTP head's drafts for the positions after the new pending token
                    req.drafts = valid_drafts(out[i, k + 2:k + 2 + launched.next_drafts])
        except Exception as e:  # noqa: BLE001 - this request's failure, not the step's
            engine.isolation.fail(req, e, "applying its tokens")
    return outs


def _judge(engine, req: Request, accepted: int, proposed: int) -> None:
    """Count a verify of `req`; after its first probe_steps verifies that proposed drafts, switch
    its speculation off for good when it keeps less than min_acceptance of them (its draft's or
    MTP head's K/V then fall behind, so it is never switched back on)."""
    if not proposed:
        return
    req.spec_steps += 1
    req.spec_proposed += proposed
    req.spec_accepted += accepted
    cfg = engine.config.speculative_config
    if (not req.spec_off and cfg.min_acceptance > 0 and req.spec_steps >= cfg.probe_steps
            and req.spec_accepted < cfg.min_acceptance * req.spec_proposed):
        req.spec_off = True
        engine.spec_stats.switched_off += 1


__all__ = ["SpecStats", "SpeculationError", "apply_verify", "cache_lookahead", "check_config", "load_draft",
           "plan_decls", "speculative_demand"]
