"""setuptools shim: the C extension is declared through cffi_modules here."""
from setuptools import setup
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


setup(cffi_modules=["aiodat/_shim/build_shim.py:ffibuilder"], cmdclass={"build_ext": BuildExtWithoutRpath})
