#!/usr/bin/env bash
# Run device tests with the C shim built under AddressSanitizer (issue 7: "run the shim under
# AddressSanitizer once in CI").  The ASan build goes to build/asan/ (a copy of the package with its
# own _core, _completions, _posts and _streamcore extensions); the editable install in .venv is not touched.  Python itself is not
# instrumented: libasan is preloaded, leak detection is off (CPython keeps memory until exit),
# and any heap overflow, use-after-free or double free in the shim aborts the run (non-zero).
#
#   scripts/asan.sh [PYTEST ARGS...]     default: tests/test_misuse.py tests/test_rdma.py tests/test_evd.py tests/test_wakeups.py tests/test_delivery_modes.py tests/test_lifetimes.py tests/test_connection_rules.py tests/test_hot_paths_c.py tests/test_batch_posts_c.py tests/test_srq_c.py tests/test_srq.py tests/test_streams.py tests/test_stream_c_steps.py tests/test_stream_protocol.py tests/test_out_of_memory.py
#
# Needs a device: run it under the test bed, e.g.
#   .venv/bin/aiodat rxe run -- scripts/asan.sh            (scripts/test.sh does this as its last stage)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=build/asan/pkg
if [ "${AIODAT_ASAN_SKIP_BUILD:-0}" != 1 ]; then
  rm -rf "$OUT" && mkdir -p "$OUT"
  tar -C . --exclude='__pycache__' --exclude='*.so' --exclude='build' -cf - aiodat | tar -C "$OUT" -xf -
  "$PY" - "$OUT" <<'PYEOF'
import sys
from pathlib import Path
from cffi import FFI
out = Path(sys.argv[1]).resolve()
shim = out / "aiodat" / "_shim"
sys.path.insert(0, str(shim))
from build_shim import cdef_text  # noqa: E402
ffi = FFI()
ffi.cdef(cdef_text((shim / "shim.h").read_text()))
ffi.set_source("aiodat._shim._core", '#include "shim.c"', include_dirs=[str(shim)],
               libraries=["ibverbs", "rdmacm"],
               extra_compile_args=["-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer",
                                   "-Wall", "-Wno-unused-function"],
               extra_link_args=["-fsanitize=address"])
so = ffi.compile(tmpdir=str(out), verbose=False)
print("ASan shim:", so)
# the hot-path modules (plain C, limited API), with the same instrumentation
import subprocess, sysconfig  # noqa: E402
for name in ("completions", "posts", "streamcore"):
    target = shim / f"_{name}.abi3.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer",
                    "-Wall", "-I" + sysconfig.get_paths()["include"], "-I" + str(shim), str(shim / f"{name}.c"),
                    "-o", str(target)], check=True)
    print("ASan hot path:", target)
PYEOF
fi
[ "${AIODAT_ASAN_BUILD_ONLY:-0}" = 1 ] && exit 0
LIBASAN=$(gcc -print-file-name=libasan.so)
[ -f "$LIBASAN" ] || { echo "asan.sh: libasan not found (apt-get install gcc)" >&2; exit 1; }
export LD_PRELOAD="$LIBASAN"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:verify_asan_link_order=0:${ASAN_OPTIONS:-}"
export PYTHONPATH="$PWD/$OUT${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -P -c 'import aiodat, sys; f = aiodat._lib.__file__; assert "/build/asan/" in f, f; print("aiodat from", f)'
if [ $# -eq 0 ]; then
  set -- tests/test_misuse.py tests/test_rdma.py tests/test_evd.py tests/test_wakeups.py tests/test_delivery_modes.py tests/test_lifetimes.py tests/test_connection_rules.py tests/test_hot_paths_c.py tests/test_batch_posts_c.py tests/test_srq_c.py tests/test_srq.py tests/test_streams.py tests/test_stream_c_steps.py tests/test_stream_protocol.py tests/test_out_of_memory.py
fi
# (host-only tests of these files run too: tests/test_stream_c_steps.py drives streamcore.c's every case)
exec "$PY" -P -m pytest -q -p no:cacheprovider -m "not hosts2" "$@"
