"""Build script for the C shim (cffi API mode), run by setuptools' ``cffi_modules``.

It compiles ``shim.c`` against the system's libibverbs and librdmacm into the
extension module ``aiodat._shim._core``.  ``shim.h`` holds the declarations:
its ``#else`` branch of ``AIODAT_CFFI_CDEF`` and its common tail are what cffi
parses.  Needs the Debian packages libibverbs-dev and librdmacm-dev.
"""
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent


def cdef_text(header: str) -> str:
    """Return the part of shim.h meant for cffi: drop the C-only branch."""
    out, skipping = [], False
    for line in header.splitlines():
        stripped = line.strip()
        if stripped == "#ifndef AIODAT_CFFI_CDEF":
            skipping = True
        elif stripped.startswith("#else") and "AIODAT_CFFI_CDEF" in stripped:
            skipping = False
        elif stripped.startswith("#endif") and "AIODAT_CFFI_CDEF" in stripped:
            pass
        elif not skipping:
            out.append(line)
    return "\n".join(out)


ffibuilder = FFI()
ffibuilder.cdef(cdef_text((HERE / "shim.h").read_text()))
ffibuilder.set_source(
    "aiodat._shim._core",
    '#include "shim.c"',
    include_dirs=[str(HERE)],
    # the source is an #include: name it, or an edit of shim.c alone would not rebuild the module
    depends=[str(HERE / "shim.c"), str(HERE / "shim.h"), str(HERE / "postcommon.h")],
    libraries=["ibverbs", "rdmacm"],
    extra_compile_args=["-O2", "-Wall", "-Wno-unused-function"],
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=str(HERE / "build"), verbose=False)
