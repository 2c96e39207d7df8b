"""aiodat.testing: the rxe test bed and the pytest plugin."""
