#!/usr/bin/env bash
# Builds the op library with Bazel against the TensorFlow of a Python interpreter and prints the
# absolute path of the built library (the only line on stdout; everything else goes to stderr):
#
#   .ci/bazel_build.sh [PYTHON]        # PYTHON: argument, else $TF_PYTHON, else python3 on PATH
#   GF_TF_BAZEL_LIBRARY=$(.ci/bazel_build.sh /path/to/venv/bin/python)
#
# Installs Debian's bazel-bootstrap (Bazel 4.2.3, the only Bazel the package registries offer) and a
# JDK with apt-get if they are missing. The build is offline (see .bazelrc and WORKSPACE); the Bazel
# server is shut down at the end, also on failure.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { echo "[bazel_build] $*" >&2; }

python="${1:-${TF_PYTHON:-$(command -v python3 || true)}}"
if [[ -z "$python" ]]; then
    log "no Python given and none on PATH; usage: $0 /path/to/python (with TensorFlow installed)"
    exit 2
fi
python="$(command -v "$python" || echo "$python")"
if ! TF_CPP_MIN_LOG_LEVEL=3 "$python" -c "import tensorflow" 2>/dev/null; then
    log "'$python' cannot import tensorflow; pass the interpreter of the environment the library is for"
    exit 2
fi

as_root() { if [[ "$(id -u)" == 0 ]]; then "$@"; else sudo "$@"; fi; }
missing=()
command -v bazel >/dev/null || missing+=(bazel-bootstrap)
command -v java >/dev/null || missing+=(default-jdk-headless)
if (( ${#missing[@]} )); then
    log "installing ${missing[*]} with apt-get"
    start=$SECONDS
    as_root apt-get update -q >&2
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
    log "apt-get took $((SECONDS - start)) s"
fi

cd "$repo"
trap 'bazel shutdown >&2 2>/dev/null || true' EXIT
start=$SECONDS
bazel build --repo_env=TF_PYTHON="$python" //:_gf_tf_ops.so >&2
log "bazel build took $((SECONDS - start)) s"

library="$(readlink -f "$repo/bazel-bin/_gf_tf_ops.so")"
if [[ ! -f "$library" ]]; then
    log "bazel reported success but $repo/bazel-bin/_gf_tf_ops.so does not exist"
    exit 1
fi
echo "$library"
