"""The project's loop choices survive aiodat's plugin: its plain async tests run on its own
SampleLoop (conftest.py), one loop per module (pyproject.toml); aiodat's tests follow --aiodat-loop."""
import asyncio

from conftest import SampleLoop

seen = []


async def test_plain_test_runs_on_the_projects_loop():
    loop = asyncio.get_running_loop()
    assert type(loop) is SampleLoop
    seen.append(loop)


async def test_plain_tests_share_the_module_loop():
    assert type(asyncio.get_running_loop()) is SampleLoop
    assert seen == [asyncio.get_running_loop()], "the module loop scope was not kept"


async def test_aiodat_tests_follow_the_aiodat_loop(aiodat_loop):
    """aiodat's fixture (it needs no device) makes this one of aiodat's tests: --aiodat-loop picks its loop."""
    loop = asyncio.get_running_loop()
    if aiodat_loop == "uvloop":
        import uvloop

        assert isinstance(loop, uvloop.Loop)
    else:
        assert isinstance(loop, asyncio.SelectorEventLoop)  # asyncio's, made through the project's policy
