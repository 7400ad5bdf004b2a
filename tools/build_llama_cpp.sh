#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench and llama-quantize with CUDA
# (sm_90, H100/H200) from a stripped, offline source tarball.
#
# usage: bash tools/build_llama_cpp.sh SRC_TARBALL BUILD_DIR
#
#   SRC_TARBALL  tar.gz holding a top-level llama.cpp/ folder
#                (e.g. .llama/llama.cpp-src.tar.gz, git-ignored via .git/info/exclude)
#   BUILD_DIR    CMake build folder; binaries land in BUILD_DIR/bin/
#
# Idempotent: exits 0 at once when BUILD_DIR/bin/llama-server already exists.
# Resumable: the source is extracted to BUILD_DIR/_src and CMake is configured
# only once, so re-running after an interrupted build (e.g. a per-command time
# limit) continues compiling where it stopped.
#
# No network access is needed: the Web UI download/npm build, OpenSSL, tests,
# examples and the unified `llama` app are all switched off.
#
# Environment overrides:
#   CUDA_ARCH   CMAKE_CUDA_ARCHITECTURES (default 90)
#   JOBS        parallel build jobs     (default $(nproc))
#   EXTRA_CMAKE_ARGS  extra -D flags appended to the configure step
#   BUILD_TIMEOUT     seconds allowed for the compile step (unset: no limit).
#                     When it runs out the script exits 3 ("re-run to resume"),
#                     so a long CUDA build can be split over several commands
#                     that each fit a per-command time limit.
set -euo pipefail

if [[ $# -ne 2 ]]; then
    echo "usage: bash $0 SRC_TARBALL BUILD_DIR" >&2
    exit 2
fi

SRC_TARBALL=$1
BUILD_DIR=$2
CUDA_ARCH=${CUDA_ARCH:-90}
JOBS=${JOBS:-$(nproc)}

if [[ -x "$BUILD_DIR/bin/llama-server" ]]; then
    echo "[build_llama_cpp] $BUILD_DIR/bin/llama-server already exists; skipping build"
    exit 0
fi

if [[ ! -f "$SRC_TARBALL" ]]; then
    echo "[build_llama_cpp] source tarball not found: $SRC_TARBALL" >&2
    exit 1
fi

for tool in cmake tar; do
    command -v "$tool" >/dev/null 2>&1 || { echo "[build_llama_cpp] '$tool' not found" >&2; exit 1; }
done

# Locate nvcc: $CUDA_HOME, /usr/local/cuda, then PATH (a PATH nvcc may be a
# wrapper script, so the toolkit folders are preferred).
NVCC=""
for cand in ${CUDA_HOME:+"$CUDA_HOME/bin/nvcc"} /usr/local/cuda/bin/nvcc "$(command -v nvcc 2>/dev/null || true)"; do
    if [[ -n "$cand" && -x "$cand" ]]; then
        NVCC=$cand
        break
    fi
done
if [[ -z "$NVCC" ]]; then
    echo "[build_llama_cpp] nvcc not found (\$CUDA_HOME/bin, /usr/local/cuda/bin, PATH); a CUDA toolkit is required" >&2
    exit 1
fi
CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
have_cublas=0
for h in "$CUDA_ROOT"/include/cublas_v2.h "$CUDA_ROOT"/targets/*/include/cublas_v2.h /usr/include/cublas_v2.h; do
    if [[ -f "$h" ]]; then have_cublas=1; break; fi
done
if [[ $have_cublas -eq 0 ]]; then
    echo "[build_llama_cpp] warning: cublas_v2.h not found under $CUDA_ROOT; CMake will likely fail (ggml-cuda needs cuBLAS)" >&2
fi

SRC_TARBALL=$(readlink -f "$SRC_TARBALL")
mkdir -p "$BUILD_DIR"
BUILD_DIR=$(readlink -f "$BUILD_DIR")
SRC_ROOT="$BUILD_DIR/_src"
SRC_DIR="$SRC_ROOT/llama.cpp"

start=$(date +%s)

# 1. extract (once)
if [[ ! -f "$SRC_ROOT/.extracted" ]]; then
    echo "[build_llama_cpp] extracting $SRC_TARBALL -> $SRC_ROOT"
    rm -rf "$SRC_ROOT"
    mkdir -p "$SRC_ROOT"
    tar -xzf "$SRC_TARBALL" -C "$SRC_ROOT"
    [[ -f "$SRC_DIR/CMakeLists.txt" ]] || { echo "[build_llama_cpp] tarball has no llama.cpp/CMakeLists.txt" >&2; exit 1; }
    touch "$SRC_ROOT/.extracted"
fi

# Keep llama.cpp's git probing from picking up an enclosing repository
# (it would stamp that repo's commit/count into the build info).
export GIT_CEILING_DIRECTORIES="$SRC_ROOT"
LLAMA_COMMIT=unknown
if [[ -f "$SRC_DIR/SKIFF-ORIGIN.txt" ]]; then
    LLAMA_COMMIT=$(sed -n 's/^commit=//p' "$SRC_DIR/SKIFF-ORIGIN.txt" | head -n1)
    LLAMA_COMMIT=${LLAMA_COMMIT:-unknown}
fi

GENERATOR=()
if command -v ninja >/dev/null 2>&1; then
    GENERATOR=(-G Ninja)
fi

# 2. configure (once)
if [[ ! -f "$BUILD_DIR/CMakeCache.txt" ]]; then
    echo "[build_llama_cpp] configuring (CUDA arch $CUDA_ARCH, nvcc $NVCC)"
    # shellcheck disable=SC2086
    cmake -S "$SRC_DIR" -B "$BUILD_DIR" ${GENERATOR[@]+"${GENERATOR[@]}"} \
        -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CUDA_COMPILER="$NVCC" \
        -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" \
        -DGGML_NATIVE=OFF \
        -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_COMMIT="$LLAMA_COMMIT" \
        ${EXTRA_CMAKE_ARGS:-} \
        || { rm -f "$BUILD_DIR/CMakeCache.txt"; echo "[build_llama_cpp] configure failed" >&2; exit 1; }
fi

# 3. build
echo "[build_llama_cpp] building llama-server llama-bench llama-quantize with $JOBS jobs"
BUILD_CMD=(cmake --build "$BUILD_DIR" --config Release -j "$JOBS"
           --target llama-server llama-bench llama-quantize)
if [[ -n "${BUILD_TIMEOUT:-}" ]]; then
    BUILD_CMD=(timeout "$BUILD_TIMEOUT" "${BUILD_CMD[@]}")
fi
rc=0
"${BUILD_CMD[@]}" || rc=$?
if [[ $rc -eq 124 ]]; then
    echo "[build_llama_cpp] BUILD_TIMEOUT=${BUILD_TIMEOUT}s reached after $(( $(date +%s) - start ))s; re-run the same command to resume" >&2
    exit 3
elif [[ $rc -ne 0 ]]; then
    echo "[build_llama_cpp] build failed (rc=$rc) after $(( $(date +%s) - start ))s" >&2
    exit 1
fi

for b in llama-server llama-bench llama-quantize; do
    [[ -x "$BUILD_DIR/bin/$b" ]] || { echo "[build_llama_cpp] missing $BUILD_DIR/bin/$b" >&2; exit 1; }
done

echo "[build_llama_cpp] done in $(( $(date +%s) - start ))s: $BUILD_DIR/bin/{llama-server,llama-bench,llama-quantize}"
