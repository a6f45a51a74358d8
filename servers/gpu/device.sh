#!/usr/bin/env bash
# Runs on the lent GPU machine (see docs/gpu.md), from the root of the repo copy the device tool sends.
# Everything it installs or writes lives under $W (/tmp/bbgpu), which survives between calls while the machine
# stays warm; the carried folder .gpu/ does not, so `stash` copies it there first.
#
#   servers/gpu/device.sh stash                     copy .gpu/* to $W/stash (one call per carried part)
#   servers/gpu/device.sh install                   vLLM + dependency wheels + this branch into $W
#   servers/gpu/device.sh serve NAME ROLE PORT [--fault F] [--model DIR] [-- vLLM args]
#                                                   one server through servers.launch, detached (setsid)
#   servers/gpu/device.sh wait SECONDS PORT...      until each answers /health (or it exited, or time is up)
#   servers/gpu/device.sh blackbox NAME ARGS...     `blackbox run ARGS --out $W/runs/NAME`, output in $W/logs
#   servers/gpu/device.sh pack                      run folders and logs into $OUT (xz tarballs)
set -uo pipefail
W=${BBGPU_DIR:-/tmp/bbgpu}
export PYTHONPATH="$W/bb:$W/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export TRITON_CACHE_DIR="$W/cache/triton" VLLM_CACHE_ROOT="$W/cache/vllm" TORCHINDUCTOR_CACHE_DIR="$W/cache/inductor"
# Dynamo recompiles go to the server logs: a crawl from recompiling shows there.
# Nine servers compile at once on 16 cores: fewer inductor workers each.
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-4}
export TORCH_LOGS="${TORCH_LOGS:-recompiles}"
# Multicast stays off on these hosts (KINDS.md); set again in case a caller cleared it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$W"/{stash,site,bb,logs,runs,cache}
stamp() { echo "[$(date -u +%H:%M:%S) +${SECONDS}s] $*"; }

cmd=${1:?usage: device.sh stash|install|serve|wait|blackbox|pack}
shift
case "$cmd" in
stash)
    cp -r .gpu/. "$W/stash/" && du -sh "$W/stash" && ls "$W/stash"
    ;;
install)
    stamp install start
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" \
        "$W"/stash/*/whl/*.whl 2>&1 | grep -v "already exists" || true
    # The vLLM tarball's parts, in order (p1, p2, ...): xz, or gzip (assemble.sh BBGPU_FAST=1).
    if compgen -G "$W/stash/*/vllm.tar.gz.part-*" >/dev/null; then
        cat "$W"/stash/*/vllm.tar.gz.part-* | gzip -d | tar x -C "$W/site" || exit 1
    else
        cat "$W"/stash/*/vllm.tar.xz.part-* | xz -d -T0 | tar x -C "$W/site" || exit 1
    fi
    tar xf "$W"/stash/*/bb.tar -C "$W/bb" || exit 1
    # An entry point for vLLM's plugin loader (the repo is on PYTHONPATH, not pip-installed).
    info="$W/site/blackbox-0.1.0.dist-info"
    mkdir -p "$info"
    printf 'Metadata-Version: 2.1\nName: blackbox\nVersion: 0.1.0\n' >"$info/METADATA"
    # servers.gpu.diag: SIGUSR1 dumps every thread's stack into the server log (for a server that crawls).
    printf '[vllm.general_plugins]\nblackbox = servers.vllm_plugin:register\nblackbox_diag = servers.gpu.diag:register\n' \
        >"$info/entry_points.txt"
    mkdir -p "$W/models" && cp -r "$W"/stash/*/models/. "$W/models/"
    stamp install done
    python3 - <<'PY'
import importlib.metadata as md, torch, triton
import vllm.entrypoints.openai.api_server  # noqa: F401  (fails here rather than in four servers)
print("vllm", md.version("vllm"), "torch", torch.__version__, "triton", triton.__version__,
      "gpu", torch.cuda.get_device_name(0), "free GiB %.1f" % (torch.cuda.mem_get_info()[0] / 2**30))
print("plugins", [e.name for e in md.entry_points(group="vllm.general_plugins")])
PY
    stamp import checked
    ;;
serve)
    name=$1 role=$2 port=$3
    shift 3
    launch=()
    while (($#)); do
        case "$1" in
        --fault | --model) launch+=("$1" "$2"); shift 2 ;;
        --) shift; break ;;
        *) echo "serve: unknown option $1" >&2; exit 3 ;;
        esac
    done
    # Ports are base + the role's index, so the base is chosen to land on PORT.
    case "$role" in treatment) idx=0 ;; control) idx=1 ;; reference) idx=2 ;; *) echo "bad role $role" >&2; exit 3 ;; esac
    # Redirect the whole subshell: a shell left holding the caller's stdout would keep its pipe open.
    (cd "$W/bb" && exec setsid nohup python3 -m servers.launch --profile "${BBGPU_PROFILE:-gpu-tiny}" \
        --roles "$role" --base-port $((port - idx)) --cache-dir "$W/models" --log-dir "$W/logs/$name" \
        --timeout 1200 "${launch[@]}" -- "$@") >"$W/logs/$name.launch" 2>&1 </dev/null &
    stamp "serve $name ($role) on $port: $*"
    ;;
wait)
    limit=$1
    shift
    for port in "$@"; do
        until curl -sf -m 5 "http://127.0.0.1:$port/health" >/dev/null; do
            if ((SECONDS > limit)); then stamp "port $port not healthy by ${limit}s"; break; fi
            # A server that died at start-up (its launcher gave up) is not waited for; 60 s for it to appear.
            if ((SECONDS > 60)) && ! pgrep -f -- "--port $port( |$)" >/dev/null; then
                stamp "port $port: no server process"
                break
            fi
            sleep 2
        done
        curl -sf -m 5 "http://127.0.0.1:$port/health" >/dev/null && stamp "port $port healthy"
    done
    ;;
blackbox)
    name=$1
    shift
    stamp "blackbox $name: $*"
    (cd "$W/bb" && timeout "${BB_TIMEOUT:-400}" python3 -c 'import sys; from blackbox.cli import main; sys.exit(main())' \
        run "$@" --out "$W/runs/$name") >"$W/logs/blackbox-$name.out" 2>&1
    rc=$?
    stamp "blackbox $name exit $rc"
    tail -25 "$W/logs/blackbox-$name.out"
    ;;
pack)
    nvidia-smi >"$W/logs/nvidia-smi.txt" 2>&1
    for d in "$W"/logs/*/; do
        for f in "$d"*.log; do [ -f "$f" ] && grep -c "" "$f" | sed "s|^|$f lines: |"; done
    done
    tar cf - -C "$W" runs | xz -T0 -6 >"$OUT/runs.tar.xz"
    tar cf - -C "$W" logs | xz -T0 -6 >"$OUT/logs.tar.xz"
    ls -la "$OUT"
    ;;
*)
    echo "unknown command $cmd" >&2
    exit 3
    ;;
esac
