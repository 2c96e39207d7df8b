"""setuptools shim: the C extension is declared through cffi_modules here."""
from setuptools import setup

setup(cffi_modules=["aiodat/_shim/build_shim.py:ffibuilder"])
