"""Speculative decoding (issue 16): the verify's cost, the draft's cost, and end to end with a
HARNESS proposer at a set acceptance rate.

Random weights accept nothing, so this measures the parts and one controlled case:

  (1) verify   one verify of k+1 positions (the target over [t0, d_1..d_k], the acceptance rule,
               the recurrent state after each position kept) against one plain decode step of the
               engine without speculation, at B = 1, 8, 64 rows of a `--prompt`-token context.
               Each jitted step's arguments are captured in a warm-up run and the step is then
               replayed back to back on the device (the arena threaded through, donated): the
               device's own time per step, the host out of the way (spec_harness.replay).
  (2) draft    the draft model's k+1 decode passes (runner/speculative.jit_draft) at the same B,
               and the MTP step (verify + the head's catch-up + k-1 chained passes, one jitted
               call: runner/mtp.jit_decode) against a verify alone on the same plan; the head's
               share is the difference.
  (3) end to end  the offline engine (LLMEngine.step), greedy, ignore_eos, `--gen` tokens per
               request, at B = 1 and 8: first without speculation (the peer; it records each
               request's greedy continuation), with the engine's default async scheduling and
               again with it off (every step read back), then with the HARNESS proposer
               (spec_harness.py, a test harness: the peer's greedy continuation with each draft
               position kept with probability a) for each a:
                 method "draft": the draft's passes replaced by the harness, which picks its
                   drafts on the device, so steps overlap as with a draft model (the next step
                   launched before the previous one is read back): the engine's own cost with a
                   draft that costs nothing (`est. w/ draft` adds the measured (2));
                 method "mtp": the MTP head runs for real, only what it proposed is replaced
                   (in each step's output, on the device: steps overlap here too).
               Output tok/s over the decode window (from the last request's first token to the
               last token: prefill outside), the median of --repeats runs; its ratio to the async
               peer's; accepted length against a(1 - a^k)/(1 - a); per decode step the proposer's,
               the verify's and the host's share of the window.

Correctness first: every speculative run's greedy output (warm-ups included) must equal the
peer's token for token; a mismatch is printed with its first differing position, the peer is run
again with its top-2 log probabilities there (a near tie that bf16 rounding in the verify's
(k+1)-token pass may flip, or a real disagreement?), and the run exits 1 after writing every
figure.  Each configuration is warmed up before it is timed; XLA compilations inside every timed
window are counted and a row that compiled is marked.  Work goes in priority order (B=1, then 8,
then 64, then the extra k of (1)); no part starts after --budget-s from the process's start, and
the JSON is rewritten after every row, so a run cut short keeps what it measured.

Target: qwen3.5-4b-like (gated DeltaNet state + full attention, random bf16 weights,
registry.build_random) declaring one MTP layer, so the head attaches (random weights:
models/mtp.random_head; 0.12B besides the target's embedding and LM head).  Draft for method
"draft": a 0.40B Qwen3.5 of 8 full-attention layers, hidden 1024 (a draft with recurrent layers
is refused), the target's vocabulary and K/V geometry.

    python3 -m benchmarks.bench_speculative --out $OUT     # GPU: one H200, ~6-7 min
    python3 -m benchmarks.bench_speculative --small        # CPU: a tiny Qwen3.5, reference kernels, ~1 min
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from .report import RowLog, fmt, format_table
from .spec_harness import LABEL, Harness, capture, expected_accepted, replay
from .spec_runs import build_models, compare, engine, param_count, run, timed

COMPILE_CACHE = Path(__file__).resolve().parents[1] / "out" / "jax_cache"
GOAL_SPEEDUP = 2.0  # issue 16: a = 0.8, k = 3, B = 1: >= 2.0x the output tok/s without speculation
GOAL_SLOWDOWN = 1.15  # ... and a = 0: at most 1.15x slower


# ------------------------------------------------------------------------------ the benchmark


class Bench:
    """The parts in priority order under one time budget; each row goes to the RowLog (and the
    console) as soon as it is measured, each configuration's failure is caught and recorded."""

    def __init__(self, args, log: RowLog, say, t0: float):
        self.args, self.log, self.say = args, log, say
        self.t0 = t0  # the process's start: --budget-s counts the model build too
        self.mismatches: list[dict] = []
        self.errors: list[str] = []
        self.skipped: list[str] = []

    # budget and bookkeeping
    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def may(self, what: str) -> bool:
        if self.left() > 0:
            return True
        self.skipped.append(what)
        self.say(f"-- skipped (past --budget-s {self.args.budget_s:.0f} s): {what}")
        return False

    def add(self, row: dict) -> dict:
        row["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        self.log.add(row)
        self.say(json.dumps({k: v for k, v in row.items() if k != "harness"}, default=str))
        return row

    def check(self, what: str, got, want, B: int) -> bool:
        """got == want token for token, else the mismatch is recorded and printed -> equal."""
        bad = compare(got, want)
        if bad:
            self.mismatches.append({"run": what, "B": B, "requests": bad})
            self.say(f"!! MISMATCH: {what}: greedy output differs from the reference run in {len(bad)} of "
                     f"{len(want)} requests; first: {bad[0]}")
        return not bad

    def guarded(self, what: str, fn, *a):
        try:
            return fn(*a)
        except Exception as e:  # noqa: BLE001 - one configuration's failure; the others still run
            self.errors.append(f"{what}: {e!r}")
            self.say(f"!! ERROR in {what}: {e!r}\n{traceback.format_exc()}")
            self.add({"part": "error", "what": what, "error": repr(e)})
            gc.collect()
            return None

    # one batch size
    def prompts(self, B: int, vocab: int):
        rng = np.random.default_rng(self.args.seed * 1000 + B)
        return [rng.integers(10, vocab - 1, self.args.prompt).tolist() for _ in range(B)]

    def without(self, target, B: int, prompts) -> dict | None:
        """The peer: warm-up (captures the decode step), then (B in --e2e-batches) the timed runs
        with async scheduling and without, then the decode step replayed -> {"warm": the warm-up's
        tokens, "tokens": the e2e tokens, "peer" / "peer_sync": their rows, "decode": the replay's}."""
        a, e2e = self.args, B in self.args.e2e_batches
        out = {}
        with engine(target, a) as eng:
            store = {}
            with capture(eng.runner, "_step", B, store, meta_at=2):
                _, out["warm"] = run(eng, prompts, a.capture_gen)
            if e2e:
                first = []
                row, out["tokens"] = timed(eng, prompts, a.gen, a.repeats, lambda t: first.append(t) if not first
                                           else self.check(f"B={B} without speculation, repeated", t, first[0], B))
                self.add({"part": "e2e", "method": "none", "scheduling": "async (default)", "a": None, **row})
                out["peer"] = row
                eng.config.async_scheduling = False  # speculation's mode: every step read back
                row, _ = timed(eng, prompts, a.gen, a.repeats,
                               lambda t: self.check(f"B={B} without speculation, sync vs async", t, out["tokens"], B))
                eng.config.async_scheduling = True
                self.add({"part": "e2e", "method": "none", "scheduling": "sync", "a": None, **row})
                out["peer_sync"] = row
            if "args" in store:
                r = replay(eng.runner, eng.runner._step, store, iters=a.iters, trials=a.trials)
                out["decode"] = self.add({"part": "decode", "method": "none", "B": B, "ctx": a.prompt, **r})
            else:
                self.say(f"-- no decode step with {B} rows captured")
        return out

    @contextlib.contextmanager
    def warmed(self, method: str, target, model, B: int, prompts, peer: dict):
        """A speculative engine after its warm-up: B prompts to --capture-gen tokens with the
        harness at a=1 (compiles the prefill and the step at B; captures the step's arguments,
        checks the output) -> (engine, harness, captured step)."""
        import umem_jax.runner.mtp as mtp_mod
        import umem_jax.runner.speculative as spec_mod

        a = self.args
        spec = {"method": method, "model": model, "num_speculative_tokens": a.k,
                **({} if a.min_acceptance is None else {"min_acceptance": a.min_acceptance})}
        with engine(target, a, spec) as eng:
            h = Harness(a.k, target.config.vocab_size, 1.0, seed=a.seed)
            if method == "draft":  # both propose on the device: steps overlap as with a real draft
                h.install(eng.runner.speculator)
            else:
                h.install_mtp(eng.runner.speculator)
            store = {}
            owner, name, meta_at = (spec_mod, "jit_verify", 2) if method == "draft" else (mtp_mod, "jit_decode", 3)
            with capture(owner, name, B, store, meta_at=meta_at):
                _, toks = run(eng, prompts, a.capture_gen, [p + w for p, w in zip(prompts, peer["warm"])], h,
                              mtp=method == "mtp")
            self.check(f"B={B} {method} warm-up (harness a=1, {a.capture_gen} tokens)", toks, peer["warm"], B)
            if eng.runner.plain_decode:  # requests whose drafts do not pay go on with plain steps: compile it too
                eng.runner.precompile([(B, 1, -(-a.max_model_len // a.page_size), 0)])
            if "args" not in store:
                self.say(f"-- no {method} step with {B} rows captured")
            yield eng, h, store

    def speculative(self, method: str, target, model, B: int, prompts, peer: dict) -> None:
        """One method at B: warm-up, the e2e runs over a (B in --e2e-batches), then the step and
        its parts replayed."""
        import umem_jax.runner.mtp as mtp_mod
        import umem_jax.runner.speculative as spec_mod

        a = self.args
        with self.warmed(method, target, model, B, prompts, peer) as (eng, h, store):
            sp = eng.runner.speculator
            rows = []
            if B in a.e2e_batches and "tokens" in peer:
                expected = [p + w for p, w in zip(prompts, peer["tokens"])]
                for i, acc in enumerate(a.acceptance):
                    h.a = acc
                    h.reseed(a.seed * 100 + i)
                    oks = []
                    row, _ = timed(eng, prompts, a.gen, a.repeats,
                                   lambda t: oks.append(self.check(f"B={B} {method} a={acc}", t, peer["tokens"], B)),
                                   expected=expected, harness=h, mtp=method == "mtp")
                    ok = all(oks)
                    rows.append(self.add({
                        "part": "e2e", "method": method, "harness": LABEL, "a": acc, "k": a.k, **row,
                        "expected_accepted_length": expected_accepted(acc, a.k), "outputs_equal": ok,
                        "ratio": row["tok_s"] / peer["peer"]["tok_s"],
                        "ratio_vs_sync": row["tok_s"] / peer["peer_sync"]["tok_s"]}))
            if "args" not in store:
                return
            over = lambda ms: ms / peer["decode"]["ms"] if "decode" in peer else None  # noqa: E731
            lay = store["kw"]["layout"]
            if method == "draft":
                prof = (str(Path(a.out) / f"profile_verify_B{B}") if a.profile_verify and B in a.profile_verify
                        and a.out else None)
                verify = replay(eng.runner, spec_mod.jit_verify, store, iters=a.iters, trials=a.trials,
                                profile_dir=prof)
                self.add({"part": "verify", "method": "draft", "B": B, "k": a.k, "ctx": a.prompt, **verify,
                          "decode_ms": peer.get("decode", {}).get("ms"), "verify_over_decode": over(verify["ms"])})
                _, _, meta, prev, spec_lens, *_ = store["args"]
                dstore = {"args": (sp._draft_leaves(), None, meta, prev, spec_lens),
                          "kw": {"layout": lay, "draft": sp._draft_model, "k": a.k}}
                draft = replay(eng.runner, spec_mod.jit_draft, dstore, iters=a.iters, trials=a.trials)
                self.add({"part": "draft", "method": "draft", "B": B, "k": a.k, "ctx": a.prompt,
                          "what": f"the draft model's k+1 = {a.k + 1} decode passes (jit_draft)", **draft,
                          "draft_over_decode": over(draft["ms"])})
                for r in rows:  # the same run with this draft model proposing: an estimate (its passes added)
                    r["tok_s_with_draft_est"] = (r["output_tokens"] - B) / (r["window_s"]
                                                                             + r["decode_steps"] * draft["ms"] / 1e3)
                    r["ratio_with_draft_est"] = r["tok_s_with_draft_est"] / peer["peer"]["tok_s"]
                self.log.flush()
            else:
                step = replay(eng.runner, mtp_mod.jit_decode, store, iters=a.iters, trials=a.trials)
                _, _, _, meta, prev, spec_lens, drafts, states, counts = store["args"]
                vstore = {"args": (eng.runner.params_leaves()[0], None, meta, prev, spec_lens, drafts, None, states,
                                   counts),
                          "kw": {"layout": lay, "model": sp._verify()}}
                verify = replay(eng.runner, spec_mod.jit_verify, vstore, iters=a.iters, trials=a.trials)
                self.add({"part": "draft", "method": "mtp", "B": B, "k": a.k, "ctx": a.prompt,
                          "what": "MTP step (verify + head catch-up + k-1 chained passes) less a verify, one plan",
                          "step_ms": step["ms"], "verify_ms": verify["ms"], "ms": step["ms"] - verify["ms"],
                          "first_s": step["first_s"] + verify["first_s"],
                          "compiles": step["compiles"] + verify["compiles"], "mtp_step_over_decode": over(step["ms"])})

    def extra_ks(self, models, B: int) -> None:
        """(1) at the other k of --extra-ks, last: the draft engine at B warmed up again (nothing
        new compiles), then its verify with k' drafts per row.  Positions past the k+1 the rows
        hold pages for land on their last page and the states past k go to their slots again
        (j mod k): the bytes a verify of k' moves, written where no live request is."""
        import umem_jax.runner.speculative as spec_mod

        a = self.args
        target, draft, _ = models
        prompts, peer = self.done[B]
        with self.warmed("draft", target, draft, B, prompts, peer) as (eng, _, store):
            if "args" not in store:
                return
            params, _, meta, prev, spec_lens, drafts, q, states, counts = store["args"]
            for kk in [k for k in a.extra_ks if k != a.k]:
                if not self.may(f"verify k={kk} B={B}"):
                    return
                cols = np.arange(kk) % a.k
                s = np.where(np.asarray(spec_lens) > 0, kk, 0).astype(np.int32)
                st = None
                if states is not None:
                    pos = np.where(s[:, None] > 0, np.arange(1, kk + 1)[None, :], -1).astype(np.int32)
                    st = (pos, np.asarray(states[1])[:, cols].astype(np.int32))
                kstore = {"args": (params, None, meta, prev, s, np.asarray(drafts)[:, cols], None, st, counts),
                          "kw": store["kw"]}
                r = replay(eng.runner, spec_mod.jit_verify, kstore, iters=a.iters, trials=a.trials)
                self.add({"part": "verify", "method": "draft", "B": B, "k": kk, "ctx": a.prompt, **r,
                          "decode_ms": peer.get("decode", {}).get("ms"),
                          "verify_over_decode": r["ms"] / peer["decode"]["ms"] if "decode" in peer else None})

    def diagnose(self, target) -> None:
        """After a mismatch: the run without speculation again with the top-2 log probabilities, at
        the first differing position of up to 4 mismatched requests.  A speculative token that is
        the runner-up of a near tie is bf16 rounding in another kernel (the verify computes k+1
        positions in one pass, the decode one), not a wrong acceptance."""
        from umem_jax import SamplingParams

        cases = []
        for m in self.mismatches:
            for r in m["requests"]:
                key = (m["B"], r["request"], r["position"], r["got"][0] if r["got"] else None)
                if m["B"] in self.done and key not in cases:
                    cases.append(key)
        with engine(target, self.args) as eng:
            for B, i, pos, spec_tok in cases[:4]:
                sp = SamplingParams(temperature=0.0, max_tokens=pos + 1, ignore_eos=True, logprobs=2)
                rid = eng.add_request(self.done[B][0][i], sp)
                outs = {}
                while eng.has_unfinished_requests():
                    outs.update((o.request_id, o) for o in eng.step())
                lp = outs[rid].outputs[0].logprobs[pos]
                top = sorted(((t, v.logprob) for t, v in lp.items() if v.rank is not None), key=lambda x: -x[1])[:2]
                self.add({"part": "diagnosis", "B": B, "request": i, "position": pos, "spec_token": spec_tok,
                          "peer_top2": top, "margin_nats": top[0][1] - top[1][1] if len(top) > 1 else None,
                          "spec_token_is_runner_up": len(top) > 1 and top[1][0] == spec_tok})

    def batch(self, models, B: int) -> None:
        target, draft, head = models
        prompts = self.prompts(B, target.config.vocab_size)
        if not self.may(f"B={B} without speculation"):
            return
        peer = self.guarded(f"B={B} without speculation", self.without, target, B, prompts)
        if peer is None:
            return
        self.done[B] = (prompts, peer)
        for method in self.args.methods:
            if self.may(f"B={B} method {method}"):
                self.guarded(f"B={B} method {method}", self.speculative, method, target,
                             draft if method == "draft" else head, B, prompts, peer)

    def main(self, models) -> None:
        """Priority order: each B (ascending) whole, then the extra k of (1)."""
        self.done = {}
        for B in self.args.batches:
            self.batch(models, B)
        # A mismatch is diagnosed before anything optional: it says whether the numbers above hold.
        if self.mismatches and self.may("diagnosis of the mismatches"):
            self.guarded("diagnosis of the mismatches", self.diagnose, models[0])
        if "draft" in self.args.methods:
            for B in self.done:
                if [k for k in self.args.extra_ks if k != self.args.k] and self.may(f"verify extra k at B={B}"):
                    self.guarded(f"verify extra k at B={B}", self.extra_ks, models, B)


# ------------------------------------------------------------------------------ report


# A first difference whose speculative token is the peer's runner-up this close is rounding (the
# verify computes k+1 positions in one pass, the decode one), not a wrong acceptance.
TIE_NATS = 0.01


def print_tables(rows: list[dict], args, say) -> list[str]:
    """The three tables and the goals' verdicts -> the verdict lines."""
    peer = {r["B"]: r for r in rows if r.get("part") == "e2e" and r["method"] == "none" and r["scheduling"] != "sync"}
    sync = {r["B"]: r for r in rows if r.get("part") == "e2e" and r["method"] == "none" and r["scheduling"] == "sync"}
    mark = lambda r: "  COMPILED" if r.get("compiles") else ""  # noqa: E731
    say(f"\n(1) verify of k+1 positions vs one decode step without speculation (device replay, ms per step, "
        f"context {args.prompt})")
    ver = [r for r in rows if r.get("part") == "verify"]
    say(format_table(["B", "k", "decode ms", "verify ms", "verify/decode", ""],
                     [[r["B"], r["k"], fmt(r["decode_ms"], ".3f"), fmt(r["ms"], ".3f"),
                       fmt(r["verify_over_decode"], ".2f"), mark(r)] for r in ver]))
    say(f"\n(2) draft cost per step, k={args.k} (device replay, ms)")
    dr = [r for r in rows if r.get("part") == "draft"]
    dec = {r["B"]: r["ms"] for r in rows if r.get("part") == "decode"}
    say(format_table(["method", "B", "draft ms", "/ decode", "what", ""],
                     [[r["method"], r["B"], fmt(r["ms"], ".3f"),
                       fmt(r["ms"] / dec[r["B"]] if r["B"] in dec else None, ".2f"),
                       r["what"] if r["method"] == "draft" else
                       f"MTP step {r['step_ms']:.3f} - verify {r['verify_ms']:.3f}", mark(r)] for r in dr]))
    say(f"\n(3) end to end, greedy, {args.gen} tokens per request, prompt {args.prompt}, k={args.k}; "
        f"speculative rows: {LABEL}")
    e2e = [r for r in rows if r.get("part") == "e2e"]
    say(format_table(
        ["method", "B", "a", "tok/s", "x async peer", "x sync peer", "accepted/step", "(a-model)", "tokens/step",
         "steps", "est. w/ draft", "harness us/step", "outputs", ""],
        [[r["method"] + ("" if r["method"] != "none" else f" ({r['scheduling'].split()[0]})"), r["B"],
          fmt(r["a"], "g"), fmt(r["tok_s"], ".1f"),
          fmt(r.get("ratio", r["tok_s"] / peer[r["B"]]["tok_s"] if r["B"] in peer else None), ".3f"),
          fmt(r.get("ratio_vs_sync", r["tok_s"] / sync[r["B"]]["tok_s"] if r["B"] in sync else None), ".3f"),
          fmt(r.get("mean_accepted_length"), ".2f"), fmt(r.get("expected_accepted_length"), ".2f"),
          fmt(r.get("mean_tokens_per_step"), ".2f"), r["decode_steps"], fmt(r.get("ratio_with_draft_est"), ".3f"),
          fmt(r.get("harness_us_per_call"), ".0f"),
          {True: "equal", False: "DIFFER", None: "-"}[r.get("outputs_equal")], mark(r)] for r in e2e]))
    diag = [r for r in rows if r.get("part") == "diagnosis"]
    if diag:
        say("\n(!) mismatches: the run without speculation's top-2 log probabilities where the outputs first differ")
        say(format_table(["B", "request", "position", "spec token", "peer top-2 (token, logprob)", "margin nats",
                          "spec = runner-up"],
                         [[r["B"], r["request"], r["position"], r["spec_token"], r["peer_top2"],
                           fmt(r["margin_nats"], ".4f"), r["spec_token_is_runner_up"]] for r in diag]))
    verdicts = []
    for method in args.methods:
        got = {r["a"]: r for r in e2e if r["method"] == method and r["B"] == 1 and r["k"] == args.k}
        hi, lo = got.get(0.8), got.get(0.0)
        if hi is not None:
            verdicts.append(f"{method} (harness), B=1, k={args.k}, a=0.8: {hi['ratio']:.2f}x the async peer's tok/s "
                            f"(goal >= {GOAL_SPEEDUP}x: {'met' if hi['ratio'] >= GOAL_SPEEDUP else 'MISSED'})")
        if lo is not None:
            slow = 1 / lo["ratio"]
            verdicts.append(f"{method} (harness), B=1, k={args.k}, a=0: {slow:.3f}x the async peer's time per output "
                            f"token (goal <= {GOAL_SLOWDOWN}x: {'met' if slow <= GOAL_SLOWDOWN else 'MISSED'})")
    return verdicts


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    ap.add_argument("--small", action="store_true", help="tiny Qwen3.5, reference kernels, CPU (~1 min)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="bench_speculative.json and .log here "
                    "(default $OUT when set)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--min-acceptance", type=float, default=None,
                    help="SpeculativeConfig.min_acceptance: below it a request stops speculating (default: the "
                    "engine's, 0.3; 0 keeps every request speculating, as before session 11)")
    ap.add_argument("--batches", type=ints, default=None, help="B of (1) and (2), ascending (default 1,8,64)")
    ap.add_argument("--e2e-batches", type=ints, default=None, help="B of (3) (default 1,8)")
    ap.add_argument("--acceptance", default="0,0.5,0.8,1", help="the harness's a values")
    ap.add_argument("--methods", default="draft,mtp")
    ap.add_argument("--extra-ks", type=ints, default=None, help="(1) also at these k, last (default 1,5)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens = the context of (1), (2) (default 2048)")
    ap.add_argument("--gen", type=int, default=None, help="output tokens per request in (3) (default 256)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs of each (3) row, median tok/s (default 3)")
    ap.add_argument("--kernel-impl", default=None, help="pallas | reference (default: the engine's: pallas on a GPU)")
    ap.add_argument("--iters", type=int, default=None, help="back-to-back calls per replay trial (default 20)")
    ap.add_argument("--trials", type=int, default=None, help="replay trials, median (default 3)")
    ap.add_argument("--arena-gib", type=float, default=None, help="every engine's arena (default 28: B=64 with "
                    "4 state slots of 51.5 MB each per request and the draft's K/V)")
    ap.add_argument("--page-size", type=int, default=None)
    ap.add_argument("--dtype", default=None, help="weights (default bfloat16; --small float32)")
    ap.add_argument("--budget-s", type=float, default=None, help="no new part starts this many seconds after the "
                    "process started (default 380; a part takes up to ~1-2 min on the GPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile-verify", type=ints, default=None, help="at these B, 3 more verify calls under "
                    "jax.profiler.trace into <out>/profile_verify_B<B> (where the verify's time goes)")
    args = ap.parse_args(argv)
    big = dict(batches=[1, 8, 64], e2e_batches=[1, 8], extra_ks=[1, 5], prompt=2048, gen=256, repeats=3, iters=20,
               trials=3, arena_gib=28.0, page_size=16, dtype="bfloat16", budget_s=380.0)
    small = dict(batches=[1, 2], e2e_batches=[1], extra_ks=[], prompt=24, gen=16, repeats=1, iters=3, trials=2,
                 arena_gib=0.004, page_size=4, dtype="float32", budget_s=600.0)
    for key, value in (small if args.small else big).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.small and args.kernel_impl is None:
        args.kernel_impl = "reference"
    args.batches = sorted(set(args.batches))
    args.e2e_batches = [b for b in args.e2e_batches if b in args.batches]
    args.acceptance = [float(x) for x in args.acceptance.split(",") if x.strip()]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.capture_gen = 2 * args.k + 2  # warm-up: a few verify steps after the prefill
    args.max_model_len = args.prompt + max(args.gen, args.capture_gen) + 2 * max([args.k, *args.extra_ks]) + 8
    return args


def main(argv=None) -> int:
    t0 = time.perf_counter()  # --budget-s counts JAX's start-up and the model build too
    args = parse(argv)
    import jax

    if not args.small:  # a later call on the same machine loads the compiled steps
        from umem_jax.bench.driver import enable_compile_cache

        enable_compile_cache(str(COMPILE_CACHE))
    out = Path(args.out) if args.out else None
    logf = None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        logf = open(out / "bench_speculative.log", "w")

    def say(msg: str) -> None:
        print(msg, flush=True)
        if logf is not None:
            logf.write(msg + "\n")
            logf.flush()

    models = build_models(args)
    target, draft, head = models
    name = "qwen3.5-tiny (--small)" if args.small else "qwen3.5-4b-like + 1 MTP layer"
    meta = {"jax": jax.__version__, "device": str(jax.devices()[0]), "target": name, "dtype": args.dtype,
            "target_params": param_count(target), "draft": f"Qwen3.5 full attention only, {draft.config.num_layers} "
            f"layers, hidden {draft.config.hidden_size}", "draft_params": param_count(draft),
            "mtp_head_params": param_count(head), "k": args.k, "prompt": args.prompt, "gen": args.gen,
            "harness": LABEL, "command": " ".join(["python3 -m benchmarks.bench_speculative", *(argv or sys.argv[1:])]),
            "models_built_s": round(time.perf_counter() - t0, 1)}
    say(f"== bench_speculative: {name} ({meta['target_params'] / 1e9:.2f}B, {args.dtype}, random weights), draft "
        f"{meta['draft_params'] / 1e9:.3f}B, MTP head {meta['mtp_head_params'] / 1e9:.3f}B, k={args.k}, "
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}; models built in {meta['models_built_s']} s")
    log = RowLog(str(out / "bench_speculative.json") if out else None, **meta)
    bench = Bench(args, log, say, t0)
    log.meta.update(mismatches=bench.mismatches, errors=bench.errors, skipped=bench.skipped)  # in every flush
    bench.main(models)
    verdicts = print_tables(log.rows, args, say)
    from umem_jax.bench.driver import compile_count

    log.meta.update(verdicts=verdicts, compiles_total=compile_count(), mismatches=bench.mismatches,
                    errors=bench.errors, skipped=bench.skipped,
                    total_s=round(time.perf_counter() - t0, 1))
    log.flush()
    for v in verdicts:
        say(v)
    if bench.skipped:
        say(f"skipped (budget): {', '.join(bench.skipped)}")
    say(f"total {time.perf_counter() - t0:.0f} s")
    status = 0
    if bench.mismatches:
        say(f"!! CORRECTNESS: {len(bench.mismatches)} speculative runs differ from greedy without speculation "
            f"(details above and in the JSON's 'mismatches')")
        diag = [r for r in log.rows if r.get("part") == "diagnosis"]
        ties = [r for r in diag if r["spec_token_is_runner_up"] and r["margin_nats"] is not None
                and r["margin_nats"] <= TIE_NATS]
        if diag:
            say(f"   diagnosed {len(diag)}: {len(ties)} at a near tie (the speculative token is the peer's runner-up, "
                f"<= {TIE_NATS} nats behind: rounding in another kernel, then the runs part ways; a harness "
                f"proposing the peer's continuation is rejected from there on)")
        status = 1
    if bench.errors:
        say(f"!! {len(bench.errors)} configurations failed: {bench.errors}")
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
