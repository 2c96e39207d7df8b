"""setuptools shim: the cffi extension is declared through cffi_modules, the completions module
(plain C, limited API) as an ordinary extension."""
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExtWithoutRpath(build_ext):
    """``build_ext`` that links without the interpreter's own rpath.

    Interpreters built with ``--enable-shared`` and an rpath (pyenv's, for one) put
    ``-Wl,-rpath,<their lib dir>`` into sysconfig's LDSHARED, so the extension in a wheel
    would carry a RUNPATH into the build machine's filesystem, searched before the system's
    paths wherever it is installed.  It needs only libibverbs, librdmacm and libc, all on the
    loader's default paths (scripts/check_wheel.sh checks the wheel).  cffi_modules wraps
    this class (it extends whatever ``build_ext`` the distribution already has).
    """

    def build_extensions(self) -> None:
        self.compiler.linker_so = [
            arg for arg in self.compiler.linker_so
            if not (arg.startswith(("-Wl,-rpath", "-Wl,-R")) or arg == "-Wl,--enable-new-dtags")]
        super().build_extensions()


# the hot paths in plain C on the limited API (aiodat/_shim/completions.c, posts.c, streamcore.c): they need no
# library beyond the interpreter (verbs' post calls are inline)
HOT_PATHS = [Extension(f"aiodat._shim._{name}", [f"aiodat/_shim/{name}.c"], py_limited_api=True,
                       depends=["aiodat/_shim/pyattrs.h", "aiodat/_shim/postcommon.h", "aiodat/_shim/shim.h"],
                       extra_compile_args=["-O2", "-Wall"]) for name in ("completions", "posts", "streamcore")]

setup(cffi_modules=["aiodat/_shim/build_shim.py:ffibuilder"], ext_modules=HOT_PATHS,
      cmdclass={"build_ext": BuildExtWithoutRpath})
