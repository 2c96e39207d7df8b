"""Framework integrations over aiodat streams: aiohttp, httpx, grpclib and Dask distributed.

Each lives in its own module and imports its framework only when that module is
imported, so ``import aiodat`` never needs them.  Install them as extras:
``pip install aiodat[aiohttp]`` (or ``[httpx]``, ``[grpclib]``, ``[dask]``, ``[integrations]``).
"""
