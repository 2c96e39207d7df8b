"""Issue 6 item 3: the pytest plugin, exercised the way a user's suite meets it (pytester).

The sample suite below is what a user writes: it never imports the plugin (the
``pytest11`` entry point loads it), uses the ``rxe`` marker and the
``rdma_device`` / ``ia`` / ``ep_pair`` / ``aiodat_loop`` fixtures, a
module-scoped event loop with a module-scoped connection of its own, and checks
that its aiodat tests run on the loop chosen with ``--aiodat-loop`` while a
plain async test keeps pytest-asyncio's default loop.  On rxe it must pass; on a machine without a
device the device tests must skip with the how-to message (host-only tests).
"""
from __future__ import annotations

import importlib.metadata
from typing import Any

import pytest

pytest_plugins = ["pytester"]

INI = """
[pytest]
asyncio_mode = auto
asyncio_default_fixture_loop_scope = function
"""

USER_SUITE = '''
import asyncio
import os

import pytest

import aiodat


@pytest.mark.rxe
def test_device_and_ia(rdma_device, ia):
    assert ia.name == rdma_device.name
    assert ia.address == rdma_device.address
    assert ia.query().ia_attr.max_eps > 0


@pytest.mark.rxe
async def test_message_across(ep_pair):
    server_recv, _, _ = ep_pair.server_evds
    _, client_req, client_conn = ep_pair.client_evds
    ep_pair.server.post_recv(ep_pair.server_lmr[0:64], cookie="rx")
    ep_pair.client_lmr.memoryview()[:11] = b"hello, rxe!"
    ep_pair.client.post_send(ep_pair.client_lmr[0:11], cookie="tx")
    sent = await client_req.wait_one(timeout=10)
    assert sent.raise_for_status().cookie == "tx"
    got = await server_recv.wait_one(timeout=10)
    assert got.raise_for_status().cookie == "rx" and got.transferred_length == 11
    assert bytes(ep_pair.server_lmr.memoryview()[:11]) == b"hello, rxe!"
    assert ep_pair.client.state is aiodat.EPState.CONNECTED


async def test_runs_on_the_chosen_loop(aiodat_loop):
    loop = asyncio.get_running_loop()
    assert aiodat_loop == os.environ["EXPECT_LOOP"]
    assert ("uvloop" in type(loop).__module__) == (os.environ["EXPECT_LOOP"] == "uvloop"), type(loop)


async def test_plain_async_test_keeps_the_default_loop():
    assert "uvloop" not in type(asyncio.get_running_loop()).__module__
'''

MODULE_LOOP_SUITE = '''
import asyncio

import pytest
import pytest_asyncio

import aiodat
from aiodat.testing.plugin import make_ep_pair

pytestmark = [pytest.mark.rxe, pytest.mark.asyncio(loop_scope="module")]
LOOPS = []


@pytest.fixture(scope="module")
def module_ia(rdma_device):
    with aiodat.open_ia(rdma_device.name) as ia:
        yield ia


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_pair(module_ia):
    pair = await make_ep_pair(module_ia, 256)
    yield pair
    pair.close()


async def ping(pair, payload):
    pair.server.post_recv(pair.server_lmr[0:64])
    pair.client_lmr.memoryview()[:len(payload)] = payload
    pair.client.post_send(pair.client_lmr[0:len(payload)])
    (await pair.client.request_evd.wait_one(timeout=10)).raise_for_status()
    got = (await pair.server.recv_evd.wait_one(timeout=10)).raise_for_status()
    return bytes(pair.server_lmr.memoryview()[:got.transferred_length])


async def test_first_uses_the_module_connection(shared_pair):
    LOOPS.append(asyncio.get_running_loop())
    assert await ping(shared_pair, b"one") == b"one"


async def test_second_reuses_it_on_the_same_loop(shared_pair):
    LOOPS.append(asyncio.get_running_loop())
    assert LOOPS[0] is LOOPS[1]
    assert await ping(shared_pair, b"two") == b"two"


async def test_function_fixture_in_a_module_loop_is_refused(ep_pair):
    # ep_pair connected on its own (function-scoped) loop, which is still open: aiodat objects
    # belong to one loop, so this module-loop test gets a clear error, not a hang
    assert asyncio.get_running_loop() is LOOPS[0]
    with pytest.raises(aiodat.InvalidState, match="belongs to the event loop"):
        await ping(ep_pair, b"three")
'''


def _write_suite(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI)
    pytester.makepyfile(test_user_suite=USER_SUITE, test_module_loop=MODULE_LOOP_SUITE)


def _no_device() -> bool:
    from aiodat.testing.plugin import find_device

    try:
        return find_device() is None
    except ImportError:
        return True


def test_entry_point_registers_the_plugin() -> None:
    """Installing aiodat is enough: the pytest11 entry point names aiodat.testing.plugin."""
    points = importlib.metadata.entry_points(group="pytest11")
    assert any(p.name == "aiodat" and p.value == "aiodat.testing.plugin" for p in points)


@pytest.mark.rxe
def test_user_suite_passes_on_rxe(pytester: pytest.Pytester, request: pytest.FixtureRequest,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The sample user suite passes on the device, on the loop the outer run uses, module loop scope included."""
    loop = request.config.getoption("--aiodat-loop") or "asyncio"
    monkeypatch.setenv("EXPECT_LOOP", loop)
    _write_suite(pytester)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--aiodat-loop={loop}", "-v",
                                           timeout=600)
    result.stdout.fnmatch_lines([f"aiodat: loop={loop} *"])
    result.assert_outcomes(passed=7)


STRICT_SUITE = '''
import pytest


@pytest.mark.rxe
@pytest.mark.asyncio
async def test_ep_pair_in_strict_mode(ep_pair):
    ep_pair.server.post_recv(ep_pair.server_lmr[0:8], cookie="rx")
    ep_pair.client.post_send(ep_pair.client_lmr[0:8], cookie="tx")
    got = await ep_pair.server_evds[0].wait_one(timeout=10)
    assert got.raise_for_status().cookie == "rx"
'''


@pytest.mark.rxe
def test_ep_pair_in_pytest_asyncio_strict_mode(pytester: pytest.Pytester, request: pytest.FixtureRequest) -> None:
    """``ep_pair`` is an async fixture pytest-asyncio runs in its default strict mode as well (it was
    a plain ``pytest.fixture``, which only auto mode runs: strict mode failed the test)."""
    pytester.makeini(INI.replace("asyncio_mode = auto", "asyncio_mode = strict"))
    pytester.makepyfile(test_strict=STRICT_SUITE)
    loop = request.config.getoption("--aiodat-loop") or "asyncio"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--aiodat-loop={loop}", timeout=600)
    result.assert_outcomes(passed=1)


def test_user_suite_skips_without_device(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a device (host-side), device tests skip saying how to run them; the rest still runs."""
    if not _no_device():
        pytest.skip("this machine has an RDMA device: the no-device behaviour is tested on the host")
    for name in ("AIODAT_REQUIRE_DEVICE", "AIODAT_RXE_DEVICE", "AIODAT_RXE_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("EXPECT_LOOP", "uvloop")
    _write_suite(pytester)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--aiodat-loop=uvloop", "-rs", timeout=300)
    result.assert_outcomes(passed=2, skipped=5)
    result.stdout.fnmatch_lines(["*SKIPPED*no RDMA device here*aiodat rxe run -- python -m pytest*"])


def test_required_device_missing_is_an_error(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """With AIODAT_REQUIRE_DEVICE=1 (CI, the test bed) a missing device fails the device tests, never skips."""
    if not _no_device():
        pytest.skip("this machine has an RDMA device: the no-device behaviour is tested on the host")
    monkeypatch.setenv("AIODAT_REQUIRE_DEVICE", "1")
    for name in ("AIODAT_RXE_DEVICE", "AIODAT_RXE_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("EXPECT_LOOP", "asyncio")
    pytester.makeini(INI)
    pytester.makepyfile(test_user_suite=USER_SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    outcomes: Any = result.parseoutcomes()
    assert outcomes.get("skipped", 0) == 0
    assert outcomes.get("failed", 0) + outcomes.get("errors", 0) == 2 and outcomes.get("passed") == 2
    result.stdout.fnmatch_lines(["*AIODAT_REQUIRE_DEVICE=1 but no RDMA device is up*"])


LOOP_CHOICE_SUITE = '''
import asyncio

import pytest
import uvloop


def on_uvloop():
    return isinstance(asyncio.get_running_loop(), uvloop.Loop)


async def test_plain():
    assert not on_uvloop()


class TestPlainClass:
    async def test_plain_method(self):
        assert not on_uvloop()


async def test_aiodat_fixture(aiodat_loop):
    assert aiodat_loop == "uvloop" and on_uvloop()


@pytest.fixture
def users_own_fixture(aiodat_loop):
    return aiodat_loop


async def test_through_a_fixture_of_the_user(users_own_fixture):
    assert on_uvloop()


@pytest.mark.rxe
async def test_rxe_marker():
    assert on_uvloop()


@pytest.fixture(params=["tcp", pytest.param("rdma", marks=pytest.mark.rxe)])
def transport(request):
    return request.param


async def test_rxe_marked_fixture_param(transport):
    assert on_uvloop()


@pytest.mark.parametrize("kind", ["plain", pytest.param("device", marks=pytest.mark.rxe)])
async def test_rxe_marked_parameter(kind):
    assert on_uvloop()


@pytest.mark.parametrize("kind", ["a", "b"])
async def test_plain_parameters(kind):
    assert not on_uvloop()
'''


def test_loop_chosen_only_for_aiodat_tests(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """--aiodat-loop uvloop: tests with aiodat's fixtures (also through a user's fixture), the rxe marker or an
    rxe-marked parameter run on uvloop; plain async tests of the same project keep pytest-asyncio's default loop."""
    pytest.importorskip("uvloop")
    # a device named by the test bed's environment is taken as given (nothing is opened), so the
    # rxe-marked test runs instead of skipping and its loop check is real
    monkeypatch.setenv("AIODAT_RXE_DEVICE", "fake0")
    monkeypatch.setenv("AIODAT_RXE_ADDR", "169.254.0.9")
    monkeypatch.delenv("AIODAT_REQUIRE_DEVICE", raising=False)
    monkeypatch.delenv("AIODAT_LOOP", raising=False)
    pytester.makeini(INI)
    pytester.makepyfile(test_loops=LOOP_CHOICE_SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--aiodat-loop=uvloop", "-v", timeout=300)
    result.assert_outcomes(passed=11)
    # AIODAT_LOOP chooses the same way as the option
    monkeypatch.setenv("AIODAT_LOOP", "uvloop")
    pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300).assert_outcomes(passed=11)
