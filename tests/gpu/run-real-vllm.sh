#!/usr/bin/env bash
# gb10d against a real vLLM on a machine with an NVIDIA GPU (not part of CI, which has none).
#
# Usage: run-real-vllm.sh [checks|upgrade|sleep|install]   (VLLM_VERSION, default 0.23.0, names the release)
#   checks:  tests/gpu/real_vllm.py, the six checks (free memory, kills, stop, replay);
#   upgrade: tests/gpu/real_vllm_upgrade.py, a reload to a broken candidate venv and back, then, with
#            NEXT_VERSION set, a reload to that release's venv, which must become the good program;
#   sleep:   tests/gpu/real_vllm_sleep.py, two models of different sizes swapping by sleep through gb10d front,
#            then one wake whose reload_weights is skipped inside vLLM;
#   install: the venvs only.
# Expects, as docs/REAL_VLLM.md describes: each release's wheel in parts (its file name, then .partNN) under
# $HOME/stash, vLLM's missing dependencies as wheels in $WHEELS/deps and gb10d's own in
# $WHEELS/gb10d-deps (WHEELS defaults to .gpu, carried with the tree). Each release goes into a venv of
# its own, $HOME/vllm-VERSION, which sees the machine's PyTorch through a .pth file; gb10d's
# dependencies go into $HOME/gb10d-site, so that nothing on gb10d's PYTHONPATH can import vLLM.
# Writes report.json, notify.json, journal.txt (and raw.tar.gz or programs.toml) to $OUT (sleep: a notify and a journal
# per instance, and the front's output).
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-checks}
version=${VLLM_VERSION:-0.23.0}
wheels=${WHEELS:-.gpu}
OUT=${OUT:-$PWD/real-vllm-out}
mkdir -p "$OUT"
gbsite=$HOME/gb10d-site

install_vllm() {  # the venv $HOME/vllm-$1 with that release and its dependencies
    local venv=$HOME/vllm-$1 site wheel torch_site parts
    if [ ! -x "$venv/bin/vllm" ]; then
        torch_site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
        python3 -m venv --without-pip "$venv"
        site=$(echo "$venv"/lib/python3*/site-packages)
        echo "$torch_site" > "$site/machine-torch.pth"
        parts=("$HOME/stash/vllm-$1-"*.whl.part*)
        wheel=${parts[0]%.part*}
        cat "${parts[@]}" > "$wheel"
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/deps/*.whl "$wheel"
        printf '#!%s\nimport sys\nfrom vllm.entrypoints.cli.main import main\nif __name__ == "__main__":\n    sys.argv[0] = "vllm"\n    sys.exit(main())\n' \
            "$venv/bin/python3" > "$venv/bin/vllm"
        chmod 755 "$venv/bin/vllm"
    fi
    "$venv/bin/python3" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__, torch.cuda.get_device_name(0))'
}

install_vllm "$version"
[ -z "${NEXT_VERSION:-}" ] || install_vllm "$NEXT_VERSION"
[ -d "$gbsite/sdnotify" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$gbsite" "$wheels"/gb10d-deps/*.whl
[ "$mode" != install ] || exit 0
[ -d "$HOME/tiny" ] || python3 tests/gpu/mkmodel.py "$HOME/tiny"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=$gbsite:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
venv=$HOME/vllm-$version
if [ "$mode" = upgrade ]; then
    next=(); [ -z "${NEXT_VERSION:-}" ] || next=(--next-venv "$HOME/vllm-$NEXT_VERSION" --next-version "$NEXT_VERSION")
    python3 tests/gpu/real_vllm_upgrade.py --model "$HOME/tiny" --out "$OUT" --good-venv "$venv" --version "$version" \
        "${next[@]}" 2>&1 | tee "$OUT/driver.log"
elif [ "$mode" = sleep ]; then
    [ -d "$HOME/large" ] || python3 tests/gpu/mkmodel.py "$HOME/large" 1024 16 100MB
    # SIGINT before the machine's own limit: the driver still writes the journals of a run cut short.
    timeout -s INT "${DRIVER_TIMEOUT_S:-3000}" python3 tests/gpu/real_vllm_sleep.py --model "$HOME/tiny" --large-model "$HOME/large" --out "$OUT" \
        --program "$venv/bin/python3 $venv/bin/vllm" 2>&1 | tee "$OUT/driver.log"
else
    python3 tests/gpu/real_vllm.py --model "$HOME/tiny" --out "$OUT" --program "$venv/bin/python3 $venv/bin/vllm" \
        --hold-gib "${HOLD_GIB:-100}" 2>&1 | tee "$OUT/driver.log"
fi
