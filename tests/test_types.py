"""The type hints (py.typed) as a user's type checker sees them: mypy on the package and examples/,
and on a program written against the public API.  Host-only: mypy reads the sources, runs nothing."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

mypy_api = pytest.importorskip("mypy.api", reason="mypy is in the [test] extra: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parent.parent


def run_mypy(*args: str) -> "tuple[str, int]":
    out, err, status = mypy_api.run(["--config-file", str(ROOT / "pyproject.toml"), "--no-incremental", *args])
    return out + err, status


def test_package_and_examples_type_check() -> None:
    """pyproject.toml's [tool.mypy] files: aiodat and examples/, with no error."""
    out, status = run_mypy(str(ROOT / "aiodat"), str(ROOT / "examples"))
    assert status == 0, out


USER_PROGRAM = '''
    from typing import List
    from typing_extensions import assert_type

    import aiodat
    from aiodat import EVD, ConnectionEvent, ConnectionRequestEvent, DTOCompletionEvent, Event, EvdFlags


    async def serve(ia: aiodat.IA) -> None:
        dto = ia.create_evd(8, EvdFlags.DTO)
        assert_type(dto, EVD[DTOCompletionEvent])
        done = await dto.wait_one()
        done.raise_for_status()  # an EVD of one stream yields that stream's events
        assert_type(done.ep, aiodat.EP)
        assert_type(done.operation, aiodat.DTOOp)
        assert_type(await dto.wait(2), List[DTOCompletionEvent])
        cr_evd = ia.create_evd(8, EvdFlags.CR)
        request = await cr_evd.wait_one()
        assert_type(request, ConnectionRequestEvent)
        await request.cr.accept(ia.create_ep(ia.create_pz()))
        changed = ia.create_evd(8, EvdFlags.CONNECTION).dequeue()
        assert_type(changed, "ConnectionEvent | None")
        if changed is not None:
            assert_type(changed.ep, aiodat.EP)
        mixed = ia.create_evd(8, EvdFlags.DTO | EvdFlags.CONNECTION)
        assert_type(mixed, EVD[Event])
        async for event in mixed:
            if isinstance(event, DTOCompletionEvent):
                event.raise_for_status()
        first = await mixed.wait_one()
        first.raise_for_status()  # error: a mixed EVD's event must be narrowed first
'''


def test_a_user_program_sees_each_evd_s_events(tmp_path: Path) -> None:
    """An EVD of one stream is typed by its events; one of several yields Event, to be narrowed:
    exactly one error, on the line that skips the narrowing."""
    source = textwrap.dedent(USER_PROGRAM)
    wrong = next(n for n, line in enumerate(source.splitlines(), 1) if "# error:" in line)
    program = tmp_path / "user_program.py"
    program.write_text(source)
    out, status = run_mypy(str(program))
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert status == 1 and len(errors) == 1, out
    assert f'user_program.py:{wrong}: error: "Event" has no attribute "raise_for_status"' in errors[0], out
