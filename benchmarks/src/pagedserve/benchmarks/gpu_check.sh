#!/usr/bin/env bash
# One check of pagedserve on a CUDA GPU in under 8 minutes (benchmarks/README.md, "GPU check"):
# kernel tests compiled on CUDA, engine exactness in fp32 and bf16, decode-attention bandwidth,
# offline throughput against transformers. Prints one table, writes <out>/gpu_check.json.
#
#   benchmarks/src/pagedserve/benchmarks/gpu_check.sh [--wheels DIR] [--python PY] [--dry-run] [--out DIR] [--only STEP...]
#
# The machine brings its own torch, triton and transformers and needs no network: pure-Python
# packages it lacks (structlog, pytest, ...: `python -m pagedserve.benchmarks.gpu_check --missing-packages`
# lists them) are installed from the wheels in DIR (default: .whl in the repository root, or
# $PAGEDSERVE_WHEELS) into a temporary folder, never into the machine's own environment.
# --dry-run runs nothing on a GPU: it prints the plan and checks imports and arguments.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
wheels="${PAGEDSERVE_WHEELS:-$root/.whl}"
args=()
while (($#)); do
    case "$1" in
        --wheels) wheels="$2"; shift 2 ;;
        --python) python="$2"; shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done

cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
read -r -a missing <<<"$("$python" -m pagedserve.benchmarks.gpu_check --missing-packages)"
if ((${#missing[@]})); then
    if [[ -d $wheels ]]; then
        site="$(mktemp -d "${TMPDIR:-/tmp}/pagedserve-gpu-check-site.XXXXXX")"
        echo "installing ${missing[*]} from $wheels into $site" >&2
        "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
            --find-links "$wheels" --target "$site" "${missing[@]}"
        export PYTHONPATH="$site:$PYTHONPATH"
    else
        echo "missing packages: ${missing[*]}; put their wheels in $wheels (or pass --wheels DIR)" >&2
        # A dry run goes on to list every problem; a real run would only fail later, step by step.
        [[ " ${args[*]} " == *" --dry-run "* ]] || exit 2
    fi
fi
exec "$python" -m pagedserve.benchmarks.gpu_check "${args[@]}"
