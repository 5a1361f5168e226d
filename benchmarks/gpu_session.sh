#!/usr/bin/env bash
# One device call per argument group: each step runs under its own timeout, logs to $OUT/<step>.log,
# and a failing step does not stop the next.  The last lines printed are each step's rc and tail.
#   bash benchmarks/gpu_session.sh spec spec_profile      (the steps below; RESULTS.md's GPU list says which next)
set -u
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
declare -A TIMEOUT=([spec]=400 [spec_profile]=240 [spec_profile_scan]=240 [spec_profile_before]=240 [short_extend]=120 [qwen_b1]=300 [breakdown_b1]=260
                    [prefill1]=500 [prefill2]=250 [serve_gptoss]=280 [serve_nemo]=280 [moe_models]=370
                    [decode_default]=560 [state]=200 [serve_early]=560 [mgpu_fp8]=420
                    [mgpu_prefill_fp8]=420 [graphs_b1]=400 [trace_b1]=300 [triton_gemm_b1]=560
                    [route_b1]=420 [gemv_chain]=480 [h200_moe]=560 [b64_moe]=150 [shared_b1]=420 [prologue_b1]=300
                    [b64_shared]=260 [issue_b1]=420 [engine_b1]=400 [gemv_gpu]=120 [serve_fp8]=560 [hlo_qwen64]=300
                    [plan_b64]=420 [router_b64]=300 [cublas_b64]=300 [prefill_default]=560 [q_load]=560
                    [mgpu_consumers]=420 [mgpu_transposed]=420 [probe_transposed]=150 [fp8_defaults]=360 [profile_decode]=300 [mgpu_tiling]=420 [serve_early2]=560 [serve_release]=560 [serve_util]=560)
# T_<step>=seconds overrides a step's timeout, to fit several steps into one call's limit.
for k in "${!TIMEOUT[@]}"; do v="T_$k"; [ -n "${!v:-}" ] && TIMEOUT[$k]=${!v}; done
step() {
  case "$1" in
    spec) python3 -m benchmarks.bench_speculative --out "$OUT" --dtype float32 --batches 1 --prompt 512 \
            --gen 256 --budget-s ${SPEC_BUDGET_S:-300} ;;
    spec_profile) python3 -m benchmarks.bench_speculative --out "$OUT/profile" --dtype float32 --batches 1 \
            --prompt 512 --gen 64 --methods draft --acceptance 0.8 --extra-ks "" --profile-verify 1 ;;
    spec_profile_scan) UMEM_JAX_SHORT_SCAN=8 python3 -m benchmarks.bench_speculative --out "$OUT/profile_scan" \
            --dtype float32 --batches 1 --prompt 512 --gen 64 --methods draft --acceptance 0.8 --extra-ks "" \
            --profile-verify 1 ;;
    short_extend) python3 -m pytest -q -m gpu tests/gpu/test_short_extend_gpu.py ;;
    spec_profile_before) UMEM_JAX_SHORT_EXTEND=prefill python3 -m benchmarks.bench_speculative \
            --out "$OUT/profile_before" --dtype float32 --batches 1 --prompt 512 --gen 64 --methods draft \
            --acceptance 0.8 --extra-ks "" --profile-verify 1 ;;
    qwen_b1) python3 -m benchmarks.bench_moe --only decode --json "$OUT/bench_moe.json" &&
            XLA_PYTHON_CLIENT_MEM_FRACTION=0.93 python3 -m benchmarks.bench_models --families qwen35moe --ctx 2048 --decode-batches 1 --arena-gib 6 \
            --budget 120 ;;
    breakdown_b1) python3 -m benchmarks.bench_models --breakdown --batch 1 \
            --variants full,no_head,no_gdn,no_attn,no_kernels --budget 200 ;;
    prefill1) python3 -m pytest -q -m gpu tests/gpu/test_prefill_gpu.py \
            -k "gpu_kernel_matches_reference or over_4gib or cudnn" ;;
    prefill2) python3 -m pytest -q -m gpu tests/gpu/test_prefill_gpu.py tests/gpu/test_decode_mgpu_gpu.py \
            -k "mgpu or model_prefill or engine" ;;
    serve_gptoss|serve_nemo)
      m=gpt-oss-20b-like; [ "$1" = serve_nemo ] && m=nemotron-3-nano-30b-a3b-like
      python3 -m benchmarks.bench_serving --models "$m" --workloads shifting --short 512,256 \
            --buckets 1,4,64:512,2048:2048 --budget-after-build --no-progress --time-budget-s 220 \
            --max-run-s 30 --out "$OUT/serving_$m" ;;
    moe_models)  # needs an H200 (run's needs_h200): 64.6 GiB of Qwen3.5-MoE weights + a 24 GiB arena
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python3 -m benchmarks.bench_models --families gptoss,qwen35moe,nemo3nano --ctx 2048 \
            --decode-batches 64,1 --arena-gib 24 --budget 300 ;;
    prefill_default)  # issue 17 item 4: the Mosaic GPU prefill (auto) against Triton on the shifting trace at 4B
      # scale, the same greedy tokens?  Beside the null (Triton with half its K/V block: only the order of the sums
      # differs), in one process a model; first-token logprobs and a warm prefill pass per run (bench_engine
      # --parity --prefill; PARITY_BACKEND=triton: the null alone).  PARITY_BUCKETS: other step shapes (B:T:P)
      for m in ${PARITY_MODELS:-qwen3.5-4b-like gemma3-4b-like}; do
        python3 -m benchmarks.bench_engine --parity --prefill ${PARITY_BACKEND:-auto} --null --models $m --margin-max-len ${PARITY_MARGIN:-0} \
            ${PARITY_REQUESTS:+--requests $PARITY_REQUESTS} ${PARITY_BUCKETS:+--buckets $PARITY_BUCKETS} ${PARITY_NO_WARM:+--no-warm} ${PARITY_AGAINST:+--against $PARITY_AGAINST} --json "$OUT/prefill_parity_$m.json"; done ;;
    decode_default) for d in triton auto; do UMEM_JAX_DECODE=$d python3 -m benchmarks.bench_models \
            --families qwen35,gemma3,gptoss --ctx 2048 --decode-batches 64,1 --arena-gib 8 --budget 140; done ;;
    state) python3 -m benchmarks.bench_state ;;
    mgpu_fp8) python3 -m pytest -q -m gpu tests/gpu/test_decode_mgpu_gpu.py -k fp8 &&
            python3 -m benchmarks.bench_decode_mgpu --only fp8 --budget 200 ;;
    fp8_defaults)  # session 27's fp8 defaults on Hopper through their entry points: the Mosaic prefill under auto
      # (128-token blocks, one dequantised tile at D = 128) and the Mosaic decode's two consumers
      python3 -m pytest -q -m gpu tests/gpu/test_prefill_gpu.py tests/gpu/test_decode_mgpu_gpu.py -k "entry_point or fp8" ;;
    mgpu_tiling)  # issue 17 item 4: the bf16 Mosaic decode's ring depth at D = 128 (128-token blocks in 2 slots
      # were 0.966-0.970x cuDNN in sessions 11 and 27, the default's 3 slots 0.943-0.945x), every tiling of the
      # main, G = 6 and long shapes timed in interleaved rounds beside Triton and cuDNN
      python3 -m benchmarks.bench_decode_mgpu --only ${TILING_SHAPES:-main,gqa6,long} --configs 128x2,128x3,64x4 \
            --rounds ${TILING_ROUNDS:-3} --budget ${MGPU_BUDGET:-300} ;;
    mgpu_consumers)  # the Mosaic decode with two and three consumer warpgroups (fp8: more warps converting at
      # once): their GPU tests, then the fp8, D = 80 and main shapes with the sweep (all variants, interleaved rounds)
      python3 -m pytest -q -m gpu tests/gpu/test_decode_mgpu_gpu.py -k consumers &&
            python3 -m benchmarks.bench_decode_mgpu --only ${CONSUMER_SHAPES:-fp8,gqa6_d80,main} \
                --rounds ${CONSUMER_ROUNDS:-3} --budget ${MGPU_BUDGET:-240} ;;
    mgpu_transposed)  # the fp8 Mosaic decode with transposed scores (S^T = K Q^T, K converted into registers):
      # its GPU tests, then the fp8 shape's tilings beside the untransposed ones, Triton and bf16 (interleaved rounds)
      python3 -m pytest -q -m gpu tests/gpu/test_decode_mgpu_gpu.py -k "transposed or long_context" &&
            python3 -m benchmarks.bench_decode_mgpu --only ${TRANSPOSED_SHAPES:-fp8} --configs ${TRANSPOSED_CONFIGS:-128x2,128x4,64x4} \
                --rounds ${TRANSPOSED_ROUNDS:-3} --budget ${MGPU_BUDGET:-240} ;;
    probe_transposed)  # each consumer's partials of the transposed fp8 decode against numpy's (benchmarks/probe_transposed)
      python3 -m benchmarks.probe_transposed ;;
    profile_decode)  # Nsight Compute on the decode kernels where the Mosaic one trails Triton (fp8, D = 80): stall
      # reasons, memory units' throughput against their peaks (benchmarks/profile_decode.py)
      # (one process per shape and kernel: ncu prints at exit, so a crash would lose every report of its process)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      for shp in ${PROFILE_SHAPES:-fp8 gqa6_d80}; do for v in ${PROFILE_VARIANTS:-triton mgpu mgpu_cols}; do
        # These three sections ran in session 28; the full list (SourceCounters, --import-source no, bank-conflict
        # metrics) crashed the target process at start-up in two of its three calls there.
        XLA_PYTHON_CLIENT_PREALLOCATE=false "$NCU" --clock-control none --profile-from-start off \
            --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
            python3 -m benchmarks.profile_decode --only "$shp" --variants "$v"; done; done ;;
    mgpu_prefill_fp8) python3 -m pytest -q -m gpu tests/gpu/test_prefill_gpu.py -k fp8 &&
            python3 -m benchmarks.bench_prefill --fp8 ;;
    serve_early) for e in "" --no-early; do python3 -m benchmarks.bench_serving --models qwen3.5-4b-like,gemma3-4b-like \
            --workloads kv-heavy,mixed,shifting --static-ratios 0.5:0.5 --budget-after-build --no-progress \
            --buckets ${SERVE_BUCKETS:-1,4,64:512,2048:2048} --time-budget-s 250 --max-run-s 40 \
            --out "$OUT/serving_early$e" $e; done ;;  # six step shapes, as serve_fp8
    serve_early2)  # issue 17 item 3 after session 32 (the early start evicts the cache for its longest pass, and its
      # passes are token buckets' lengths): without and with it, alternating, ROUNDS times, the unified arena alone
      for i in $(seq ${ROUNDS:-2}); do for e in --no-early ""; do echo "== $i ${e:---early}"
        python3 -m benchmarks.bench_serving --models ${SERVE_MODELS:-qwen3.5-4b-like} \
            --workloads ${SERVE_WORKLOADS:-shifting,mixed,kv-heavy} --static-ratios none --budget-after-build \
            --no-progress --buckets ${SERVE_BUCKETS:-1,4,64:512,2048:2048} --time-budget-s 250 --max-run-s 40 \
            --out "$OUT/early_$i${e:-_on}" $e > "$OUT/early_$i${e:-_on}.log" 2>&1
        grep -E "^(shifting|mixed|kv-heavy|state-heavy) +unified|warm-up:" "$OUT/early_$i${e:-_on}.log"
      done; done ;;
    serve_release)  # issue 17 item 3 after session 33: a request the step in flight ends by length gives its memory
      # to the next step (Scheduler.release_ending); the tree before (.base, carried) against this one, alternating
      for i in $(seq ${ROUNDS:-1}); do for v in base new; do echo "== $i $v"
        (if [ "$v" = base ]; then cd .base; fi; python3 -m benchmarks.bench_serving --models ${SERVE_MODELS:-gemma3-4b-like} \
            --workloads ${SERVE_WORKLOADS:-mixed,shifting,state-heavy} --static-ratios none --budget-after-build \
            --no-progress --buckets ${SERVE_BUCKETS:-1,4,64:512,2048:2048} --time-budget-s 250 --max-run-s 40 \
            --out "$OUT/release_$i$v") > "$OUT/release_$i$v.log" 2>&1
        grep -E "^(shifting|mixed|kv-heavy|state-heavy) +unified|warm-up:" "$OUT/release_$i$v.log"
      done; done ;;
    serve_util)  # issue 17 item 3: the engine's defaults alone (early start on, release_ending), util mem per trace
      python3 -m benchmarks.bench_serving --models ${SERVE_MODELS:-qwen3.5-4b-like} \
          --workloads ${SERVE_WORKLOADS:-shifting,mixed,kv-heavy} --static-ratios none --budget-after-build \
          --no-progress --buckets ${SERVE_BUCKETS:-1,4,64:512,2048:2048} --time-budget-s 400 --max-run-s 40 \
          --out "$OUT/util" > "$OUT/util.log" 2>&1
      grep -E "^(shifting|mixed|kv-heavy|state-heavy) +unified|warm-up:" "$OUT/util.log" ;;
    graphs_b1)  # B = 1 is launch-bound: do CUDA graphs (XLA command buffers) cover the step, and would
                # while loops and conditionals in them (off by default in XLA) help?
      for x in "" "--xla_gpu_enable_command_buffer=" \
               "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_graph_min_graph_size=1"; do
        echo "== XLA_FLAGS='$x'"; XLA_FLAGS="$x" XLA_PYTHON_CLIENT_MEM_FRACTION=0.93 python3 -m benchmarks.bench_models --families qwen35moe,qwen35 \
            --ctx 2048 --decode-batches 1 --arena-gib 4 --no-check --budget 60; done ;;  # JAX takes 75% of the card by default: 59 GiB on an H100, below the 64.6 GiB of weights
    trace_b1)  # the B = 1 decode step kernel by kernel (engine_trace), bench_models' step and the engine's
      export XLA_PYTHON_CLIENT_MEM_FRACTION=0.93
      python3 -m benchmarks.bench_models --families qwen35moe --ctx 2048 --decode-batches 1 --arena-gib 4 \
            --no-check --budget 30 --trace 5 &&
      python3 -m benchmarks.bench_engine --models qwen3.5-35b-a3b-like --batch 1 --modes unified --gen 24 \
            --arena-gib 4 --replay 30 --trace 5 ;;
    triton_gemm_b1)  # XLA's Triton GEMMs at one row of input: on or off, alternating, three processes each
      export XLA_PYTHON_CLIENT_MEM_FRACTION=0.93
      for i in 1 2 3; do for x in "--xla_gpu_enable_triton_gemm=false" ""; do echo "== $i XLA_FLAGS='$x'"
        XLA_FLAGS="$x" python3 -m benchmarks.bench_models --families qwen35moe --ctx 2048 --decode-batches 1 \
            --arena-gib 4 --no-check --budget 60 --trace 3 | grep -v "skipped"; done; done ;;
    route_b1)  # the router's top-k kernel: its GPU tests, then the three MoE families at B = 1 with XLA's
      # routing and with the kernel, alternating, each its own process, twice, traced
      python3 -m pytest -q tests/kernels/test_route_topk.py
      export XLA_PYTHON_CLIENT_MEM_FRACTION=0.93
      for i in 1 2; do for r in xla pallas; do echo "== $i UMEM_JAX_ROUTE=$r"
        UMEM_JAX_ROUTE=$r python3 -m benchmarks.bench_models --families qwen35moe,gptoss,nemo3nano --ctx 2048 \
            --decode-batches 1 --kinds decode --arena-gib 4 --no-check --budget 150 --trace 3 \
            | grep -v "skipped" | grep -v "^    0.0"; done; done ;;
    h200_moe)  # needs an H200: the three MoE families at B = 64 and 1, decode only, traced (Qwen3.5-MoE's
      # arena does not fit an H100 beside its 64.6 GiB of weights at B = 64)
      python3 -m pytest -q tests/kernels/test_route_topk.py tests/kernels/test_expert_gemv.py -m "gpu or not gpu"
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python3 -m benchmarks.bench_models --families qwen35moe,gptoss,nemo3nano \
            --ctx 2048 --decode-batches 64,1 --kinds decode --arena-gib 24 --budget 300 --trace 3 ;;
    norm_b1)  # the RMSNorm kernels: their GPU tests (and route_topk's), then the three MoE families at B = 1
      # with XLA's norms and with the kernels, alternating, each its own process, twice; the kernels' runs traced
      python3 -m pytest -q tests/kernels/test_rms_norm.py tests/kernels/test_route_topk.py
      export XLA_PYTHON_CLIENT_MEM_FRACTION=0.93
      for i in 1 2; do for n in xla pallas; do echo "== $i UMEM_JAX_NORM=$n"
        tr=0; [ "$n" = pallas ] && [ "$i" = 2 ] && tr=3
        UMEM_JAX_NORM=$n python3 -m benchmarks.bench_models --families qwen35moe,gptoss,nemo3nano --ctx 2048 \
            --decode-batches 1 --kinds decode --arena-gib 4 --no-check --budget 150 --trace $tr \
            | grep -v "skipped" | grep -v "^    0.0"; done; done ;;
    grouped_b64)  # the grouped matmul's tiles at a B = 64 decode's rows, uniform and skewed routing
      python3 -m benchmarks.bench_moe --only grouped --grouped-tokens 64 ;;
    inplace)  # the recurrent decode kernels reading their inputs in place (recurrent.Cols), compiled
      python3 -m pytest -q tests/kernels/test_gated_deltanet.py tests/kernels/test_mamba2.py -k in_place ;;
    b64_moe)  # B = 64 decode of the two MoE families whose arena fits an H100 beside their weights
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.93 python3 -m benchmarks.bench_models --families gptoss,nemo3nano \
            --ctx 2048 --decode-batches 64 --kinds decode --arena-gib 6 --no-check --budget 150 --trace 3 ;;
    shared_b1)  # the MoE decode changes of session 21 (shared expert joined to the expert GEMV, the activation
      # in the down GEMV's prologue, padding masked by the router): the kernels' GPU tests, then Qwen3.5-MoE and
      # Nemotron at B = 1, session 20's tree (.base: `git archive 2bf3b83`, carried) against this one, alternating,
      # each its own process, ROUNDS times (2); this tree's first run checked against the dense forward, its last traced
      python3 -m pytest -q tests/kernels/test_route_topk.py tests/kernels/test_expert_gemv.py -m gpu -k "gpu or matches"
      python3 -m pytest -q tests/kernels/test_route_topk.py
      export XLA_PYTHON_CLIENT_MEM_FRACTION=0.93
      for i in $(seq "${ROUNDS:-2}"); do for v in base new; do echo "== $i $v"
        tr=0; [ "$v" = new ] && [ "$i" = "${ROUNDS:-2}" ] && tr=3
        ck=--no-check; [ "$v" = new ] && [ "$i" = 1 ] && ck=
        (if [ "$v" = base ]; then cd .base; fi; python3 -m benchmarks.bench_models --families qwen35moe,nemo3nano \
            --ctx 2048 --decode-batches 1 --kinds decode --arena-gib 4 --budget 120 --trace $tr $ck) \
            | grep -v "skipped" | grep -v "^    0.0"; done; done ;;
    q_load)  # session 25: the Triton decode loads q's G rows itself (no XLA pad of q before each attention layer),
      # and route_topk adds the router's bias (no XLA add after gpt-oss's router matmul): their GPU tests, then
      # gpt-oss and Gemma 3 at B = 1 and 64 against the tree before (.base: `git archive 586d941`, carried),
      # alternating, each its own process, ROUNDS times (1); the first run checked against dense
      python3 -m pytest -q -m gpu tests/gpu/test_kernels_gpu.py -k "decode" -x
      python3 -m pytest -q tests/kernels/test_route_topk.py -x
      for i in $(seq "${ROUNDS:-1}"); do for v in base new; do echo "== $i $v"
        ck=--no-check; [ "$v" = new ] && [ "$i" = 1 ] && ck=
        (if [ "$v" = base ]; then cd .base; fi; python3 -m benchmarks.bench_models --families gptoss,gemma3 \
            --ctx 2048 --decode-batches 64,1 --kinds decode --arena-gib 8 --budget 120 $ck) \
            | grep -v "skipped" | grep -v "^    0.0"; done; done ;;
    prologue_b1)  # the expert activation in the down GEMV's prologue or an XLA op before it, against session 20's tree
      export XLA_PYTHON_CLIENT_MEM_FRACTION=0.93
      for v in base 0 1; do echo "== $v"
        (if [ "$v" = base ]; then cd .base; fi; UMEM_JAX_EXPERT_PROLOGUE=$v python3 -m benchmarks.bench_models \
            --families qwen35moe,nemo3nano --ctx 2048 --decode-batches 1 --kinds decode --arena-gib 4 --budget 100 \
            --no-check --trace $([ "$v" = 0 ] && echo 3 || echo 0)) | grep -v "skipped" | grep -v "^    0.0"; done ;;
    b64_shared)  # Nemotron at B = 64 with its shared expert apart and joined (the one-contraction dense form), alternating,
      # each its own process, twice
      export XLA_PYTHON_CLIENT_MEM_FRACTION=0.93
      for i in 1 2; do for s in apart join; do echo "== $i $s"
        UMEM_JAX_SHARED_EXPERT=$s python3 -m benchmarks.bench_models --families nemo3nano --ctx 2048 \
            --decode-batches 64 --kinds decode --arena-gib 6 --no-check --budget 60 | grep -A4 "^== bench_models"
      done; done ;;
    issue_b1)  # the host's time to issue a B = 1 step (bench_issue's calling patterns), then XLA's command-buffer
      # updates counted from its log for the engine's two patterns
      export XLA_PYTHON_CLIENT_MEM_FRACTION=0.93
      python3 -m benchmarks.bench_issue --families gptoss,qwen35moe --arena-gib 2
      TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0 python3 -m benchmarks.bench_issue --families gptoss \
            --modes fresh,io --iters 4 --trials 2 2>&1 | grep -E "Update command buffer|issue " \
            | sed -E 's/.*(Update command buffer).*(updated_allocs=[0-9]+).*/\1 \2/' | uniq -c ;;
    engine_b1)  # the engine's B = 1 ITL, an earlier tree (.base, carried) against this one,
      # alternating, each its own process, ROUNDS times (2); the last run of this tree counts XLA's command-buffer updates
      export XLA_PYTHON_CLIENT_MEM_FRACTION=0.93
      for i in $(seq "${ROUNDS:-2}"); do for v in base new; do echo "== $i $v"
        log=""; [ "$v" = new ] && [ "$i" = "${ROUNDS:-2}" ] && log="TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0"
        (if [ "$v" = base ]; then cd .base; fi; env $log python3 -m benchmarks.bench_engine \
            --models ${ENGINE_MODELS:-gpt-oss-20b-like} --batch 1 --modes unified --prompt 256 --gen 32 --arena-gib 4 \
            --replay 30 2>&1) | grep -E "^(model|gpt|qwen|nemo)|Update command buffer" \
            | sed -E 's/.*(Update command buffer).*(updated_allocs=[0-9]+).*/\1 \2/' | uniq -c
      done; done ;;
    gemv_gpu) python3 -m pytest -q tests/kernels/test_expert_gemv.py -m gpu ;;  # the compiled expert GEMV
    serve_fp8)  # issue 17 item 2: the shifting trace and the KV-heavy mix with bf16 and fp8 K/V in the same arena bytes
      for kv in auto fp8; do python3 -m benchmarks.bench_serving --models ${SERVE_MODELS:-gemma3-4b-like} \
            --workloads shifting,kv-heavy --static-ratios 0.8:0.9 --kv-cache-dtype $kv --budget-after-build \
            --buckets ${SERVE_BUCKETS:-1,4,64:512,2048:2048} --no-progress --time-budget-s 250 --max-run-s 40 \
            --out "$OUT/serving_kv_$kv"; done ;;  # six step shapes: the coarse set's 36 took 250 s to compile
    hlo_qwen64)  # which model op Qwen3.5-MoE's B = 64 concatenate fusion (2M elements a MoE layer) comes from:
      # the step's optimized HLO dumped (not kept: it is large), its concatenates counted by shape and JAX op
      rm -rf /tmp/hlo64; XLA_FLAGS="--xla_dump_to=/tmp/hlo64 --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*step.*" \
        XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python3 -m benchmarks.bench_models --families qwen35moe --ctx 2048 \
            --decode-batches 64 --kinds decode --arena-gib 24 --no-check --budget 100 | tail -3
      grep -h " concatenate(" /tmp/hlo64/*jit_step*after_optimizations.txt \
        | sed -E 's/.*= ([a-z0-9]+\[[0-9,]+\]).* concatenate\(.*op_name="([^"]*)".*/\1 \2/' | sort | uniq -c | sort -rn | head -20 ;;
    plan_b64)  # the MoE dispatch plan (one launch ordering a decode batch's rows) against the argsort path:
      # its GPU tests, then B = 64 with each, alternating, each its own process (the plan's first run checked
      # against the dense forward, its second traced)
      python3 -m pytest -q -m gpu tests/kernels/test_dispatch_plan.py
      export XLA_PYTHON_CLIENT_MEM_FRACTION=0.93
      for i in 1 2; do for p in xla pallas; do echo "== $i UMEM_JAX_MOE_PLAN=$p"
        tr=0; [ "$p" = pallas ] && [ "$i" = 2 ] && tr=3
        ck=--no-check; [ "$p" = pallas ] && [ "$i" = 1 ] && ck=  # the arena-vs-dense check: its prefill takes the plan too
        UMEM_JAX_MOE_PLAN=$p python3 -m benchmarks.bench_models --families ${PLAN_FAMILIES:-gptoss,nemo3nano} \
            --ctx 2048 --decode-batches 64 --kinds decode --arena-gib ${PLAN_ARENA_GIB:-6} $ck --budget 100 \
            --trace $tr | grep -v "skipped" | grep -v "^    0.0"; done; done ;;
    router_b64)  # B = 64 with the router's logits as a GEMM or one reduction: both variants in one process per
      # family (the same weights, arena and routing; bench_models --variants), alternating, twice.  (epilogue_b64,
      # the experts' activation in the grouped matmul's epilogue, ran in session 24 and the option was removed.)
      v="UMEM_JAX_ROUTER_DOT=dot;UMEM_JAX_ROUTER_DOT=reduce"
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.93 python3 -m benchmarks.bench_models --families ${AB_FAMILIES:-gptoss,nemo3nano} \
          --ctx 2048 --decode-batches ${AB_BATCHES:-64} --kinds decode --arena-gib ${AB_ARENA_GIB:-6} --no-check \
          --budget 240 --variants "$v" --rounds ${AB_ROUNDS:-2} | grep -E "decode +B=|copy" ;;
    cublas_b64)  # XLA's Triton GEMMs on and off (a flag read when XLA starts: one process each), alternating, twice
      export XLA_PYTHON_CLIENT_MEM_FRACTION=0.93
      for i in $(seq ${AB_ROUNDS:-2}); do for t in true false; do echo "== $i --xla_gpu_enable_triton_gemm=$t"
        XLA_FLAGS=--xla_gpu_enable_triton_gemm=$t python3 -m benchmarks.bench_models \
            --families ${AB_FAMILIES:-gptoss,nemo3nano} --ctx 2048 --decode-batches ${AB_BATCHES:-64} --kinds decode \
            --arena-gib ${AB_ARENA_GIB:-6} --no-check --budget 100 | grep -E "decode +B=|copy"; done; done ;;
    gemv_chain) python3 -m benchmarks.bench_moe --only chain ;;  # expert GEMV tunings as a step runs them
    *) echo "unknown step $1"; return 2 ;;
  esac
}
declare -A RC
for s in "$@"; do
  echo "== $s ($(date -u +%T))"
  timeout "${TIMEOUT[$s]:-300}" bash -c "$(declare -f step); OUT='$OUT'; step $s" > "$OUT/$s.log" 2>&1
  RC[$s]=$?
done
for s in "$@"; do echo "==== $s rc=${RC[$s]}"; tail -n 30 "$OUT/$s.log"; done
