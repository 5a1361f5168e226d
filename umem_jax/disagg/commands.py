"""`umem-jax router`: its flags and what it runs, and the flags `umem-jax serve` takes to run as a
prefill or decode worker (cli.py adds both to its parser; nothing heavy is imported until it runs)."""

from __future__ import annotations


def _router(args) -> int:
    from .router import Router
    from .router_app import serve_router

    router = Router(args.prefill, args.decode, timeout_s=args.transfer_timeout, retries=args.retries)
    return serve_router(router, host=args.host, port=args.port)


def add_router_parser(sub) -> None:
    r = sub.add_parser("router", help="the OpenAI API in front of prefill and decode workers (disaggregation)")
    r.add_argument("--prefill", nargs="+", action="extend", required=True, metavar="URL", help="prefill worker URL(s)")
    r.add_argument("--decode", nargs="+", action="extend", required=True, metavar="URL", help="decode worker URL(s)")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=8000)
    r.add_argument("--transfer-timeout", type=float, default=30.0, help="seconds a page transfer may take")
    r.add_argument("--retries", type=int, default=1, help="new attempts after a failed transfer (default 1)")
    r.set_defaults(fn=_router)


def add_worker_flags(s) -> None:
    """`umem-jax serve`'s disaggregation flags (SGLang's names)."""
    s.add_argument("--disaggregation-mode", default="null", choices=("null", "prefill", "decode"),
                   help="run as the prefill or the decode worker of a disaggregated pair behind `umem-jax router` "
                   "(SGLang's flag; default null: a whole engine)")
    s.add_argument("--disaggregation-transfer-backend", default="auto", choices=("auto", "http", "shm"),
                   help="how a prefill worker sends page envelopes: shm (a shared-memory segment, one host), http "
                   "(an npz body, any host) or auto (shm when the decode worker's URL is a loopback address, "
                   "falling back to http when it cannot attach the segment; default)")
