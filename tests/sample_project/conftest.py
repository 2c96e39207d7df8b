"""Only for living inside aiodat's source tree: aiodat's own pytest run must not collect this
project (tests/test_sample_project.py runs it in a venv of its own).  A real project has no
need of this file."""
from pathlib import Path

HERE = Path(__file__).resolve().parent


def pytest_ignore_collect(collection_path: Path, config) -> "bool | None":
    """Ignore everything here unless pytest runs with this project as its rootdir."""
    return True if Path(config.rootpath).resolve() != HERE else None
