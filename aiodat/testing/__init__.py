"""aiodat.testing: the pytest plugin (``aiodat.testing.plugin``); the rxe test bed is :mod:`aiodat.testbed`."""
