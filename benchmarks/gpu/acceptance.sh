#!/usr/bin/env bash
# GPU host, after tools/gpu_host/install.sh: relay's tests and benchmarks on vLLM 0.33 with Model Runner V2,
# output under $OUT (default /tmp/out): STEP.txt, gpu.txt, and each benchmark's JSON and markdown.
# Usage: bash benchmarks/gpu/acceptance.sh [--side-by-side] STEP...   with STEP one of
#   install   this checkout into /tmp/site (pip, offline, no dependencies: vLLM is there)
#   unit      the GPU unit tests: kernels, planner, graph manager (about 1 min)
#   mha gqa   relay against FLASH_ATTN (and TRITON_ATTN as the yardstick), full CUDA graphs and eager, one GPU
#             (tests/e2e/test_gpu_relay.py; four engines: about 4-5 min each with cold compile caches)
#   unsplit   the unsplit twins replayed on every step with levels (three models: about 12 min); unsplit-mha,
#             unsplit-gqa, unsplit-sinks (the levels' own call: no joint call with sinks): one model each
#   levels    levels found in the block tables, up to three deep, graphs and eager (about 4 min)
#   sleep     sleep at levels 1 and 2, the prompts filled again after waking (about 6 min); sleep-1, sleep-2
#   seeded    seeded samples against vLLM's, requests all at once and one per step (about 4 min)
#   features  soft-capping, sinks, an FP8 KV cache, sliding windows, sinks with windows (gpt-oss's attention),
#             M-RoPE, full graphs of every batch and images in shared prompts against FLASH_ATTN with each on (four engines each, about 4-6
#             min each); features-softcap, -sinks, -fp8, -window, -gptoss, -mrope, -fullgraphs, -images: one each;
#             features-mla: an MLA model (tiny-deepseek-v2) on relay's MLA backend against FLASH_ATTN_MLA
#   ngram     n-gram speculative decoding against FLASH_ATTN with the same drafter (four engines; 8.6 min on
#             an H100 with cold compile caches: with the bundle's install it does not fit one call, so start
#             it detached, `(setsid nohup env OUT=/tmp/o bash $A ngram > /tmp/ngram.log 2>&1 &)`, and
#             wait for "ngram: exit" in that log, into the next call if need be)
#   drafters  EAGLE-3 drafts of one and three tokens a step, and MiMo's MTP drafts, against FLASH_ATTN with
#             the same drafter: outputs and drafts (fifteen engines, about 15-18 min; eagle3-1, eagle3-3,
#             mtp-1: one each)
#   l3-eagle3 the l3 workload with an EAGLE-3 head of Llama-3-8B's shape (dummy weights: its drafts are
#             mostly rejected, so this is the cost of drafting, not its gain), K draft tokens (default 3),
#             vLLM's default and relay (CONFIGS; about 6 min); l3-mtp: the same with MiMo-7B's shape and
#             its MTP layer (one draft token)
#   host      the host-side timings of tools/ (prompt hashing, prefix-cache lookup of n samples, detokenizer
#             priming, n samples' transport to the engine core, Model Runner V2's staging of new requests' ids):
#             vLLM's code against relay's, CPU only (about 1-2 min)
#   l3 l2     the P=2048 throughput jobs: Llama-3-8B shape default / relay / no prompt (about 7 min), Llama-2-7B
#             shape relay / no prompt (about 5 min); run each three times, in three calls, for a median of jobs;
#             l3 takes CONFIGS, and ENGINE_ARGS (JSON) turns a feature on for every side, e.g.
#             ENGINE_ARGS='{"kv_cache_dtype": "fp8"}' CONFIGS=default,relay (about 5 min); SHAPE another model
#             of vllm_relay.testing: SHAPE=gemma-3-12b-shape (sliding windows), SHAPE=gpt-oss-20b-attention-shape
#             (sinks, a 128-token window in every other layer, a dense MLP in place of the MoE), SHAPE=qwen2.5-vl-7b-shape with
#             ENGINE_ARGS='{"limit_mm_per_prompt": {"image": 0, "video": 0}}' (M-RoPE); N other than 1000
#             requests, PROFILE=DELAY,STEPS vLLM's torch profiler over the first run's steps (N=64
#             PROFILE=40,3: decode steps of 64 requests, each engine's kernel table and timeline)
#   latency   decode steps of B requests behind a 2048-token system prompt (B = 1, 8, 64, 256), Llama-3-8B shape:
#             vLLM's default and relay on their engines, after 200 requests of the throughput workload (about 6 min);
#             CONFIGS, BATCHES (1,8,64,256) and ENGINE_ARGS as for l3 (n-gram drafts: verification steps)
#   serve     chat through the OpenAI server (two system prompts, 20% without), Poisson 1, 4 and 8 requests/s for
#             20 s each, TTFT and TPOT: vLLM's default server and relay's, Llama-3-8B shape (about 7 min);
#             RESTARTS=R starts both servers again in each of R rounds, the order reversed each round (a
#             host-bound TTFT moves with each process's host speed), DURATION the seconds a rate
#             (RESTARTS=2 DURATION=12: about 9 min); SERVER_ARGS adds vLLM server arguments to every vLLM side;
#             SERVE_CONFIGS the servers (default,relay; relay-full and default-full: full CUDA graphs for
#             every batch, prompt chunks too)
#   plain     traffic sharing nothing: the relay backend with nothing registered against vLLM's default, warm
#             engines side by side on one GPU (0.45 of it each), the median of 5 interleaved rounds of 1000
#             requests without a system prompt (bench_interleaved.py; two engine starts of about 1-2 min each,
#             then 5 x 2 rounds of about 15-25 s: about 5-8 min), alone in its call:
#             OUT=/tmp/out bash benchmarks/gpu/acceptance.sh plain   (plain.txt, plain_interleaved_*.json);
#             SHAPE and ENGINE_ARGS as for l3 (a feature's plain traffic); ROUNDS: other than 5 rounds
#   samples-ab  n samples of one cold prompt (PS, default 4096; NS, default 64; 128 tokens each), vLLM's default
#             and relay (CONFIGS) on warm engines side by side, the median of ROUNDS (default 5) interleaved
#             rounds, a new prompt each round (bench_interleaved.py --workload samples): the samples job is
#             under a second, and one engine's runs alone differ by a quarter; SHAPE and ENGINE_ARGS as for
#             l3 (gpt-oss: SHAPE=gpt-oss-20b-attention-shape; about 4 min)
#   l2-8192   Llama-2-7B shape, P=8192: relay / no prompt (CONFIGS, REPEAT; about 6 min a run of each)
#   multi     four system prompts of 0.5K-4K tokens and 20% plain requests, Llama-3-8B shape: vLLM's default
#             and relay (CONFIGS; about 6 min)
#   samples   Hydragen's sweep, Llama-2-7B shape: n = $NS completions (default 64,256,1024) of one prompt of
#             P = $PS tokens (default 1024,4096,16000), 128 tokens each, and each one's first token: the ceiling,
#             relay and vLLM's default (CONFIGS, REPEAT; bench_sharing.py; vLLM's default takes minutes a point
#             at P=16000: PS and NS one or two values a call); SHAPE and ENGINE_ARGS as for l3 (a feature's
#             n=64 samples of a 4K prompt: PS=4096 NS=64); PROFILE=DELAY,STEPS: vLLM's torch profiler over
#             STEPS engine steps of the first point (bench_sharing.py --profile)
#   tree      a 2048-token system prompt over 8 documents x 4 questions x 8 samples, Llama-2-7B shape: the
#             ceiling, relay, relay with the registered prompt only, vLLM's default (CONFIGS; about 6 min)
#   serve-plain  chat with no system prompt at all, as `serve`: vLLM's default and the relay backend with
#             nothing registered (about 6 min)
#   ops       one decode step's attention, relay's kernels against FlashAttention (bench_ops.py, QUICK=1 for
#             fewer shapes, DECODE=MODEL:B:S:c,... for these only, e.g. llama2-7b:256:16000:128; about 3-8
#             min); window-ops: a sliding-window layer's step over a shared prompt,
#             relay's window level against FlashAttention's window, and its tiles (bench_window.py; about 2-3 min); mla-ops:
#             does a shared latent level pay for MLA? FlashMLA's decode against a level read once (FlashMLA,
#             n query tokens) plus each request's own tokens, merged by LSE, and the same with FlashAttention-3's
#             MLA form (vLLM's FLASH_ATTN_MLA) through relay_attention, also as full graphs run both (FA3's
#             schedule, splits capped at 32; relay's context unsplit too), 16 / 64 / 128 query heads
#             (bench_mla.py, Hopper; about 3 min)
#   first-token  where the first token of n=256 samples of a 16000-token prompt goes (relay, then vLLM's
#             default; tools/profile_first_token.py, engine core in process, cProfile; then relay with its
#             engine core in its own process, as LLM runs it: what the transport adds; about 6 min)
#   first-token-chat  the same for chat requests one at a time: 128 fresh tokens behind a 2048-token system
#             prompt, Llama-3-8B shape, 30 requests each, alone (the serving step's 1 req/s) and while 8 such
#             requests decode (its 4-8 req/s); relay and vLLM's default (four engine starts, about 5-6 min)
#   first-token-ab  first-token-chat's requests alone, relay and vLLM's default in alternation over ROUNDS
#             (default 3) pairs of processes, the order reversed each round, no profile: a host-bound first
#             token moves with each process's host speed (recorded), so one process per side is no comparison
#             (about 2 min a process: ROUNDS=2 fits a call)
#   sglang    SGLang 0.5.23 (tools/gpu_host/sglang/install.sh done: /tmp/site-sglang/env.sh) against relay and
#             vLLM's default, the l3 workload: Llama-3-8B shape, P=2048, 1000 requests, SGLang's offline Engine
#             with its radix cache on the same token ids (about 7-9 min; SGLANG_CONFIGS=sglang,relay for less);
#             SHAPE=llama-2-7b-shape and P=8192 for the others, P=0 with
#             SGLANG_CONFIGS=sglang,noprefix-relay,default for traffic sharing nothing
#   sglang-tree  the tree of `tree` (a 2048-token system prompt over 8 documents x 4 questions x 8 samples,
#             Llama-2-7B shape): the ceiling, relay and SGLang (about 6 min)
#   sglang-samples  n samples of one prompt (P = $PS, default 16000; n = $NS, default 1,64,256; 128 tokens each),
#             Llama-2-7B shape: the ceiling, relay and SGLang, and each one's first token (bench_sharing.py;
#             about 5 min per P)
#   sglang-serve  chat through SGLang's OpenAI server, relay's and vLLM's default, as `serve` (about 9 min;
#             SGLANG_CONFIGS=sglang,relay: about 6); RESTARTS and DURATION as for serve
# PACK=1: after each step (after all of them with --side-by-side), every file under $OUT not yet packed goes
# into one archive, $OUT/pack_HHMMSS_STEP.tgz (a device call brings back a few files only, and a call cut by
# its time limit keeps the steps it finished), the steps' exit lines and last output lines still printed.
# A test step that fails leaves its engines' outputs in $OUT/STEP-outputs.tgz (KEEP_OUTPUTS=1: every test
# step). Steps run one after another, each well under a call's 600 s. With --side-by-side the test steps (not
# host and the throughput jobs, which need the machine alone) run at once, each engine on a share of the
# GPU with a fixed KV cache (RELAY_TEST_GPU_SHARE, tests/e2e/engine_runner.py): vLLM's memory profiling
# expects the GPU to itself and fails when other processes free memory meanwhile. Each step gets its own vLLM
# cache folder (/tmp/vllm-cache/STEP).
set -uo pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out" /tmp/pytest-relay  # (pytest makes each step's --basetemp, not its parent)
side=0
if [ "${1:-}" = "--side-by-side" ]; then side=1; shift; fi
bt="python3 benchmarks/bench_throughput.py --prefix-len 2048 --num-prompts 1000"
bs="python3 benchmarks/bench_sharing.py"
stamp=$(date +%H%M%S)
model() { python3 -m vllm_relay.testing build "$1" | tail -1 | cut -f2; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$out/gpu.txt" 2>&1
{ lscpu; nvidia-smi topo -m; } > "$out/host.txt" 2>&1

run() {  # one step into $out/STEP.txt; its exit status
  local step=$1 e2e="tests/e2e/test_gpu_relay.py"
  local t="python3 -m pytest -m gpu -p no:cacheprovider -s -x --basetemp=/tmp/pytest-relay/$step"
  case $step in
    install) rm -rf build  # (setuptools reuses build/lib's copy of a file older than it: a stale install)
        python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . ;;
    unit) $t tests/ops tests/attention tests/hooks ;;
    mha|gqa) $t $e2e -k "matches_flash and tp1 and $step" ;;
    unsplit) $t $e2e -k unsplit ;;
    unsplit-mha|unsplit-gqa|unsplit-sinks) $t $e2e -k "unsplit and ${step#unsplit-}" ;;
    levels) $t $e2e -k shared_levels ;;
    sleep) $t $e2e -k sleep ;;
    sleep-1|sleep-2) $t "$e2e::test_sleep_and_wake_up_refill_the_system_prompt[${step#sleep-}]" ;;
    seeded) $t tests/e2e/test_seeded.py ;;
    features) $t $e2e -k features ;;
    features-*) $t $e2e -k "features and ${step#features-}" ;;
    ngram) $t $e2e -k ngram ;;
    drafters) $t $e2e -k drafter_models ;;
    eagle3-*|mtp-*) $t "$e2e::test_drafter_models_on_cuda_against_flash[$step]" ;;
    host) python3 tools/bench_prompt_hashes.py --out "$out/prompt_hashes.json" &&
          python3 tools/bench_cache_hits.py --rounds 5 --out "$out/cache_hits.json" &&
          python3 tools/bench_detokenizer.py --out "$out/detokenizer.json" &&
          python3 tools/bench_request_transport.py --out "$out/request_transport.json" &&
          python3 tools/bench_staged_tokens.py --out "$out/staged_tokens.json" ;;
    first-token) m=$(model llama-2-7b-shape)
        for c in relay default; do
          python3 tools/profile_first_token.py --config $c --model "$m" --out "$out/first_token_$c.json" || return
        done
        python3 tools/profile_first_token.py --config relay --model "$m" --multiprocess \
            --out "$out/first_token_relay_multiprocess.json" ;;
    first-token-chat) m=$(model llama-3-8b-shape)
        for b in 0 8; do
          for c in relay default; do
            python3 tools/profile_first_token.py --config $c --model "$m" --system-len 2048 --prefix-len 128 \
                --n 1 --repeat 30 --background $b --max-model-len 4096 --out "$out/first_token_chat_${c}_b$b.json" \
                || return
          done
        done ;;
    first-token-ab) m=$(model llama-3-8b-shape) order="relay default"
        for i in $(seq "${ROUNDS:-3}"); do
          for c in $order; do
            python3 tools/profile_first_token.py --config $c --model "$m" --system-len 2048 --prefix-len 128 \
                --n 1 --repeat 30 --no-profile --max-model-len 4096 --out "$out/first_token_ab_${c}_$i.json" \
                || return
          done
          order=$(echo $order | tr ' ' '\n' | tac | tr '\n' ' ')
        done ;;
    l3) m=$(model "${SHAPE:-llama-3-8b-shape}")
        $bt --model "$m" --max-model-len 4096 --configs "${CONFIGS:-default,relay,noprefix}" \
            ${ENGINE_ARGS:+--engine-args "$ENGINE_ARGS"} ${N:+--num-prompts "$N"} ${PROFILE:+--profile "$PROFILE"} \
            --out "$out/e2e_${SHAPE:-llama3}_p2048_$stamp.json" ;;
    l3-eagle3) m=$(model llama-3-8b-shape) d=$(model llama-3-8b-shape-eagle3)
        $bt --model "$m" --max-model-len 4096 --configs "${CONFIGS:-default,relay}" --engine-args \
            "{\"speculative_config\": {\"method\": \"eagle3\", \"model\": \"$d\", \"num_speculative_tokens\": ${K:-3}}}" \
            --out "$out/e2e_llama3_eagle3_p2048_$stamp.json" ;;
    l3-mtp) m=$(model mimo-7b-shape)
        $bt --model "$m" --max-model-len 4096 --configs "${CONFIGS:-default,relay}" --engine-args \
            '{"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}' \
            --out "$out/e2e_mimo7b_mtp_p2048_$stamp.json" ;;
    l2) m=$(model llama-2-7b-shape)
        $bt --model "$m" --max-model-len 5120 --configs relay,noprefix \
            --out "$out/single_llama2_p2048_$stamp.json" ;;
    latency) m=$(model llama-3-8b-shape)
        $bt --model "$m" --max-model-len 4096 --num-prompts 200 --configs "${CONFIGS:-default,relay}" --latency \
            --latency-batches "${BATCHES:-1,8,64,256}" ${ENGINE_ARGS:+--engine-args "$ENGINE_ARGS"} \
            --out "$out/latency_llama3_p2048_$stamp.json" ;;
    serve) m=$(model llama-3-8b-shape)
        python3 benchmarks/bench_serving.py --model "$m" --rates 1,4,8 --duration "${DURATION:-20}" \
            --restarts "${RESTARTS:-1}" --configs "${SERVE_CONFIGS:-default,relay}" ${SERVER_ARGS:+--server-args "$SERVER_ARGS"} \
            --out "$out/serving_llama3_$stamp.json" ;;
    plain) m=$(model "${SHAPE:-llama-3-8b-shape}")
        # --prefix-len 0: the requests share nothing but BOS, so noprefix-relay's stripping of the system
        # prompt leaves them as sampled and both engines get the same requests (the output's "Requests:"
        # line compares their digests); `default` is vLLM's default engine with its prefix cache, as shipped
        python3 benchmarks/bench_interleaved.py --model "$m" --configs default,noprefix-relay --rounds "${ROUNDS:-5}" \
            --gpu-memory-utilization 0.45 --num-prompts 1000 --max-model-len 4096 --prefix-len 0 \
            ${ENGINE_ARGS:+--engine-args "$ENGINE_ARGS"} --out "$out/plain_interleaved_${SHAPE:-llama3}_$stamp.json" ;;
    samples-ab) p=${PS:-4096}
        python3 benchmarks/bench_interleaved.py --model "$(model "${SHAPE:-llama-2-7b-shape}")" --workload samples \
            --prefix-len "$p" --n "${NS:-64}" --output-len 128 --max-model-len $((p + 256)) \
            --configs "${CONFIGS:-default,relay}" --rounds "${ROUNDS:-5}" --gpu-memory-utilization 0.45 \
            ${ENGINE_ARGS:+--engine-args "$ENGINE_ARGS"} --out "$out/samples_interleaved_${SHAPE:-llama2}_$stamp.json" ;;
    l2-8192) $bt --model "$(model llama-2-7b-shape)" --prefix-len 8192 --max-model-len 9000 --repeat "${REPEAT:-1}" \
            --configs "${CONFIGS:-relay,noprefix}" --out "$out/single_llama2_p8192_$stamp.json" ;;
    multi) $bt --model "$(model llama-3-8b-shape)" --max-model-len 5120 --workloads multi \
            --configs "${CONFIGS:-default,relay}" --out "$out/multi_llama3_$stamp.json" ;;
    samples) $bs --model "$(model "${SHAPE:-llama-2-7b-shape}")" --workloads samples \
            --prefix-lens "${PS:-1024,4096,16000}" --ns "${NS:-64,256,1024}" \
            --configs "${CONFIGS:-ceiling,relay,default}" --repeat "${REPEAT:-1}" ${ENGINE_ARGS:+--engine-args "$ENGINE_ARGS"} \
            ${PROFILE:+--profile "$PROFILE"} --out "$out/samples_${SHAPE:-llama2}_$stamp.json" ;;
    tree) $bs --model "$(model llama-2-7b-shape)" --workloads tree --max-model-len 8192 \
            --configs "${CONFIGS:-ceiling,relay,relay-sysonly,default}" --out "$out/tree_llama2_$stamp.json" ;;
    serve-plain) python3 benchmarks/bench_serving.py --model "$(model llama-3-8b-shape)" --rates 1,4,8 --duration 20 \
            --plain-fraction 1 --configs default,relay-plain --out "$out/serving_plain_llama3_$stamp.json" ;;
    ops) python3 benchmarks/bench_ops.py ${QUICK:+--quick} ${DECODE:+--decode "$DECODE"} --out "$out" ;;
    window-ops) python3 benchmarks/bench_window.py ${QUICK:+--quick} --out "$out" ;;
    mla-ops) python3 benchmarks/bench_mla.py ${QUICK:+--quick} --out "$out" ;;
    sglang) shape=${SHAPE:-llama-3-8b-shape} p=${P:-2048}
        python3 benchmarks/bench_throughput.py --model "$(model "$shape")" --prefix-len "$p" --num-prompts 1000 \
            --max-model-len $((p + 1024 > 4096 ? p + 1024 : 4096)) \
            --configs "${SGLANG_CONFIGS:-sglang,relay,default}" --out "$out/sglang_${shape}_p${p}_$stamp.json" ;;
    sglang-tree) $bs --model "$(model llama-2-7b-shape)" --workloads tree --max-model-len 8192 \
            --configs ceiling,relay,sglang --out "$out/sglang_tree_llama2_$stamp.json" ;;
    sglang-samples) m=$(model llama-2-7b-shape)
        $bs --model "$m" --workloads samples --prefix-lens "${PS:-16000}" \
            --ns "${NS:-1,64,256}" --configs ceiling,relay,sglang --out "$out/sglang_samples_llama2_$stamp.json" ;;
    sglang-serve) m=$(model llama-3-8b-shape)
        python3 benchmarks/bench_serving.py --model "$m" --rates 1,4,8 --duration "${DURATION:-20}" \
            --restarts "${RESTARTS:-1}" --configs "${SGLANG_CONFIGS:-sglang,relay,default}" \
            ${SERVER_ARGS:+--server-args "$SERVER_ARGS"} \
            --out "$out/sglang_serving_llama3_$stamp.json" ;;
    *) echo "unknown step $step" >&2; return 2 ;;
  esac > "$out/$step.txt" 2>&1
  local rc=$?
  # A failed test step's engines' outputs (every *.out.json: tokens and logprobs) come back as one file,
  # to read which engine parted where; KEEP_OUTPUTS=1 keeps a passing step's too.
  if { [ $rc != 0 ] || [ -n "${KEEP_OUTPUTS:-}" ]; } && [ -d "/tmp/pytest-relay/$step" ]; then
    (cd "/tmp/pytest-relay/$step" && find . -name '*.out.json' | tar -czf "$out/$step-outputs.tgz" -T -)
  fi
  return $rc
}

pack() {  # PACK=1: $out's files (not earlier packs) into one archive named after step $2, the originals
  # removed; its status $1
  [ -n "${PACK:-}" ] || return "$1"
  local name="pack_$stamp${2:+_$2}.tgz"
  (cd "$out" && find . -type f ! -name 'pack_*.tgz' | sort > /tmp/pack_list_$stamp &&
   [ -s /tmp/pack_list_$stamp ] && tar -czf "$name" -T /tmp/pack_list_$stamp &&
   xargs -d '\n' rm -f < /tmp/pack_list_$stamp &&
   find . -mindepth 1 -type d -empty -delete && echo "packed $(wc -l < /tmp/pack_list_$stamp) files: $out/$name")
  return "$1"
}

status=0
if [ $side = 1 ]; then
  export RELAY_TEST_GPU_SHARE=${RELAY_TEST_GPU_SHARE:-0.08}
  for step in "$@"; do
    case $step in
      unit|mha|gqa|unsplit*|levels|sleep*|seeded|features*|ngram|drafters|eagle3-*|mtp-*) ;;
      *) echo "$step needs the machine alone: not with --side-by-side" >&2; exit 2 ;;
    esac
  done
  pids=()
  for step in "$@"; do  # each its own vLLM cache: no two processes compile into one folder
    VLLM_CACHE_ROOT=/tmp/vllm-cache/$step run "$step" & pids+=($!)
  done
  i=0
  for step in "$@"; do
    wait "${pids[$i]}"; rc=$?; echo "$step: exit $rc"; tail -n 2 "$out/$step.txt"; i=$((i + 1))
    [ $rc = 0 ] || status=$rc
  done
else
  for step in "$@"; do
    run "$step"; rc=$?; echo "$step: exit $rc"; tail -n 3 "$out/$step.txt"
    [ $rc = 0 ] || status=$rc
    pack 0 "$step"
  done
fi
pack $status
