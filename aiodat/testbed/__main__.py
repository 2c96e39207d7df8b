"""``python -m aiodat.testbed status | run ... -- CMD``; also ``python3 aiodat/testbed ...`` before the
C extension is built (``-m`` imports ``aiodat/__init__.py``, which loads it)."""
import sys

if __package__:
    from .command import main
else:
    # Run as a directory: load this package under a name of its own, so that
    # aiodat/__init__.py never runs (its relative imports keep working).
    import importlib.util
    import os

    _here = os.path.dirname(os.path.abspath(__file__))
    _spec = importlib.util.spec_from_file_location(
        "_aiodat_testbed", os.path.join(_here, "__init__.py"), submodule_search_locations=[_here])
    assert _spec is not None and _spec.loader is not None
    _pkg = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _pkg
    _spec.loader.exec_module(_pkg)
    main = _pkg.main

sys.exit(main(sys.argv[1:]))
