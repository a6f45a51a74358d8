#!/usr/bin/env bash
# Assembles what the lent GPU machine needs into <checkout>/.gpu/{p1,p2,p3}, one folder per device call
# (each call carries at most 64 MiB with the working tree). Run here, from the worktree whose code should run:
#
#   servers/gpu/assemble.sh CHECKOUT          # the checkout the device tool sends
#
# p1, p2: vLLM 0.26.0 (the only release pinning torch 2.11.0, the device image's) without the FA2 library
#         (Hopper runs FA3) and the vllm-rs binary: 377 MB unpacked, ~108 MiB as .tar.xz, split in two halves
#         (~54 MiB each, so that the working tree, ~5 MB, fits beside one in a 64 MiB call).
# p3:     the dependency wheels of servers/gpu/wheels.txt, this worktree's files (bb.tar), and the tiny
#         models (CPU and GPU variants) built here.
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

if [ ! -f "$build/vllm-0.26.0-nofa2.tar.xz" ]; then
    pipdl -d "$build/vllm" vllm==0.26.0
    rm -rf "$build/repack" && mkdir "$build/repack"
    (cd "$build/repack" && unzip -q "$build"/vllm/vllm-0.26.0-*.whl &&
        rm vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs &&
        tar cf - vllm vllm-0.26.0.dist-info | xz -T2 -9 >"$build/vllm-0.26.0-nofa2.tar.xz")
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
rm -rf "$out" && mkdir -p "$out/p1" "$out/p2" "$out/p3/whl" "$out/p3/models"
split -n 2 -a 2 "$build/vllm-0.26.0-nofa2.tar.xz" "$build/vllm.tar.xz.part-"  # two halves: the working tree travels too
mv "$build/vllm.tar.xz.part-aa" "$out/p1/"
mv "$build/vllm.tar.xz.part-ab" "$out/p2/"
if [ -e "$build/vllm.tar.xz.part-ac" ]; then
    echo "the vLLM tarball needs a third 60 MiB part: add a p4 call (or drop more from the wheel)" >&2
    exit 1
fi
cp "$build"/whl/*.whl "$out/p3/whl/"
(cd "$here" && git ls-files -co --exclude-standard -z | xargs -0 tar cf "$out/p3/bb.tar")
(cd "$here" && PYTHONPATH="$here" "$py" -m servers.tiny_model --out "$out/p3/models" >/dev/null &&
    PYTHONPATH="$here" "$py" -m servers.tiny_model --out "$out/p3/models" --variant gpu >/dev/null)
du -sh "$out"/p*
