#!/usr/bin/env bash
# gb10d against a real vLLM 0.23.0 running its model through Ray, on a machine with an NVIDIA GPU (not part of CI).
#
# Expects one tar of the vLLM wheel, the Ray wheel (ray/) and vLLM's missing dependencies (deps/),
# split into parts: all but the last copied earlier to $HOME/stash, the last carried as .gpu/part*;
# and gb10d's own dependencies as wheels in .gpu/gb10d-deps. Writes report.json, notify.json,
# journal.txt and raw.tar.gz to $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/real-vllm-ray-out}
mkdir -p "$OUT"
site=$HOME/site
if [ ! -d "$site/vllm" ]; then
    mkdir -p "$HOME/wheels"
    cp .gpu/part* "$HOME/stash/"
    cat "$HOME"/stash/part* | tar xf - -C "$HOME/wheels"
    own=(); for w in .gpu/gb10d-deps/*.whl; do [ -e "$HOME/wheels/deps/${w##*/}" ] || own+=("$w"); done
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
        "$HOME"/wheels/deps/*.whl "${own[@]}" "$HOME"/wheels/ray/*.whl "$HOME"/wheels/vllm-0.23.0-*.whl
fi
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 PATH=$site/bin:$PATH
[ -d "$HOME/tiny" ] || python3 tests/gpu/mkmodel.py "$HOME/tiny"
python3 -c 'import vllm, ray, torch; print("vllm", vllm.__version__, "ray", ray.__version__, "torch", torch.__version__, torch.cuda.get_device_name(0))'
python3 tests/gpu/real_vllm_ray.py --model "$HOME/tiny" --out "$OUT" 2>&1 | tee "$OUT/driver.log"
