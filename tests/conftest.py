"""Fixtures shared by aiodat's own tests (the user-facing ones live in aiodat.testing.plugin)."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, List

import pytest


@pytest.fixture
async def loop_errors() -> AsyncIterator[List[dict]]:
    """Records anything that escapes into the loop's exception handler; the test fails if something did."""
    loop = asyncio.get_running_loop()
    errors: List[dict] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    yield errors
    loop.set_exception_handler(old)
    assert not errors, f"exceptions escaped into the event loop: {errors}"
