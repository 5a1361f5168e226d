"""`umem-jax router`: its flags and what it runs (cli.py adds it to the parser; nothing heavy is
imported until it runs)."""

from __future__ import annotations


def _router(args) -> int:
    from .router import Router, serve_router

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
