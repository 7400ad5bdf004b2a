#!/usr/bin/env bash
# Packs the llama.cpp that llama-cpp-python's sdist vendors into a ~4 MB source tarball for the
# GPU machine (no network there, 64 MiB per call): only what a CUDA build of llama-server,
# llama-bench and llama-quantize needs. Build it there with tools/build_llama_cpp.sh.
#   bash tools/pack_llama_cpp.sh [OUT=.llama/llama.cpp-src.tar.gz]   (.llama/ stays out of git)
set -euo pipefail
OUT=$(realpath -m "${1:-.llama/llama.cpp-src.tar.gz}")
VERSION=0.3.36
COMMIT=0c1e57098  # the llama.cpp commit vendored in that sdist (its CHANGELOG)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work"
tar -xzf "$work"/llama_cpp_python-$VERSION.tar.gz -C "$work"
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
cd "$src"
rm -rf docs models media tests examples pocs benches conversion gguf-py grammars requirements \
  skills ci .github .devops tools/server/tests tools/server/bench
# scripts/: only the UI-assets CMake script, which the server's CMake runs even with the UI off
find scripts -type f ! -name ui-assets.cmake -delete
# tools/ui: CMake and templates only (the web sources are ~8 MB)
find tools/ui -type f ! -name CMakeLists.txt ! -name sources.cmake ! -name '*.in' -delete
find tools/mtmd -type f \( -name '*.jpg' -o -name '*.png' -o -name '*.mp3' -o -name '*.wav' \) -delete
for b in blas cann et hexagon hip metal musa opencl openvino rpc sycl virtgpu vulkan webgpu zdnn \
  zendnn; do rm -rf "ggml/src/ggml-$b"; done
printf 'Stripped llama.cpp source for Skiff benchmarks (tools/pack_llama_cpp.sh).\norigin=llama_cpp_python-%s sdist, vendor/llama.cpp\ncommit=%s\n' \
  "$VERSION" "$COMMIT" > SKIFF-ORIGIN.txt
mkdir -p "$(dirname "$OUT")"
tar -czf "$OUT" -C "$(dirname "$src")" llama.cpp
echo "$OUT: $(du -h "$OUT" | cut -f1), $(tar -tzf "$OUT" | wc -l) entries"
