#!/usr/bin/env bash
# Assembles what the lent GPU machine needs into <checkout>/.gpu/{p1,p2,p3} ({p1..p4} with BBGPU_FAST=1), one folder per device call
# (each call carries at most 64 MiB with the working tree). Run here, from the worktree whose code should run:
#
#   servers/gpu/assemble.sh CHECKOUT          # the checkout the device tool sends
#
# p1, p2: vLLM 0.26.0 (the only release pinning torch 2.11.0, the device image's) without the FA2 library
#         (Hopper runs FA3) and the vllm-rs binary: 377 MB unpacked, ~108 MiB as .tar.xz, split in two halves
#         (~54 MiB each, so that the working tree, ~5 MB, fits beside one in a 64 MiB call).
# p3:     the dependency wheels of servers/gpu/wheels.txt, this worktree's files (bb.tar), and the tiny
#         models (CPU and GPU variants) built here.
# BBGPU_FAST=1: gzip -1 instead of xz -9 (seconds instead of 20+ minutes on a loaded 2-core machine, 161 MiB):
#         the vLLM tarball in three parts p1-p3 and the rest in p4, one more carrying call (device.sh install takes
#         either).
# Needs network for pip (first run only; downloads are kept in $BBGPU_BUILD).
set -euo pipefail
checkout=${1:?usage: assemble.sh CHECKOUT}
here=$(cd "$(dirname "$0")/../.." && pwd)
build=${BBGPU_BUILD:-/tmp/bbgpu-build}
py=${PYTHON:-$here/../main/.venv/bin/python}
[ -x "$py" ] || py=python3
mkdir -p "$build/whl" "$build/vllm"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 \
    manylinux1_x86_64 manylinux_2_5_x86_64; do platforms+=(--platform "$p"); done
pipdl() { "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" "$@"; }

fast=${BBGPU_FAST:-0}
if ((fast)); then ext=gz; pack=(gzip -1); else ext=xz; pack=(xz -T2 -9); fi
tarball="$build/vllm-0.26.0-nofa2.tar.$ext"
if [ ! -f "$tarball" ]; then
    [ -d "$build/repack/vllm" ] || {
        pipdl -d "$build/vllm" vllm==0.26.0
        rm -rf "$build/repack" && mkdir "$build/repack"
        (cd "$build/repack" && unzip -q "$build"/vllm/vllm-0.26.0-*.whl &&
            rm vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs)
    }
    (cd "$build/repack" && tar cf - vllm vllm-0.26.0.dist-info | "${pack[@]}" >"$tarball.tmp") &&
        mv "$tarball.tmp" "$tarball"
fi
if [ "$(ls "$build/whl" | wc -l)" -lt "$(grep -vc '^#' "$here/servers/gpu/wheels.txt")" ]; then
    # shellcheck disable=SC2046
    pipdl -d "$build/whl" $(grep -v '^#' "$here/servers/gpu/wheels.txt")
fi

out="$checkout/.gpu"
exclude="$(git -C "$checkout" rev-parse --git-common-dir)/info/exclude"
case "$exclude" in /*) ;; *) exclude="$checkout/$exclude" ;; esac
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >>"$exclude"
parts=2
((fast)) && parts=3
last="$out/p$((parts + 1))"
rm -rf "$out" && mkdir -p "$last/whl" "$last/models"
rm -f "$build"/vllm.tar.*.part-*
# Equal parts of the tarball (~54 MiB each, so that the working tree fits beside one in a 64 MiB call).
split -n "$parts" -a 2 "$tarball" "$build/vllm.tar.$ext.part-"
i=0
for f in "$build"/vllm.tar."$ext".part-*; do
    i=$((i + 1))
    mkdir -p "$out/p$i" && mv "$f" "$out/p$i/"
done
if (($(du -m "$out/p1/"* | cut -f1) > 56)); then
    echo "a vLLM part is over 56 MiB: the working tree may not fit beside it (drop more from the wheel)" >&2
    exit 1
fi
cp "$build"/whl/*.whl "$last/whl/"
(cd "$here" && git ls-files -co --exclude-standard -z | xargs -0 tar cf "$last/bb.tar")
(cd "$here" && PYTHONPATH="$here" "$py" -m servers.tiny_model --out "$last/models" >/dev/null &&
    PYTHONPATH="$here" "$py" -m servers.tiny_model --out "$last/models" --variant gpu >/dev/null)
du -sh "$out"/p*
