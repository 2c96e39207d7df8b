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


async def test_ep_pair_follows_the_module_loop(ep_pair):
    # the plugin connects ep_pair on the test's own loop (aiodat objects belong to one loop):
    # on the function loop of the fixture default this wait raised InvalidState
    assert asyncio.get_running_loop() is LOOPS[0]
    assert await ping(ep_pair, b"three") == b"three"


async def test_a_fixture_on_another_loop_is_refused(function_loop_pair):
    # a user's own async fixture on its own (function-scoped) loop, which is still open:
    # this module-loop test gets a clear error, not a hang
    with pytest.raises(aiodat.InvalidState, match="belongs to the event loop"):
        await ping(function_loop_pair, b"four")


@pytest_asyncio.fixture(loop_scope="function")
async def function_loop_pair(ia):
    pair = await make_ep_pair(ia, 256)
    yield pair
    pair.close()
'''


#: options of every inner run: no cache files, and neither the hypothesis nor the anyio plugin (the
#: sample suites use neither; importing hypothesis took about a third of each inner run's start-up
#: under emulation, anyio's plugin about a tenth of pytest's start-up on the host)
BARE = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:anyio")


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
    result = pytester.runpytest_subprocess(*BARE, f"--aiodat-loop={loop}", "-v",
                                           timeout=600)
    result.stdout.fnmatch_lines([f"aiodat: loop={loop} *"])
    result.assert_outcomes(passed=8)


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
    result = pytester.runpytest_subprocess(*BARE, f"--aiodat-loop={loop}", timeout=600)
    result.assert_outcomes(passed=1)


TEARDOWN_SUITE = '''
import pytest

SEEN = {}


@pytest.mark.rxe
async def test_fails_holding_everything(ia, ep_pair):
    pair = ep_pair
    handles = {"ia": ia, "pz": pair.pz, "client": pair.client, "server": pair.server, "psp": pair.psp,
               "cr_evd": pair.cr_evd, "client_lmr": pair.client_lmr, "server_lmr": pair.server_lmr}
    # (taken now: an EP makes its connect EVD when first asked for it, which a closed EP cannot)
    handles.update((f"client evd {i}", evd) for i, evd in enumerate(pair.client_evds))
    handles.update((f"server evd {i}", evd) for i, evd in enumerate(pair.server_evds))
    SEEN["handles"] = handles
    assert False, "this test fails on purpose"


@pytest.mark.rxe
async def test_closes_the_ia_itself(ia, ep_pair):
    ia.close()  # the fixtures' teardown must not trip over what the test already closed
    SEEN["closed_ia"] = ia


def test_nothing_was_left_open():
    assert [name for name, handle in SEEN["handles"].items() if not handle.closed] == []
    assert SEEN["closed_ia"].closed
'''


@pytest.mark.rxe
def test_fixtures_leave_nothing_open_after_a_failure(pytester: pytest.Pytester,
                                                     request: pytest.FixtureRequest) -> None:
    """``ia`` and everything ``ep_pair`` made are closed after a test that fails, and a test that closes
    the IA itself leaves the teardown nothing to trip over (no error at teardown)."""
    pytester.makeini(INI)
    pytester.makepyfile(test_teardown=TEARDOWN_SUITE)
    loop = request.config.getoption("--aiodat-loop") or "asyncio"
    result = pytester.runpytest_subprocess(*BARE, "-p", "no:randomly", f"--aiodat-loop={loop}",
                                           "-W", "error::pytest.PytestUnraisableExceptionWarning", timeout=600)
    result.assert_outcomes(failed=1, passed=2)
    result.stdout.fnmatch_lines(["*this test fails on purpose*"])


EP_PAIR_LOOP_CONFTEST = '''
import asyncio

import pytest

import aiodat.testing.plugin as plugin


class FakePair:
    closed_on = None

    def close(self):
        self.closed_on = asyncio.get_running_loop()


@pytest.fixture
def ia():  # no device: the user's own ia, and a pair that records the loop it was made on
    return object()


@pytest.fixture(autouse=True)
def fake_pairs(monkeypatch):
    async def make_ep_pair(ia, buffer_size=4096, attrs=None):
        pair = FakePair()
        pair.made_on = asyncio.get_running_loop()
        return pair

    monkeypatch.setattr(plugin, "make_ep_pair", make_ep_pair)
'''

EP_PAIR_LOOP_SUITE = '''
import asyncio

import pytest

PAIRS = []


async def test_function_loop(ep_pair):
    assert ep_pair.made_on is asyncio.get_running_loop()
    PAIRS.append(ep_pair)


@pytest.mark.asyncio(loop_scope="module")
async def test_module_loop(ep_pair):
    assert ep_pair.made_on is asyncio.get_running_loop()
    PAIRS.append(ep_pair)


def test_each_pair_was_closed_on_its_own_loop():
    assert [pair.closed_on for pair in PAIRS] == [pair.made_on for pair in PAIRS]
'''


@pytest.mark.parametrize("fixture_loop_scope", ["function", "session"])
def test_ep_pair_connects_on_the_tests_loop(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                           fixture_loop_scope: str) -> None:
    """``ep_pair`` is made and closed on the loop of the test that uses it (it ran on the loop of
    asyncio_default_fixture_loop_scope: with ``session``, or in a module-loop test, every wait on the
    pair raised InvalidState, the pair belonging to another loop that was still open)."""
    monkeypatch.delenv("AIODAT_LOOP", raising=False)
    pytester.makeini(INI.replace("= function", f"= {fixture_loop_scope}"))
    pytester.makeconftest(EP_PAIR_LOOP_CONFTEST)
    pytester.makepyfile(test_pair_loop=EP_PAIR_LOOP_SUITE)
    result = pytester.runpytest_subprocess(*BARE, "-p", "no:randomly", timeout=300)
    result.assert_outcomes(passed=3)


def test_user_suite_skips_without_device(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a device (host-side), device tests skip saying how to run them; the rest still runs."""
    if not _no_device():
        pytest.skip("this machine has an RDMA device: the no-device behaviour is tested on the host")
    for name in ("AIODAT_REQUIRE_DEVICE", "AIODAT_RXE_DEVICE", "AIODAT_RXE_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("EXPECT_LOOP", "uvloop")
    _write_suite(pytester)
    result = pytester.runpytest_subprocess(*BARE, "--aiodat-loop=uvloop", "-rs", timeout=300)
    result.assert_outcomes(passed=2, skipped=6)
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
    result = pytester.runpytest_subprocess(*BARE, timeout=300)
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
    result = pytester.runpytest_subprocess(*BARE, "--aiodat-loop=uvloop", "-v", timeout=300)
    result.assert_outcomes(passed=11)
    # the address last: the test bed's scripts match "loop=... device=... testbed=" (tests/test_sample_project.py)
    result.stdout.fnmatch_lines(["aiodat: loop=uvloop device=fake0 testbed=* address=169.254.0.9"])
    # AIODAT_LOOP chooses the same way as the option
    monkeypatch.setenv("AIODAT_LOOP", "uvloop")
    pytester.runpytest_subprocess(*BARE, timeout=300).assert_outcomes(passed=11)


PARAMETER_VALUES_SUITE = '''
import itertools
import unittest.mock

import pytest


class MarksAttribute:
    marks = 3  # a user's value with a .marks that is no list of marks


@pytest.mark.parametrize("a,b", itertools.product([1, 2], [3]))
async def test_generated_parameters(a, b):
    assert a in (1, 2) and b == 3


@pytest.mark.parametrize("m", [unittest.mock.Mock()])
async def test_mock_parameter(m):
    assert m is not None


@pytest.mark.parametrize("x", (MarksAttribute(),))
async def test_parameter_with_a_marks_attribute(x):
    assert x.marks == 3


@pytest.fixture(params=[unittest.mock.Mock()])
def mocked(request):
    return request.param


async def test_mock_fixture_parameter(mocked):
    assert mocked is not None
'''


def test_parameter_values_are_neither_consumed_nor_misread(pytester: pytest.Pytester,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Looking for rxe-marked parameters (pytest-asyncio asks before pytest reads the parametrize
    marks) must not use up a generator of argvalues (the test was skipped: "got empty parameter
    set"), nor read the .marks of a value that is no pytest.param (a Mock, an int .marks: TypeError
    at collection)."""
    monkeypatch.delenv("AIODAT_LOOP", raising=False)
    pytester.makeini(INI)
    pytester.makepyfile(test_values=PARAMETER_VALUES_SUITE)
    result = pytester.runpytest_subprocess(*BARE, "-rs", timeout=300)
    result.assert_outcomes(passed=5)


def test_a_loop_without_pytest_asyncios_hook_is_refused(pytester: pytest.Pytester,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """--aiodat-loop uvloop where pytest-asyncio has no pytest_asyncio_loop_factories hook (older than
    1.4, or not loaded) is a usage error: every test would run on asyncio under a header saying uvloop."""
    monkeypatch.delenv("AIODAT_LOOP", raising=False)
    pytester.makeini(INI)
    pytester.makepyfile(test_sync="def test_sync():\n    pass\n")
    result = pytester.runpytest_subprocess(*BARE, "-p", "no:asyncio", "--aiodat-loop=uvloop",
                                           timeout=300)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*needs pytest-asyncio >= 1.4*pytest-asyncio * is not loaded*"])
    # the default loop needs no hook
    pytester.runpytest_subprocess(*BARE, "-p", "no:asyncio", timeout=300).assert_outcomes(passed=1)


def test_uvloop_not_installed_is_a_usage_error(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """--aiodat-loop uvloop without uvloop installed stops the run saying what to install (it was a
    collection error in every test file, a traceback into the plugin's loop factory)."""
    monkeypatch.delenv("AIODAT_LOOP", raising=False)
    pytester.makeini(INI)
    # (the subprocess finds modules in the pytester directory first: this one stands for a missing uvloop)
    pytester.makepyfile(uvloop="raise ModuleNotFoundError(\"No module named 'uvloop'\", name='uvloop')\n",
                        test_loop="async def test_loop(aiodat_loop):\n    pass\n")
    result = pytester.runpytest_subprocess(*BARE, "--aiodat-loop=uvloop", timeout=300)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "needs uvloop: No module named 'uvloop'; pip install 'aiodat[uvloop]'" in result.stderr.str()


@pytest.mark.parametrize("name,value", [("AIODAT_LOOP", "UVLOOP"), ("AIODAT_REQUIRE_DEVICE", "maybe"),
                                        ("AIODAT_RXE_ADDR", "rxe0")])
def test_a_misread_environment_value_is_a_usage_error(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                                      name: str, value: str) -> None:
    """A value the plugin cannot honour stops the run naming the variable (AIODAT_LOOP=UVLOOP ran on
    asyncio under a header saying UVLOOP; any AIODAT_REQUIRE_DEVICE but "1" counted as off)."""
    for var in ("AIODAT_LOOP", "AIODAT_REQUIRE_DEVICE", "AIODAT_RXE_DEVICE", "AIODAT_RXE_ADDR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(name, value)
    pytester.makeini(INI)
    pytester.makepyfile(test_sync="def test_sync():\n    pass\n")
    result = pytester.runpytest_subprocess(*BARE, timeout=300)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{name}='{value}'*"])


def test_require_device_takes_the_usual_spellings(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """AIODAT_REQUIRE_DEVICE=true is on (it was off: only "1" was), and a device named by
    AIODAT_RXE_DEVICE alone that is not there is said so."""
    if not _no_device():
        pytest.skip("this machine has an RDMA device: the no-device behaviour is tested on the host")
    monkeypatch.setenv("AIODAT_REQUIRE_DEVICE", "true")
    monkeypatch.setenv("AIODAT_RXE_DEVICE", "nosuchdev9")
    monkeypatch.delenv("AIODAT_RXE_ADDR", raising=False)
    monkeypatch.delenv("AIODAT_LOOP", raising=False)
    pytester.makeini(INI)
    pytester.makepyfile(test_dev="import pytest\n\n@pytest.mark.rxe\ndef test_dev():\n    pass\n")
    result = pytester.runpytest_subprocess(*BARE, timeout=300)
    result.assert_outcomes(errors=1)  # (the failure is the rxe marker's, at setup)
    result.stdout.fnmatch_lines(["*AIODAT_REQUIRE_DEVICE=true but no RDMA device is up: "
                                 "no active port matches AIODAT_RXE_DEVICE=nosuchdev9*"])


def test_device_or_address_alone_picks_that_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """AIODAT_RXE_DEVICE alone (as aiodat's CLI and streams read it) picks that port, with its own
    address; AIODAT_RXE_ADDR alone the port with that address (each was ignored: the first port won)."""
    from types import SimpleNamespace

    import aiodat
    from aiodat.testing.plugin import RdmaDevice, find_device

    def port(name: str, device: str, number: int, *addresses: str) -> Any:
        return SimpleNamespace(name=name, device=device, port=number, state="PORT_ACTIVE",
                               addresses=addresses, address=addresses[0])

    ports = [port("mlx0", "mlx0", 1, "10.0.0.1"), port("rxe1", "rxe1", 1, "10.0.0.2", "fe80::2"),
             port("rxe1:2", "rxe1", 2, "10.0.0.3")]
    monkeypatch.setattr(aiodat.ia, "list_providers", lambda: ports)  # (what environment_port reads)
    monkeypatch.delenv("AIODAT_RXE_ADDR", raising=False)
    for name, expected in [("rxe1", RdmaDevice("rxe1", "10.0.0.2")), ("rxe1:2", RdmaDevice("rxe1:2", "10.0.0.3")),
                           ("rxe1:1", RdmaDevice("rxe1:1", "10.0.0.2")), ("rxe7", None)]:
        monkeypatch.setenv("AIODAT_RXE_DEVICE", name)
        assert find_device() == expected, name
    monkeypatch.delenv("AIODAT_RXE_DEVICE")
    monkeypatch.setenv("AIODAT_RXE_ADDR", "10.0.0.3")
    assert find_device() == RdmaDevice("rxe1:2", "10.0.0.3")
    monkeypatch.setenv("AIODAT_RXE_ADDR", "fe80:0::2")
    assert find_device() == RdmaDevice("rxe1", "fe80::2")
    monkeypatch.setenv("AIODAT_RXE_DEVICE", "given0")  # both: taken as given, nothing looked up
    assert find_device() == RdmaDevice("given0", "fe80:0::2")


OTHER_LOOP_PLUGIN = '''
import asyncio


class OtherLoop(asyncio.SelectorEventLoop):
    pass


def pytest_asyncio_loop_factories(config, item):
    return {"other": OtherLoop} if "other" in item.name else None
'''

HOOK_ORDER_SUITE = '''
import asyncio

import pytest
import uvloop


def loop_kind():
    loop = asyncio.get_running_loop()
    return "uvloop" if isinstance(loop, uvloop.Loop) else type(loop).__name__


async def test_other_plain():
    assert loop_kind() == "OtherLoop"


async def test_other_aiodat(aiodat_loop):  # another plugin's answer decides, for aiodat's tests too
    assert loop_kind() == "OtherLoop"


async def test_plain():  # the other plugin leaves it (None): pytest-asyncio's default
    assert loop_kind() not in ("OtherLoop", "uvloop")


async def test_aiodat(aiodat_loop):
    assert loop_kind() == "uvloop"


@pytest.fixture(scope="module")
def module_loop_name(aiodat_loop):  # aiodat_loop is session-scoped: a module fixture may use it
    return aiodat_loop


async def test_module_fixture(module_loop_name):
    assert module_loop_name == "uvloop" and loop_kind() == "uvloop"
'''


def test_another_plugins_loop_choice_comes_first(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """aiodat's loop-factory hook is asked last (trylast): another installed plugin that answers for a
    test chooses its loop, also when that plugin was registered before aiodat (it was overridden by
    aiodat's default answer); ``aiodat_loop`` is session-scoped (a module fixture could not use it)."""
    pytest.importorskip("uvloop")
    monkeypatch.delenv("AIODAT_LOOP", raising=False)
    pytester.makeini(INI)
    pytester.makepyfile(other_loops=OTHER_LOOP_PLUGIN, test_order=HOOK_ORDER_SUITE)
    result = pytester.runpytest_subprocess(*BARE, "-p", "other_loops", "--aiodat-loop=uvloop",
                                           "-v", timeout=300)
    result.assert_outcomes(passed=5)


@pytest.mark.rxe
async def test_ep_pair_close_goes_on_past_a_close_that_raises(ia) -> None:
    """EPPair.close frees everything it can when one handle's close raises, then raises that error:
    it used to stop at the first, leaving the EPs, LMRs and PZ registered until the IA closed."""
    from aiodat.testing.plugin import make_ep_pair

    pair = await make_ep_pair(ia, 256)
    real_psp = pair.psp

    class FailingClose:
        closed = False

        def close(self) -> None:
            raise RuntimeError("this close fails")

    pair.psp = FailingClose()  # (the first handle it closes)
    with pytest.raises(RuntimeError, match="this close fails"):
        pair.close()
    assert pair.client.closed and pair.server.closed and pair.pz.closed and pair.cr_evd.closed
    assert pair.client_lmr.closed and pair.server_lmr.closed
    real_psp.close()
