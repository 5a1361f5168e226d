"""Benchmarks of umem_jax, one script per subject, run as modules from the repository root:

    python3 -m benchmarks.bench_kernels     paged decode, relocation, KV write against their baselines
    python3 -m benchmarks.bench_prefill     paged prefill (Triton, Mosaic GPU) against cuDNN
    python3 -m benchmarks.bench_state       Mamba2 / gated-DeltaNet state updates against the copy rate
    python3 -m benchmarks.bench_arena       a 64 GiB arena against a 1 GiB one
    python3 -m benchmarks.bench_models      whole-model steps against a bytes roofline (--breakdown, --memory-probe)
    python3 -m benchmarks.bench_engine      engine decode: ITL, host share (--host, --parity)
    python3 -m benchmarks.bench_serving     serving under load: unified arena against the static split
    python3 -m benchmarks.simulate_admission  the same traces through the scheduler alone, on the host
    python3 -m benchmarks.bench_allocator   the host allocator's cost per decode step
    python3 -m benchmarks.bench_tp          tensor-parallel decode: TP=1 against TP=N
    python3 -m benchmarks.bench_moe         MoE dispatch paths (grouped GEMM, gather, few-rows kernel) against dense
    python3 -m benchmarks.bench_fp8_kv      fp8 against bf16 K/V decode
    python3 -m benchmarks.copy_limit        the device's copy limit, five ways (every roofline divides by it)
    python3 -m benchmarks.bench_speculative speculative decoding: verify vs decode, draft cost, a harness at set acceptance
    python3 -m benchmarks.bench_disagg      prefill/decode disaggregation through the router against one engine

Shared pieces: timing.py (device timing, copy rate), report.py (JSON rows, tables), modes.py (a
flag that hands over to another module), families.py (the realistic model shapes) and
model_steps.py (pages, batches and bytes of one model step).  The other modules are parts of one
subject: decode_peers (kernels), prefill_cases and prefill_mgpu (prefill), model_check,
model_breakdown and step_memory (models), engine_host, engine_parity and engine_trace (engine),
spec_harness (speculative), disagg_serve (disaggregation).
Figures and the commands that made them: RESULTS.md.
"""
