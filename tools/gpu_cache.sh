# Sourced by the device scripts: keeps Triton's compiled kernels from one device call to the next.
# A call compiles dozens of kernels (seconds each); carrying them back saves that time when the
# next call runs the same kernel code on the same image (the cache key covers source, options,
# target and compiler, so anything changed is compiled again).
#   cache_restore   at the start: .tcache/triton-cache.tgz (carried) -> $TRITON_CACHE_DIR
#   cache_save      at the end:   compiled binaries -> $OUT/triton-cache.tgz (under 15 MB)
# Here, after a call: bash tools/gpu_cache.sh fetch FILES_AT  (copies it into .tcache, ignored;
# kept packed: the cubins are ~4x larger unpacked, and a call carries 64 MiB at most).
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}

cache_restore() {
  mkdir -p "$TRITON_CACHE_DIR"
  # entries name their files by absolute path: they go back to the same place
  [ -f .tcache/triton-cache.tgz ] && tar xzf .tcache/triton-cache.tgz -C / 2>/dev/null
  echo "triton cache: $(find "$TRITON_CACHE_DIR" -name '*.cubin' | wc -l) kernels restored"
}

cache_save() {
  # the intermediate forms are not needed to launch a kernel; the binary and metadata are
  find "$TRITON_CACHE_DIR" \( -name '*.ttir' -o -name '*.ttgir' -o -name '*.llir' -o -name '*.ptx' \
    -o -name '*.source' \) -delete 2>/dev/null
  tar czf /tmp/triton-cache.tgz -C / "${TRITON_CACHE_DIR#/}" 2>/dev/null || return 0
  if [ "$(stat -c %s /tmp/triton-cache.tgz)" -lt 15000000 ]; then
    cp /tmp/triton-cache.tgz "$OUT/"
  fi
}

# run (not sourced) here: keep a call's returned cache for the next call to carry
if [ "${BASH_SOURCE[0]}" = "$0" ] && [ "${1:-}" = fetch ]; then
  [ -f "$2/triton-cache.tgz" ] || { echo "no triton-cache.tgz in $2"; exit 1; }
  rm -rf .tcache && mkdir -p .tcache && cp "$2/triton-cache.tgz" .tcache/
  echo "$(tar tzf .tcache/triton-cache.tgz | grep -c '\.cubin$') kernels in .tcache (carry it)"
fi
