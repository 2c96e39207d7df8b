"""The project's own event loop: every loop pytest-asyncio makes from the policy is a SampleLoop.

aiodat's plugin must leave this alone for the project's plain async tests (and the module
loop scope set in pyproject.toml); only tests that use aiodat's fixtures or its ``rxe``
marker follow ``--aiodat-loop``.
"""
import asyncio


class SampleLoop(asyncio.SelectorEventLoop):
    """The project's loop class: a selector loop it can recognise."""


class SamplePolicy(asyncio.DefaultEventLoopPolicy):
    """An event loop policy whose new loops are SampleLoops."""

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return SampleLoop()


asyncio.set_event_loop_policy(SamplePolicy())
