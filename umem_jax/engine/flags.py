"""The `umem-jax` engine flags (`serve`, `generate`): vLLM's names, SGLang's spellings of the
same options as aliases, and the arena's own (cli.py builds the parsers; EngineConfig checks
the values).  An alias sets the same option under the other server's name, so commands written
for either run unchanged; a flag that would change nothing here says so in its help."""

from __future__ import annotations

import argparse
import os

# XLA's command buffers are its CUDA graphs: an empty list turns them off
NO_CUDA_GRAPHS = "--xla_gpu_enable_command_buffer="


def int_from(low: int, why: str):
    """An argparse type: an int >= low, else the flag's error (exit 2) saying `why`."""
    def parse(text: str) -> int:
        value = int(text)  # a non-int: argparse's own "invalid int value"
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}: {why}")
        return value

    parse.__name__ = "int"
    return parse


def apply_enforce_eager(args, environ=os.environ) -> None:
    """--enforce-eager / --disable-cuda-graph: the compiled steps run without CUDA graphs (XLA's
    command buffers off, the nearest thing here to vLLM's eager mode: each kernel is launched on
    its own; for debugging and profiling, slower at small batches).  XLA reads XLA_FLAGS when the
    GPU backend starts, which in the CLI comes after the flags are parsed."""
    if getattr(args, "enforce_eager", False) and NO_CUDA_GRAPHS not in environ.get("XLA_FLAGS", ""):
        environ["XLA_FLAGS"] = f"{environ.get('XLA_FLAGS', '')} {NO_CUDA_GRAPHS}".strip()


def add_engine_flags(p, model_help: str) -> None:
    """The engine flags of `serve` and `generate` on parser `p`; MODEL's help is `model_help`."""
    from ..memory.declarations import MAMBA_SSM_DTYPES

    p.add_argument("model", nargs="?", help=model_help)
    # --model spelled out (vLLM's older form): as a mere abbreviation of --model-path it would
    # break the day any other --model-* flag appears
    p.add_argument("--model-path", "--model", dest="model_path", help="alias of the positional MODEL (SGLang's "
                   "--model-path, vLLM's --model)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--gpu-memory-utilization", "--mem-fraction-static", type=float, default=0.9,
                   help="fraction of the GPU's memory for the weights and the arena, in (0, 1] (default 0.9; a CPU "
                   "arena is sized by --arena-bytes / --max-model-len instead)")
    p.add_argument("--arena-bytes", type=int, default=None,
                   help="arena budget in bytes, per device under tensor parallelism (default: on a GPU what "
                   "--gpu-memory-utilization leaves after the weights; on a CPU 64 MiB, or more up to 1 GiB to "
                   "hold one request of --max-model-len)")
    p.add_argument("--max-num-seqs", "--max-running-requests", type=int, default=256,
                   help="requests running at once (default 256)")
    p.add_argument("--max-num-batched-tokens", "--chunked-prefill-size", type=int, default=2048,
                   help="prefill tokens per step, and so the longest prefill chunk (default 2048)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest request, prompt + output (default: the model's context, or the longest one "
                   "request can hold in the arena)")
    p.add_argument("--page-size", "--block-size", type=int, default=16)
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--memory-mode", default="unified", choices=("unified", "static"),
                   help="unified: one arena whose bands grow into each other (default) | static: fixed pools")
    p.add_argument("--enable-unified-memory", dest="memory_mode", action="store_const", const="unified",
                   help="SGLang's flag: --memory-mode unified (already the default)")
    p.add_argument("--swa-full-tokens-ratio", type=float, default=0.8)
    p.add_argument("--mamba-full-memory-ratio", type=float, default=0.9)
    p.add_argument("--dtype", default=None, help="weights and activations: auto (the checkpoint's), float32, "
                   "bfloat16 or float16 (vLLM's aliases too: float, half, bf16, fp16, fp32)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "float32", "fp8", "fp8_e4m3"),
                   help="K/V storage: auto (the weights' dtype), or fp8 (e4m3, half the bytes; k/v scales from the "
                        "checkpoint, else 1.0)")
    p.add_argument("--mamba-ssm-dtype", "--mamba-ssm-cache-dtype", default="auto", choices=MAMBA_SSM_DTYPES,
                   help="recurrent state: auto (the checkpoint config's, else float32) or bfloat16 / float16 (half "
                   "the state bytes)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (--load-format dummy, tiny) "
                   "and of sampling for requests that give none (default 0)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share cached prompt prefixes between requests (default: on)")
    p.add_argument("--disable-radix-cache", "--disable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", help="SGLang's spelling of --no-enable-prefix-caching")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted so vLLM / SGLang commands run unchanged; changes nothing: umem_jax runs no code "
                   "from a checkpoint (its architectures are built in; others are refused at startup)")
    p.add_argument("--early-admission", action=argparse.BooleanOptionalAction, default=True,
                   help="a long prompt may start its prefill in the bytes no running request is owed before its "
                   "whole need fits (on by default: live share 0.98-0.99 where memory binds, throughput within "
                   "the H100's run-to-run noise; --no-early-admission: it waits in the queue; docs/memory.md)")
    p.add_argument("--enforce-eager", "--disable-cuda-graph", action="store_true",
                   help="no CUDA graphs: sets XLA_FLAGS=%s before the GPU starts (vLLM's --enforce-eager, "
                   "SGLang's --disable-cuda-graph; slower at small batches)" % NO_CUDA_GRAPHS)
    p.add_argument("--max-checkpoints-per-path", type=int, default=4,
                   help="recurrent-state checkpoints the prefix cache keeps on one cached path")
    p.add_argument("--tensor-parallel-size", "-tp", "--tp", "--tp-size", type=int, default=1,
                   help="devices the model and the arena are split over (heads; arena budget per device)")
    p.add_argument("--enable-expert-parallel", "-ep", action="store_true", help="MoE: whole experts per TP device")
    p.add_argument("--dist-init-addr", default=None, help="multi-host: process 0's HOST:PORT (jax.distributed)")
    p.add_argument("--nnodes", type=int, default=None, help="multi-host: number of hosts (processes)")
    p.add_argument("--node-rank", type=int, default=None, help="multi-host: this host's rank, 0 .. nnodes-1")
    p.add_argument("--priority-range", type=int, nargs=2, metavar=("MIN", "MAX"), default=[-(2**31), 2**31 - 1],
                   help="priorities a request may ask for (lower is served first; MIN <= 0 <= MAX, 0 is the "
                   "default); others get 400")
    from .speculative_flags import add_flags

    add_flags(p)


__all__ = ["add_engine_flags", "int_from"]
