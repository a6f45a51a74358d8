#!/usr/bin/env bash
# The GPU measurement, in the steps of bench/results/gpu.md; each step is one device call (< 10 minutes).
#
#   DEADLINE=$(( $(date +%s) + 540 )) servers/gpu/plan.sh STEP...   (steps run in order, each within DEADLINE)
#
#   start     start every variant at once (compiled+CUDA graphs, eager, no async scheduling, the CPU model);
#             the gpu-tiny profile is eager, so the compiled ones pass --no-enforce-eager
#   probe     wait for them, time a burst on each, pick the mode whose pair works (graph, else eager), and
#             start the fault treatments in that mode
#   clean     blackbox the clean triple of each working mode, seed ${SEEDS:-0} (concurrently)
#   faults    blackbox each fault treatment against the clean control/reference of the mode
#   start-all, measure, measure2: the one-wave variant of start/probe/clean/faults used on 2026-12-01
#   kernels   the CPU kernel ports against vLLM's Triton kernels on identical inputs
#   start-v2, verdicts: the verdict rule of issue 8 on the GPU (second sitting): one triple per blackbox run,
#             so that no two runs share a server's counters: clean eager, eagle-overrun and stale-checkpoint
#             eager (each with its own control and reference), clean PIECEWISE; plus the FULL-graph treatment
#             without async scheduling, probed only
#   start-v3, v3, send: the default run (reference 2x) over seeds, clean eager and PIECEWISE and the two hit faults
#             sporadic (third sitting); `send` puts the finished run folders into $OUT as split solid tarballs
#   start-v4, v4: the sporadic faults at 0.2 over seeds, two triples per fault, PIECEWISE (fourth sitting); each
#             run judged on the device (servers.gpu.digest), `send` then ships records and small files
#   start-v5, v5: the same with both faults in both shapes, seeds from 200 (fifth sitting)
#   start-load, load, loadlogs: the load probe (blackbox run --probe load) with async scheduling on, each triple
#             with a KV cache too small for the probe's conversations (LOAD_SPECS; eighth sitting,
#             bench/results/gpu-load.md); `send` then ships records and small files, `loadlogs` the server logs
#   start-oh, oh: bench/overhead.py over seeds on one PIECEWISE gpu-tiny triple alone (issue 24)
#   onegpu    stop every server, then the launcher's own one-GPU mode (three roles, memory fractions, one by
#             one) and a clean blackbox run against it
#
# Servers are started detached and live until the machine goes back, so later steps reuse them. Each one
# gets a fixed KV cache (--kv-cache-memory-bytes) instead of a memory fraction: they start concurrently on one
# GPU, and vLLM's memory profiling would count a neighbour's allocations as its own. (The launcher's own
# one-GPU mode, fractions started one by one, is what a user runs; see docs/gpu.md.)
set -uo pipefail
W=${BBGPU_DIR:-/tmp/bbgpu}
D="bash $W/bb/servers/gpu/device.sh"
export PYTHONPATH="$W/bb:$W/site${PYTHONPATH:+:$PYTHONPATH}" # what install put there (kernels, launcher)
KV=(--gpu-memory-utilization 0.06 --kv-cache-memory-bytes 4294967296)
CPU_MODEL=$W/models/tiny-qwen3next-s0-v2
DEADLINE=${DEADLINE:-$(($(date +%s) + 540))} # epoch second by which this call must be done (then it packs)
url() { echo "http://127.0.0.1:$1"; }
healthy() { curl -sf -m 5 "$(url "$1")/health" >/dev/null; }
left() { echo $((DEADLINE - $(date +%s))); }
probe() { (cd "$W/bb" && python3 -m servers.gpu.probe --log-root "$W/logs" --out "$W/logs/probe.jsonl" "$@"); }
mode_file=$W/mode

bb_triple() { # NAME T C R SEED [extra blackbox args]
    local name=$1 t=$2 c=$3 r=$4 seed=$5
    shift 5
    local args=(--treatment "$(url "$t")" --control "$(url "$c")" --conversations "${CONV:-24}" --seed "$seed")
    [ "$r" != - ] && args+=(--reference "$(url "$r")")
    local budget=$(($(left) - 5))
    ((budget > ${BB_CAP:-100000})) && budget=$BB_CAP
    if ((budget < 30)); then echo "skip blackbox $name: ${budget}s left"; return; fi
    BB_TIMEOUT=$budget $D blackbox "$name" "${args[@]}" "$@"
}


start() {
    $D serve t-graph treatment 8100 -- "${KV[@]}" --no-enforce-eager
    $D serve c-graph control 8101 -- "${KV[@]}" --no-enforce-eager
    $D serve r-graph reference 8102 -- "${KV[@]}" --no-enforce-eager
    $D serve t-eager treatment 8110 -- "${KV[@]}" --enforce-eager
    $D serve c-eager control 8111 -- "${KV[@]}" --enforce-eager
    $D serve r-eager reference 8112 -- "${KV[@]}" --enforce-eager
    $D serve t-noasync treatment 8120 -- "${KV[@]}" --no-enforce-eager --no-async-scheduling
    # The CPU model (2 key = 2 value heads, block 48): the crawl and the crash of the first attempt.
    $D serve t-cpumodel treatment 8130 --model "$CPU_MODEL" -- "${KV[@]}" --no-enforce-eager
    $D serve r-cpumodel reference 8132 --model "$CPU_MODEL" -- "${KV[@]}" --no-enforce-eager
}

probe_step() {
    $D wait $(($(left) - ${PROBE_RESERVE:-240})) 8100 8101 8102 8110 8111 8112 8120 8130
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv
    local up=() pair
    for pair in t-graph=8100 c-graph=8101 r-graph=8102 t-eager=8110 c-eager=8111 r-eager=8112 t-noasync=8120 \
        t-cpumodel=8130 r-cpumodel=8132; do
        healthy "${pair#*=}" && up+=("${pair%=*}=$(url "${pair#*=}")")
    done
    ((${#up[@]})) && probe --timeout 60 "${up[@]}"
    # The mode whose pair answered the burst without failures, graph first.
    python3 - "$W/logs/probe.jsonl" >"$mode_file" <<'PY'
import json, os, sys
rows = {}
if os.path.exists(sys.argv[1]):
    rows = {r["name"]: r for r in map(json.loads, open(sys.argv[1]))}
ok = lambda n: n in rows and not rows[n].get("failed") and "error" not in rows[n]
print(next((m for m in ("graph", "eager") if ok(f"t-{m}") and ok(f"c-{m}")), "none"))
PY
    local mode
    mode=$(cat "$mode_file")
    echo "mode: $mode"
    [ "$mode" = none ] && return
    local extra=()
    [ "$mode" = graph ] && extra=(--no-enforce-eager)
    $D serve f-eagle treatment 8140 --fault eagle-overrun -- "${KV[@]}" "${extra[@]}"
    $D serve f-stale treatment 8150 --fault stale-checkpoint -- "${KV[@]}" "${extra[@]}"
}

clean() {
    local seed
    for seed in ${SEEDS:-0}; do
        BB_CAP=${CLEAN_CAP:-100000}
        healthy 8100 && healthy 8101 && healthy 8102 && bb_triple "clean-graph-s$seed" 8100 8101 8102 "$seed" &
        healthy 8110 && healthy 8111 && healthy 8112 && bb_triple "clean-eager-s$seed" 8110 8111 8112 "$seed" &
    done
    wait
}

faults() {
    local mode c r up=() pair
    mode=$(cat "$mode_file")
    if [ "$mode" = graph ]; then c=8101 r=8102; else c=8111 r=8112; fi
    $D wait $(($(left) - ${FAULT_RESERVE:-200})) 8140 8150
    for pair in f-eagle=8140 f-stale=8150; do
        healthy "${pair#*=}" && up+=("${pair%=*}=$(url "${pair#*=}")")
    done
    ((${#up[@]})) && probe --timeout 45 --requests 4 "${up[@]}"
    healthy 8140 && bb_triple "eagle-overrun-$mode-s0" 8140 $c $r 0 &
    healthy 8150 && bb_triple "stale-checkpoint-$mode-s0" 8150 $c $r 0 &
    wait
    local f
    for f in "$W"/logs/f-*/treatment.log; do echo "$f: $(grep -c 'BLACKBOX_FAULT fired' "$f") fired lines"; done
}

# No fragmented (cold-race, chunk-end-as-boundary) servers: vLLM 0.26 refuses a step budget below the block
# size in align mode ("block_size (288) must be <= max_num_batched_tokens (96)"), and at or above it align
# mode re-aligns chunk ends to block boundaries, so the A1 precondition cannot be produced on 0.26.
# One wave: every variant and the fault treatments (eager, the mode CPU runs use) start together, so that a
# fresh machine pays the ~200 s cold start (Triton autotuning, compile) once.
start_all() {
    $D serve t-graph treatment 8100 -- "${KV[@]}" --no-enforce-eager
    $D serve c-graph control 8101 -- "${KV[@]}" --no-enforce-eager
    $D serve r-graph reference 8102 -- "${KV[@]}" --no-enforce-eager
    $D serve t-eager treatment 8110 -- "${KV[@]}" --enforce-eager
    $D serve c-eager control 8111 -- "${KV[@]}" --enforce-eager
    $D serve r-eager reference 8112 -- "${KV[@]}" --enforce-eager
    $D serve t-cpumodel treatment 8130 --model "$CPU_MODEL" -- "${KV[@]}" --no-enforce-eager
    $D serve f-eagle treatment 8140 --fault eagle-overrun -- "${KV[@]}" --enforce-eager
    $D serve f-stale treatment 8150 --fault stale-checkpoint -- "${KV[@]}" --enforce-eager
}

# Probe every server, then every blackbox run at once: clean graph and eager triples, the four fault cases
# against the eager control/reference.
measure() {
    $D wait $(($(left) - ${PROBE_RESERVE:-240})) 8100 8101 8102 8110 8111 8112 8130 8140 8150
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv
    local up=() pair seed
    for pair in t-graph=8100 c-graph=8101 r-graph=8102 t-eager=8110 c-eager=8111 r-eager=8112 t-cpumodel=8130 \
        f-eagle=8140 f-stale=8150; do
        healthy "${pair#*=}" && up+=("${pair%=*}=$(url "${pair#*=}")")
    done
    ((${#up[@]})) && probe --timeout 45 "${up[@]}"
    for seed in ${SEEDS:-0}; do
        healthy 8100 && healthy 8101 && healthy 8102 && bb_triple "clean-graph-s$seed" 8100 8101 8102 "$seed" &
        healthy 8110 && healthy 8111 && healthy 8112 && bb_triple "clean-eager-s$seed" 8110 8111 8112 "$seed" &
    done
    # One fault run beside the clean ones: each control/reference serves 8 sequences at a time.
    healthy 8140 && bb_triple eagle-overrun-eager-s0 8140 8111 8112 0 &
    wait
}

measure2() {
    healthy 8150 && bb_triple stale-checkpoint-eager-s0 8150 8111 8112 0 &
    wait
    local f
    for f in "$W"/logs/f-*/treatment.log; do echo "$f: $(grep -c 'BLACKBOX_FAULT fired' "$f") fired lines"; done
}

# Second sitting: every blackbox run gets its own control and reference (a shared server's /metrics deltas
# would mix two runs' traffic into each run's gates).
PW=(--no-enforce-eager --compilation-config '{"cudagraph_mode":"PIECEWISE"}')
start_v2() {
    $D serve t-eager treatment 8110 -- "${KV[@]}" --enforce-eager
    $D serve c-eager control 8111 -- "${KV[@]}" --enforce-eager
    $D serve r-eager reference 8112 -- "${KV[@]}" --enforce-eager
    $D serve f-eagle treatment 8140 --fault eagle-overrun -- "${KV[@]}" --enforce-eager
    $D serve c-eagle control 8141 -- "${KV[@]}" --enforce-eager
    $D serve r-eagle reference 8142 -- "${KV[@]}" --enforce-eager
    $D serve f-stale treatment 8150 --fault stale-checkpoint -- "${KV[@]}" --enforce-eager
    $D serve c-stale control 8151 -- "${KV[@]}" --enforce-eager
    $D serve r-stale reference 8152 -- "${KV[@]}" --enforce-eager
    $D serve t-pw treatment 8160 -- "${KV[@]}" "${PW[@]}"
    $D serve c-pw control 8161 -- "${KV[@]}" "${PW[@]}"
    $D serve r-pw reference 8162 -- "${KV[@]}" "${PW[@]}"
    $D serve t-noasync treatment 8120 -- "${KV[@]}" --no-enforce-eager --no-async-scheduling
}

verdicts() {
    local ports=(8110 8111 8112 8140 8141 8142 8150 8151 8152 8160 8161 8162 8120) up=() pair seed=${SEEDS:-0}
    $D wait $(($(left) - ${PROBE_RESERVE:-240})) "${ports[@]}"
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv
    for pair in t-eager=8110 t-pw=8160 t-noasync=8120; do
        healthy "${pair#*=}" && up+=("${pair%=*}=$(url "${pair#*=}")")
    done
    ((${#up[@]})) && probe --timeout 45 "${up[@]}"
    healthy 8110 && bb_triple "clean-eager-s$seed" 8110 8111 8112 "$seed" &
    healthy 8140 && bb_triple "eagle-overrun-eager-s$seed" 8140 8141 8142 "$seed" &
    healthy 8150 && bb_triple "stale-checkpoint-eager-s$seed" 8150 8151 8152 "$seed" &
    healthy 8160 && bb_triple "clean-piecewise-s$seed" 8160 8161 8162 "$seed" &
    wait
    local f
    for f in "$W"/logs/f-*/treatment.log; do echo "$f: $(grep -c 'BLACKBOX_FAULT fired' "$f") fired lines"; done
}

# What a user runs on a one-GPU host: the launcher places three roles on GPU 0 with a memory fraction each and
# starts them one after another. Every other server is stopped first (by the PIDs of their launchers).
onegpu() {
    local pids
    pids=$(pgrep -f "servers.launch --profile" | tr '\n' ' ')
    [ -n "$pids" ] && kill $pids
    sleep 15
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv
    (cd "$W/bb" && exec setsid nohup python3 -m servers.launch --profile gpu-tiny \
        --roles treatment,control,reference --base-port 8200 --cache-dir "$W/models" --log-dir "$W/logs/onegpu" \
        --timeout 900) >"$W/logs/onegpu.launch" 2>&1 </dev/null &
    $D wait $(($(left) - ${ONEGPU_RESERVE:-200})) 8200 8201 8202
    cat "$W/logs/onegpu.launch"
    python3 -c 'import json,sys; [print(r, s.get("env", {}).get("CUDA_VISIBLE_DEVICES"), s["argv"][s["argv"].index("--gpu-memory-utilization") + 1]) for r, s in json.load(open(sys.argv[1])).items()]' "$W/logs/onegpu/pids.json"
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv
    healthy 8200 && healthy 8201 && healthy 8202 && bb_triple "clean-onegpu-s${SEEDS:-0}" 8200 8201 8202 "${SEEDS:-0}"
}

# Third sitting: the default run (reference 2x) over several seeds, clean in eager and PIECEWISE mode, and the
# two hit faults sporadic (0.2 of their candidates; eagle-overrun as a poisoned block, stale-checkpoint as a
# transient restore), each triple running seeds one after another until the call's deadline. Seeds continue
# across calls (a counter per series under $W).
start_v3() {
    $D serve t-eager treatment 8110 -- "${KV[@]}" --enforce-eager
    $D serve c-eager control 8111 -- "${KV[@]}" --enforce-eager
    $D serve r-eager reference 8112 -- "${KV[@]}" --enforce-eager
    $D serve t-pw treatment 8160 -- "${KV[@]}" "${PW[@]}"
    $D serve c-pw control 8161 -- "${KV[@]}" "${PW[@]}"
    $D serve r-pw reference 8162 -- "${KV[@]}" "${PW[@]}"
    BLACKBOX_FAULT_SPORADIC=0.2 BLACKBOX_FAULT_SHAPE=block \
        $D serve f-eagle treatment 8140 --fault eagle-overrun -- "${KV[@]}" --enforce-eager
    $D serve c-eagle control 8141 -- "${KV[@]}" --enforce-eager
    $D serve r-eagle reference 8142 -- "${KV[@]}" --enforce-eager
    BLACKBOX_FAULT_SPORADIC=0.2 BLACKBOX_FAULT_SHAPE=restore \
        $D serve f-stale treatment 8150 --fault stale-checkpoint -- "${KV[@]}" --enforce-eager
    $D serve c-stale control 8151 -- "${KV[@]}" --enforce-eager
    $D serve r-stale reference 8152 -- "${KV[@]}" --enforce-eager
}

series() { # NAME T C R CONV ROOM: seeds one after another while ROOM seconds are left for one more run
    local name=$1 t=$2 c=$3 r=$4 conv=$5 room=$6 seed
    while (($(left) > room)) && healthy "$t"; do
        seed=$(cat "$W/seed-$name" 2>/dev/null || echo 0)
        echo $((seed + 1)) >"$W/seed-$name"
        CONV=$conv bb_triple "$name-s$seed" "$t" "$c" "$r" "$seed"
    done
}

v3() {
    $D wait $(($(left) - ${PROBE_RESERVE:-200})) 8110 8111 8112 8160 8161 8162 8140 8141 8142 8150 8151 8152
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv
    series clean-eager 8110 8111 8112 32 "${CLEAN_ROOM:-150}" &
    series clean-pw 8160 8161 8162 32 "${CLEAN_ROOM:-150}" &
    series eagle02block 8140 8141 8142 "${SPORADIC_CONV:-64}" "${SPORADIC_ROOM:-250}" &
    series stale02restore 8150 8151 8152 "${SPORADIC_CONV:-64}" "${SPORADIC_ROOM:-250}" &
    wait
    local f
    for f in "$W"/logs/f-*/treatment.log; do
        echo "$f: $(grep -c 'BLACKBOX_FAULT fired' "$f") fired, $(grep -c 'BLACKBOX_FAULT skipped' "$f") skipped"
    done
}

# Fourth sitting: the sporadic targets of issue 8 over seeds. Two hit faults at 0.2, each in its own shape
# (eagle-overrun as a poisoned block, stale-checkpoint as a transient restore), two triples each, every server
# PIECEWISE (a 64-conversation run is about half an eager one's time; the faults patch the scheduler, outside any
# graph). Each run is judged again on the device (servers.gpu.digest, in the background while the next runs)
# and `send` ships its record and small files, whole folders only for a few.
# Each triple: NAME:FAULT:SHAPE:PORT:FRACTION:SEED0[:CONVERSATIONS] (treatment at PORT, control PORT+1,
# reference PORT+2; conversations default to SPORADIC_CONV, 64).
V4_SPECS="eagle-a:eagle-overrun:block:8140:${SPORADIC:-0.2}:0 eagle-b:eagle-overrun:block:8170:${SPORADIC:-0.2}:100
stale-a:stale-checkpoint:restore:8150:${SPORADIC:-0.2}:0 stale-b:stale-checkpoint:restore:8180:${SPORADIC:-0.2}:100"
# Fifth sitting: the adaptive exceedance threshold (evidence.RANKS) on both faults in both shapes at 0.2; set
# V5_SPECS in the environment to run other triples the same way (e.g. fraction 0.1; FAULT "-" for a clean
# triple, named clean-*, whose treatment runs no fault).
# V4_BB_ARGS is appended to every v4/v5 run's blackbox call (issue 24, 2026-12-06: the sequential mode, e.g.
# "--detect 0.2 --resumes 3 --max-conversations 48"; --detect makes blackbox ignore bb_triple's --conversations).
# With --detect give each spec's CONVERSATIONS the budget (--max-conversations): a run may go that far, and the
# room a series leaves for one more run (SPORADIC_ROOM, default CONVERSATIONS * 9/4 + 12 s) is reckoned from it.
V5_SPECS=${V5_SPECS:-"eagle-a:eagle-overrun:block:8140:0.2:200 stale-a:stale-checkpoint:restore:8150:0.2:200
eagle-r:eagle-overrun:restore:8170:0.2:200 stale-k:stale-checkpoint:block:8180:0.2:200"}

start_v4() { # SPECS
    local name fault shape port frac seed0 conv
    for spec in $1; do
        IFS=: read -r name fault shape port frac seed0 conv <<<"$spec"
        if [ "$fault" = - ]; then # a clean triple (FAULT "-"): the treatment without the plugin's fault
            $D serve "f-$name" treatment "$port" -- "${KV[@]}" "${PW[@]}"
        else
            BLACKBOX_FAULT_SPORADIC=$frac BLACKBOX_FAULT_SHAPE=$shape \
                $D serve "f-$name" treatment "$port" --fault "$fault" -- "${KV[@]}" "${PW[@]}"
        fi
        $D serve "c-$name" control $((port + 1)) -- "${KV[@]}" "${PW[@]}"
        $D serve "r-$name" reference $((port + 2)) -- "${KV[@]}" "${PW[@]}"
    done
}

digest() { (cd "$W/bb" && timeout "${DIGEST_TIMEOUT:-150}" python3 -m servers.gpu.digest "$@"); }

series4() { # NAME CASE FAULT PORT SEED0 [CONV]: seeds one after another while a run fits (SPORADIC_ROOM seconds)
    local name=$1 case=$2 fault=$3 t=$4 seed seed0=$5 conv=${6:-${SPORADIC_CONV:-64}} before after
    local log=$W/logs/f-$1/treatment.log room=${SPORADIC_ROOM:-$((conv * 9 / 4 + 12))} extra
    read -r -a extra <<<"${V4_BB_ARGS:-}"
    while (($(left) > room)) && healthy "$t"; do
        seed=$(cat "$W/seed-$name" 2>/dev/null || echo "$seed0")
        echo $((seed + 1)) >"$W/seed-$name"
        : >"$W/logs/digest-$name-s$seed.out" # marks the run as one `send` holds back until its record.json
        before=$(digest counts "$log" "$fault")
        CONV=$conv bb_triple "$name-s$seed" "$t" $((t + 1)) $((t + 2)) "$seed" "${extra[@]}"
        after=$(digest counts "$log" "$fault")
        local judged=(--case "$case" --seed "$seed")
        [ "$fault" != - ] && judged+=(--fault "$fault" --before "$before" --after "$after")
        [ -e "$W/runs/$name-s$seed" ] &&
            digest record "$W/runs/$name-s$seed" "${judged[@]}" >"$W/logs/digest-$name-s$seed.out" 2>&1 &
    done
    wait
}

v4() { # SPECS
    local name fault shape port frac seed0 conv ports=()
    for spec in $1; do
        IFS=: read -r name fault shape port frac seed0 conv <<<"$spec"
        ports+=("$port" $((port + 1)) $((port + 2)))
    done
    $D wait $(($(left) - ${PROBE_RESERVE:-200})) "${ports[@]}"
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv
    for spec in $1; do
        IFS=: read -r name fault shape port frac seed0 conv <<<"$spec"
        local case="$fault $frac $shape"
        [ "$fault" = - ] && case=clean
        series4 "$name" "$case" "$fault" "$port" "$seed0" "$conv" &
    done
    wait
    cat "$W"/logs/digest-*.out 2>/dev/null | grep '^{' | sort | uniq
}

# Eighth sitting (issue 23): the load probe on the GPU, where vLLM 0.26 schedules asynchronously by default (MTP is
# an EAGLE-kind method, so nothing turns it off; the verdict's load-trigger line states what the treatment
# published). Every role of a triple gets the same small KV cache, the GPU form of servers/profiles.py's
# LOAD_KV_ARGS: --num-gpu-blocks-override BLOCKS with every eviction sampled. Why 170 blocks here too: the workload
# lays a conversation out in blocks, not tokens (turn 1: a prompt 16 tokens short of 3 blocks, then 3.5 blocks of
# answer; workload.plan_conversation), so with the GPU model's 288-token blocks a turn 1 spans the same 6.5
# blocks per KV-cache group as with the CPU model's 128, and the tiny model's hybrid pool gives it the same ~27
# blocks: 8 running want ~216, 170 evicts without starving the follow-ups (CPU: 29-32 of 32 hit). A 8192-token
# request needs ~65 blocks, so vLLM admits the max_model_len. Each triple: NAME:FAULT:PORT:BLOCKS:SEED0 (FAULT "-":
# a clean treatment), treatment at PORT, control PORT+1, reference PORT+2; LOAD_SEEDS runs a triple, one after
# another, while LOAD_ROOM seconds (default 240: a run took 205-211 s with two triples side by side, eager) are
# left for one more (LOAD_CONV conversations, default 32), or its last run's time plus 30 s if more; e.g. add
# load-clean140:-:8530:140:0 to see whether fewer blocks preempt (on the CPU pair 120 preempted and starved; ninth
# sitting, 2026-12-05: 140 and 125 still preempted nothing on the GPU model). Every role's --block-size 288 now
# comes from the gpu-tiny preset (servers/profiles.py GPU_TINY_BLOCK_SIZE; the eighth sitting passed it here): left
# to choose, vLLM 0.26 gives the reference (no MTP) 272 and blackbox's yardstick gate refuses the triple
# (ConfigMismatch). A spec may add :CONC (blackbox --concurrency, conversations in flight; default 8) and :MAXLEN
# (every role's --max-model-len, so that fewer blocks than an 8192-token request's ~62 start); LOAD_BB_ARGS is
# appended to every load run's blackbox call (sixth preemption try, 2026-12-06: fewer in flight at small caches).
# A last :RBLOCKS gives the reference its own block count: without MTP's KV group a reference block holds twice the
# tokens (vLLM's "Maximum concurrency" reads 2.26x against the treatment's 1.13x at 70 blocks), so RBLOCKS = BLOCKS/2
# puts both arms under the same pressure, as servers/profiles.py's cpu-tiny-preempt does.
# `loadsum` prints what a call reads back: counters, server-log lines, verdicts, digests.
# LOAD_PROBE=preemption runs the preemption probe on these triples instead (tenth sitting, issue 23: turn 1s
# preempted under async scheduling, each graded against its recomputation alone; it needs the reference preempted
# too, so give it half the blocks, :RBLOCKS); spec names keep the `load-` prefix, which the log and digest globs
# below read. Its first GPU try (2026-12-07, eager, 32 prefixes, 64:32 blocks) did not finish in 11 minutes: each
# reference recomputation took 15-19 s two at a time; LOAD_PW=1 serves every load role with PIECEWISE CUDA graphs.
LOAD_PROBE=${LOAD_PROBE:-load}
LOAD_SPECS=${LOAD_SPECS:-"load-clean:-:8510:170:0 load-recycled:recycled-block:8520:170:0"}
LOAD_METRICS=(--kv-cache-metrics --kv-cache-metrics-sample 1.0)

# One spec's fields into the caller's locals (bash scoping: the caller declares them `local`).
load_spec() { IFS=: read -r name fault port blocks seed0 conc maxlen rblocks <<<"$1"; }

start_load() { # SPECS
    local name fault port blocks seed0 conc maxlen rblocks
    for spec in $1; do
        load_spec "$spec"
        local kv=("${KV[@]}" --num-gpu-blocks-override "$blocks" "${LOAD_METRICS[@]}")
        [ -n "$maxlen" ] && kv+=(--max-model-len "$maxlen")
        ((${LOAD_PW:-0})) && kv+=("${PW[@]}")
        if [ "$fault" = - ]; then
            $D serve "f-$name" treatment "$port" -- "${kv[@]}"
        else
            $D serve "f-$name" treatment "$port" --fault "$fault" -- "${kv[@]}"
        fi
        $D serve "c-$name" control $((port + 1)) -- "${kv[@]}"
        [ -n "$rblocks" ] && kv+=(--num-gpu-blocks-override "$rblocks") # the later flag wins
        $D serve "r-$name" reference $((port + 2)) -- "${kv[@]}"
    done
}

series_load() { # NAME FAULT PORT SEED0 [CONC]
    local name=$1 fault=$2 t=$3 seed0=$4 n=0 seed before after case=clean room=${LOAD_ROOM:-240} took
    local log=$W/logs/f-$1/treatment.log extra
    read -r -a extra <<<"${LOAD_BB_ARGS:-}"
    [ -n "${5:-}" ] && extra+=(--concurrency "$5")
    [ "$fault" != - ] && case="$fault"
    while ((n < ${LOAD_SEEDS:-4})) && (($(left) > room)) && healthy "$t"; do
        seed=$((seed0 + n))
        n=$((n + 1))
        : >"$W/logs/digest-$name-s$seed.out" # `send` holds the run back until its record.json
        before=$(digest counts "$log" "$fault")
        took=$(date +%s)
        CONV=${LOAD_CONV:-32} bb_triple "$name-s$seed" "$t" $((t + 1)) $((t + 2)) "$seed" --probe "$LOAD_PROBE" \
            "${extra[@]}"
        took=$(($(date +%s) - took))
        # Smaller caches or more triples side by side make a run longer: the next needs what this one took.
        ((took + 30 > room)) && room=$((took + 30))
        after=$(digest counts "$log" "$fault")
        [ -e "$W/runs/$name-s$seed" ] && digest load "$W/runs/$name-s$seed" --case "$case $LOAD_PROBE" \
            --seed "$seed" --fault "$fault" --before "$before" --after "$after" --probe "$LOAD_PROBE" \
            >"$W/logs/digest-$name-s$seed.out" 2>&1
    done
}

load_step() { # SPECS
    local name fault port blocks seed0 conc maxlen rblocks ports=() f i role prefix
    rm -f "$W/load-done"
    for spec in $1; do
        load_spec "$spec"
        ports+=("$port" $((port + 1)) $((port + 2)))
    done
    $D wait $(($(left) - ${PROBE_RESERVE:-200})) "${ports[@]}"
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv
    for spec in $1; do
        load_spec "$spec"
        series_load "$name" "$fault" "$port" "$seed0" "$conc" &
    done
    wait
    for f in "$W"/logs/f-load-*/treatment.log; do
        echo "$f: $(grep -c 'BLACKBOX_FAULT fired' "$f") fired, $(grep -c 'BLACKBOX_FAULT skipped' "$f") skipped;" \
            "$(grep -m1 -o 'Asynchronous scheduling is [a-z]*' "$f")"
    done
    for spec in $1; do # a server that died under load: the end of its log is the finding
        load_spec "$spec"
        for f in 0:treatment:f 1:control:c 2:reference:r; do
            IFS=: read -r i role prefix <<<"$f"
            healthy $((port + i)) && continue
            echo "== $name $role (port $((port + i))) not healthy at the end:"
            tail -n 30 "$W/logs/$prefix-$name/$role.log" 2>/dev/null
        done
    done
    cat "$W"/logs/digest-load-*.out 2>/dev/null
    touch "$W/load-done"
}

load_sum() { # SPECS: what a call reads back, after (or while) `load` runs
    local name fault port blocks seed0 conc maxlen rblocks i f
    date -u
    grep -v "^ *$" "$W/logs/loadbg.log" 2>/dev/null | tail -30
    for f in "$W"/logs/*-load-*/*.log; do
        echo "$f: $(grep -m1 -o 'Overriding num_gpu_blocks.*' "$f") | $(grep -m1 -o 'Maximum concurrency.*' "$f")" \
            "| errors $(grep -c ERROR "$f") | preempt lines $(grep -ci preempt "$f")"
    done
    for spec in $1; do
        load_spec "$spec"
        for i in 0 1 2; do
            echo "$name $((port + i)) $(curl -s -m5 "$(url $((port + i)))/metrics" |
                grep -E '^vllm:(num_preemptions_total|kv_block_idle_before_evict_seconds_count)' | sed 's/{.*}//' |
                tr '\n' ' ')"
        done
    done
    python3 - "$W" <<'PY'
import glob, json, sys
for p in sorted(glob.glob(sys.argv[1] + "/runs/load-*/*/verdict.json")):
    v = json.load(open(p))
    fs = [(f["check"], f["status"], (f.get("reason") or "")[:400]) for f in v["findings"]
          if f["check"] in ("load-trigger", "load", "preempt-trigger", "preemption", "cache-live")]
    print(p.split("/")[-3], v["status"], v.get("error_class"), fs)
PY
    cat "$W"/logs/digest-load-*.out 2>/dev/null
}

# Issue 24: bench/overhead.py (blackbox against a raw replay of its own requests) on one gpu-tiny triple alone on
# the GPU, PIECEWISE as every sitting since the fourth (eager takes ~3x as long a run): treatment at OH_PORT (8600),
# control +1, reference +2. `oh` runs seeds one after another, one overhead.py call each (a cold run, a replay, the
# measured run, a replay: ~4 runs' time), from OH_SEED0 (600) on, counted on across calls, while OH_ROOM seconds
# (default 280), or the last seed's time plus 20 s if more, are left for one more; each new row (not the CPU rows the
# copy's overhead.jsonl came with) is copied to $W/overhead.jsonl as it lands, ready to append here. OH_LABEL names the servers (the GPU's name is added), OH_COMMIT the commit the copy
# was made from (it has no git).
start_oh() {
    local p=${OH_PORT:-8600}
    $D serve t-oh treatment "$p" -- "${KV[@]}" "${PW[@]}"
    $D serve c-oh control $((p + 1)) -- "${KV[@]}" "${PW[@]}"
    $D serve r-oh reference $((p + 2)) -- "${KV[@]}" "${PW[@]}"
}

oh() {
    local p=${OH_PORT:-8600} seed budget room=${OH_ROOM:-280} t0 took rows="$W/bb/bench/results/overhead.jsonl" had
    had=$(wc -l <"$rows")
    $D wait $(($(left) - room)) "$p" $((p + 1)) $((p + 2))
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    while (($(left) > room)) && healthy "$p" && healthy $((p + 1)) && healthy $((p + 2)); do
        seed=$(cat "$W/seed-oh" 2>/dev/null || echo "${OH_SEED0:-600}")
        echo $((seed + 1)) >"$W/seed-oh"
        budget=$(($(left) - 5))
        t0=$(date +%s)
        echo "[$(date -u +%H:%M:%S)] overhead seed $seed (${budget}s left)"
        (cd "$W/bb" && timeout "$budget" python3 bench/overhead.py --treatment "$(url "$p")" \
            --control "$(url $((p + 1)))" --reference "$(url $((p + 2)))" --label "${OH_LABEL:-gpu-tiny}" \
            --seeds 1 --seed-start "$seed" --commit "${OH_COMMIT:-unknown}" --keep-runs "$W/runs/overhead") \
            >>"$W/logs/overhead.out" 2>&1
        echo "[$(date -u +%H:%M:%S)] overhead seed $seed exit $?"
        # The room for one more: OH_ROOM, or the last seed's time plus 20 s if more.
        took=$(($(date +%s) - t0 + 20))
        room=$((took > ${OH_ROOM:-280} ? took : ${OH_ROOM:-280}))
        tail -n +$((had + 1)) "$rows" >"$W/overhead.jsonl"
    done
}

# The finished run folders not yet sent, as one solid xz tarball split in 15 MiB parts (at most 8 files, 64 MiB
# come back a call): join with `cat runs-CALL.tar.xz.part-* | xz -d | tar x`. A run the device has judged (its
# record.json, fourth sitting) travels as that record and its small files, without the exchanges (~12 MB as xz at 64
# conversations), except for the first SEND_FULL of them, PASS first; any other run travels whole.
send() {
    mkdir -p "$W/sent"
    local d names=() recorded=() whole=() tag
    for d in "$W"/runs/*/; do
        d=${d%/}
        [ -e "$W/sent/${d##*/}" ] || ! compgen -G "$d/*/verdict.json" >/dev/null && continue
        # A run of a series (start-v4/v5, any name) travels once the device has judged it: its digest was asked.
        [ -e "$W/logs/digest-${d##*/}.out" ] && [ ! -e "$d/record.json" ] && continue
        ((${#names[@]} >= ${SEND_MAX:-16})) && break
        names+=("${d##*/}")
        if [ -e "$d/record.json" ]; then recorded+=("${d##*/}"); else whole+=("${d##*/}"); fi
    done
    ((${#names[@]})) || { echo "nothing to send"; return; }
    if ((${#recorded[@]})); then
        mapfile -t -O "${#whole[@]}" whole < <(cd "$W/runs" && {
            grep -l '"status": "PASS"' "${recorded[@]/%//record.json}" 2>/dev/null | xargs -rn1 dirname
            printf '%s\n' "${recorded[@]}"
        } | awk '!seen[$0]++' | head -n "${SEND_FULL:-2}")
    fi
    tag=$(date -u +%H%M%S)
    local tarball=$W/send-$tag.tar
    ((${#recorded[@]})) && tar cf "$tarball" -C "$W/runs" --exclude='*/exchanges.jsonl' "${recorded[@]}"
    ((${#whole[@]})) && tar rf "$tarball" -C "$W/runs" "${whole[@]}"
    xz -T0 -6 --block-size=8MiB -c "$tarball" | split -b 15M -a 1 - "$OUT/runs-$tag.tar.xz.part-"
    rm -f "$tarball"
    for d in "${names[@]}"; do touch "$W/sent/$d"; done
    echo "sent ${#names[@]} (whole: ${whole[*]:-none}): ${names[*]}"
    ls -la "$OUT"
}

for step in "$@"; do
    echo "== $step ($(left) s left)"
    case "$step" in
    start) start ;;
    start-all) start_all ;;
    measure) measure ;;
    measure2) measure2 ;;
    start-v2) start_v2 ;;
    verdicts) verdicts ;;
    start-v3) start_v3 ;;
    v3) v3 ;;
    start-v4) start_v4 "$V4_SPECS" ;;
    v4) v4 "$V4_SPECS" ;;
    start-v5) start_v4 "$V5_SPECS" ;;
    start-load) start_load "$LOAD_SPECS" ;;
    load) load_step "$LOAD_SPECS" ;;
    loadsum) load_sum "$LOAD_SPECS" ;;
    loadlogs) # the load servers' logs (fired lines, scheduling, preemptions) as one xz tarball
        (cd "$W/logs" && tar cf - ./*load* 2>/dev/null) | xz -T0 -6 >"$OUT/load-logs.tar.xz"
        ls -la "$OUT" ;;
    v5) v4 "$V5_SPECS" ;;
    start-oh) start_oh ;;
    oh) oh ;;
    send) send ;;
    onegpu) onegpu ;;
    kernels) (cd "$W/bb" && python3 -m servers.gpu.compare_kernels --seeds "${KERNEL_SEEDS:-200}") ;;
    probe) probe_step ;;
    clean) clean ;;
    faults) faults ;;
    *) echo "unknown step $step" >&2; exit 3 ;;
    esac
done
