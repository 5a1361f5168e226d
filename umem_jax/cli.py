"""The `umem-jax` command.

    umem-jax demo  [--model PRESET] [--budget-mib N] [--memory-mode unified|static]
    umem-jax plan  [--model PRESET] [--budget-gib N] [--page-size N] [--max-model-len N]
"""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    from . import demo

    demo.run(args.model, args.budget_mib, args.page_size, args.memory_mode, args.seed)
    return 0


def _plan(args) -> int:
    from .memory.plan import plan
    from .memory.sizing import size_arena, static_regions
    from .presets import preset

    p = plan(preset(args.model), page_size=args.page_size)
    print(p.table())
    size = size_arena(p, int(args.budget_gib * 2**30), max_model_len=args.max_model_len)
    regions = static_regions(p, size.num_rows) if args.memory_mode == "static" else None
    print(size.summary(regions))
    return 0


def main(argv: list[str] | None = None) -> int:
    from .presets import PRESETS

    ap = argparse.ArgumentParser(prog="umem-jax", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p, budget_flag, budget_default):
        p.add_argument("--model", default="tiny-hybrid", choices=sorted(PRESETS), help="built-in hybrid shape")
        p.add_argument("--page-size", type=int, default=16)
        p.add_argument("--memory-mode", default="unified", choices=("unified", "static"))
        p.add_argument(budget_flag, type=float, default=budget_default)

    d = sub.add_parser("demo", help="scripted allocations through the arena, band occupancy after each phase")
    common(d, "--budget-mib", 4.0)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(fn=_demo)

    p = sub.add_parser("plan", help="print the plan and the arena sizing for a model shape and budget")
    common(p, "--budget-gib", 16.0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.set_defaults(fn=_plan)

    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:  # plan refusals and sizing errors: the message says what to do
        print(f"umem-jax: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
