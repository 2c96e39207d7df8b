"""aiodat's pytest plugin (registered through the ``pytest11`` entry point).

Gives a user's suite, once aiodat is installed:

* the ``rxe`` marker for tests that need an RDMA device.  Without a device they
  are skipped with a message saying how to run them (``aiodat rxe run --
  pytest``), unless ``AIODAT_REQUIRE_DEVICE=1`` (set by the test bed and CI;
  ``true``/``yes``/``on`` too), where a missing device is an error, never a skip;
* ``--aiodat-loop asyncio|uvloop`` (or ``AIODAT_LOOP``): the event loop
  pytest-asyncio runs aiodat's tests on.  Only tests that use one of aiodat's
  fixtures (directly or through other fixtures) or carry the ``rxe`` marker
  are aiodat's (:func:`uses_aiodat`); every other async test of the project
  keeps pytest-asyncio's default loop.  A loop other than asyncio needs
  pytest-asyncio 1.4 or later (:data:`LOOP_HOOK_VERSION`);
* fixtures: ``rdma_device`` (a :class:`RdmaDevice`: IA name and address),
  ``ia`` (an open IA, closed after the test), ``ep_pair`` (two connected
  endpoints with their EVDs and registered buffers, see :class:`EPPair`) and
  ``aiodat_loop`` (the name of the loop the test runs on; needs no device).
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import ipaddress
import os
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Dict, Iterator, Mapping, Optional, Tuple

import pytest
from _pytest.mark import ParameterSet  # (pytest's own class of pytest.param; not exported by name)

_async_fixture: Any = pytest.fixture
try:  # an async fixture pytest-asyncio runs in its strict mode too, not only in auto mode
    import pytest_asyncio

    _async_fixture = pytest_asyncio.fixture
except ImportError:  # (no pytest-asyncio: no async test could use it anyway)
    pass

HOW_TO_RUN = (
    "no RDMA device here; run the device tests on Soft-RoCE with "
    "`aiodat rxe run -- python -m pytest -m rxe` (boots a QEMU guest when the host kernel has no rxe)"
)


@dataclass(frozen=True)
class RdmaDevice:
    """The device the tests use: ``name`` for open_ia, ``address`` its IPv4 address for rdma_cm."""

    name: str
    address: str
    netdev: Optional[str] = None


def find_device() -> Optional[RdmaDevice]:
    """The device named by the environment, else the first active RoCE/IB port with an IP address.

    ``AIODAT_RXE_DEVICE`` and ``AIODAT_RXE_ADDR`` together (``aiodat rxe run``
    sets both) are taken as given: nothing is opened.  ``AIODAT_RXE_DEVICE``
    alone picks the active port of that name (as aiodat's CLI, benchmarks and
    streams read it), ``AIODAT_RXE_ADDR`` alone the active port with that
    address; None when there is no such port.  One reading with the CLI's and
    the benchmarks': :func:`aiodat.ia.environment_port`.
    """
    from aiodat import ProviderNotFound

    try:
        return _lookup()
    except ProviderNotFound:
        return None


def _lookup() -> Optional[RdmaDevice]:
    # ProviderNotFound (naming the variable and the ports there are) when the environment names no port
    from aiodat.ia import environment_port

    found = environment_port()
    return None if found is None else RdmaDevice(found.name, found.address, found.netdev)


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--aiodat-loop`` (the event loop async tests run on)."""
    group = parser.getgroup("aiodat")
    group.addoption("--aiodat-loop", choices=("asyncio", "uvloop"), default=None,
                    help="event loop for async tests that use aiodat's fixtures or the rxe marker "
                         "(default: $AIODAT_LOOP or asyncio); other async tests keep pytest-asyncio's")


#: the first pytest-asyncio with the ``pytest_asyncio_loop_factories`` hook, which --aiodat-loop needs
LOOP_HOOK_VERSION = "1.4"

#: the loops --aiodat-loop and AIODAT_LOOP choose from
LOOPS = ("asyncio", "uvloop")
_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"", "0", "false", "no", "off"})


@dataclass(frozen=True)
class _Settings:
    loop: str
    require_device: Optional[str]  # AIODAT_REQUIRE_DEVICE as given when it is on, else None


_SETTINGS = pytest.StashKey[_Settings]()


def _settings_from_env(option: Optional[str]) -> _Settings:
    # a value the plugin would misread must stop the run: it used to pass silently for another
    loop_env = os.environ.get("AIODAT_LOOP", "")
    if loop_env and loop_env not in LOOPS:
        raise pytest.UsageError(f"AIODAT_LOOP={loop_env!r}: must be one of {', '.join(LOOPS)} (as --aiodat-loop)")
    require = os.environ.get("AIODAT_REQUIRE_DEVICE", "")
    if require.strip().lower() not in _ON | _OFF:
        raise pytest.UsageError(f"AIODAT_REQUIRE_DEVICE={require!r}: must be 1, true, yes or on (a missing "
                                "device fails the device tests), or 0, false, no, off or empty (they skip)")
    addr = os.environ.get("AIODAT_RXE_ADDR", "")
    if addr:
        try:
            ipaddress.ip_address(addr)
        except ValueError:
            raise pytest.UsageError(f"AIODAT_RXE_ADDR={addr!r}: not an IP address") from None
    return _Settings(option or loop_env or "asyncio", require if require.strip().lower() in _ON else None)


def _has_loop_hook(config: pytest.Config) -> bool:
    # our implementation is an optionalhook, so the caller exists either way: the spec says
    # whether pytest-asyncio (>= LOOP_HOOK_VERSION) is active and will ask it
    caller = getattr(config.hook, "pytest_asyncio_loop_factories", None)
    return caller is not None and caller.has_spec()


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``rxe`` marker; check ``--aiodat-loop`` and the ``AIODAT_*`` variables
    (:class:`pytest.UsageError` for a value the plugin cannot honour)."""
    config.addinivalue_line("markers", "rxe: the test needs an RDMA device (rxe or real)")
    settings = _settings_from_env(config.getoption("--aiodat-loop"))
    if settings.loop != "asyncio" and not _has_loop_hook(config):
        # without the hook every test would run on asyncio's default loop, under a header saying otherwise
        try:
            found = "pytest-asyncio " + importlib.metadata.version("pytest-asyncio")
            found += " is too old" if config.pluginmanager.has_plugin("asyncio") else " is not loaded"
        except importlib.metadata.PackageNotFoundError:
            found = "pytest-asyncio is not installed"
        raise pytest.UsageError(
            f"aiodat loop {settings.loop!r} (--aiodat-loop / AIODAT_LOOP) needs pytest-asyncio >= "
            f"{LOOP_HOOK_VERSION} loaded in this run (its pytest_asyncio_loop_factories hook): {found}")
    if settings.loop == "uvloop":
        # checked here: the import at collection failed every test file with a traceback into this plugin
        try:
            import uvloop  # noqa: F401
        except ImportError as exc:
            raise pytest.UsageError(f"aiodat loop 'uvloop' (--aiodat-loop / AIODAT_LOOP) needs uvloop: {exc}; "
                                    "pip install 'aiodat[uvloop]'") from None
    config.stash[_SETTINGS] = settings


def _loop_name(config: pytest.Config) -> str:
    return config.stash[_SETTINGS].loop


def _loop_factory(name: str) -> Callable[[], Any]:
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


#: aiodat's fixtures: a test that uses one of them runs on the loop chosen with --aiodat-loop
AIODAT_FIXTURES = frozenset({"rdma_device", "ia", "ep_pair", "aiodat_loop"})


def uses_aiodat(item: pytest.Item) -> bool:
    """True for a test of aiodat's: it carries the ``rxe`` marker, one of its parameters does, or it
    needs one of :data:`AIODAT_FIXTURES`.

    The fixtures are looked up in the test's whole fixture closure, so a
    user's fixture built on ``ia`` (say) makes its tests aiodat's too.
    pytest-asyncio asks once per test function, before parametrization, so a
    parameter marked ``rxe`` (``pytest.param(..., marks=pytest.mark.rxe)``, in
    a list or tuple of ``parametrize`` argvalues or in a fixture's ``params``)
    puts all of that test's cases on the chosen loop.
    """
    if item.get_closest_marker("rxe") is not None:
        return True
    if not AIODAT_FIXTURES.isdisjoint(getattr(item, "fixturenames", ())):
        return True
    return any(_marked_rxe(p) for p in _params(item))


def _params(item: pytest.Item) -> Iterator[Any]:
    """The parameter values of the test's ``parametrize`` marks and of the fixtures it uses.

    Only argvalues given as a list or tuple are looked at: pytest-asyncio asks
    before pytest reads the marks, and a generator or other iterable read
    here would leave pytest nothing (the test skipped: "got empty parameter set").
    """
    for mark in item.iter_markers("parametrize"):
        values = mark.args[1] if len(mark.args) > 1 else mark.kwargs.get("argvalues", ())
        if isinstance(values, (list, tuple)):
            yield from values
    info = getattr(item, "_fixtureinfo", None)  # pytest's own; absent on items that are not functions
    for defs in getattr(info, "name2fixturedefs", {}).values():
        for fixturedef in defs:
            params = fixturedef.params
            if isinstance(params, (list, tuple)):  # (pytest makes them a tuple)
                yield from params


def _marked_rxe(param: Any) -> bool:
    # only pytest.param's own marks: a user's value may have a .marks of any kind (a Mock has all attributes)
    return isinstance(param, ParameterSet) and any(getattr(mark, "name", None) == "rxe" for mark in param.marks)


@pytest.hookimpl(optionalhook=True, trylast=True)
def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Callable[[], Any]]:
    """pytest-asyncio (>= 1.4) asks, per test, which loop to run it on.

    The hook's first answer that is not None decides, and this one is asked
    last: a ``conftest.py`` or another plugin that answers for a test chooses
    its loop (aiodat's tests included: return None from yours for those).
    Otherwise aiodat's tests (:func:`uses_aiodat`) get the loop chosen with
    --aiodat-loop / AIODAT_LOOP, and any other test pytest-asyncio's own
    default (the answer must be a mapping): a new loop from the current event
    loop policy.
    """
    if not uses_aiodat(item):
        return {"asyncio": asyncio.new_event_loop}
    name = _loop_name(config)
    return {name: _loop_factory(name)}


def pytest_report_header(config: pytest.Config) -> str:
    """Say in the report header which loop (for aiodat's tests), device and test bed the run uses."""
    device = os.environ.get("AIODAT_RXE_DEVICE") or "auto-detect"
    addr = os.environ.get("AIODAT_RXE_ADDR")
    header = f"aiodat: loop={_loop_name(config)} device={device} testbed={os.environ.get('AIODAT_TESTBED', 'none')}"
    return header + (f" address={addr}" if addr else "")  # (last: scripts match the fields before it)


_device_cache: Dict[str, Optional[RdmaDevice]] = {}
_device_cache_why: Dict[str, str] = {}  # why _device_cache holds None when the environment named a device


def _device_or_skip(config: Optional[pytest.Config] = None) -> RdmaDevice:
    # (without a config, as a suite's own device fixture may call it: the environment, checked the same way)
    required = (config.stash[_SETTINGS] if config is not None else _settings_from_env(None)).require_device
    if "d" not in _device_cache:
        try:
            _device_cache["d"] = _lookup()
        except ImportError as exc:
            pytest.fail(str(exc)) if required else pytest.skip(str(exc))
        except LookupError as exc:  # aiodat.ProviderNotFound: the environment names no port here
            _device_cache["d"], _device_cache_why["d"] = None, str(exc)
    device = _device_cache["d"]
    if device is None:
        why = _device_cache_why.get("d")  # (which names the variable, its value and the ports there are)
        if required:
            pytest.fail(f"AIODAT_REQUIRE_DEVICE={required} but no RDMA device is up"
                        + (f": {why}" if why else " (did rxe fail to come up?)"))
        pytest.skip(f"{why}; {HOW_TO_RUN}" if why else HOW_TO_RUN)
    return device


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip (or fail under AIODAT_REQUIRE_DEVICE=1) an ``rxe``-marked test when there is no device."""
    if item.get_closest_marker("rxe") is not None:
        _device_or_skip(item.config)


@pytest.fixture(scope="session")
def aiodat_loop(request: pytest.FixtureRequest) -> str:
    """The name of the event loop aiodat's tests run on (``"asyncio"`` or ``"uvloop"``), as chosen with
    ``--aiodat-loop`` / ``AIODAT_LOOP``.  Needs no device; using it makes an async test one of aiodat's.

    Session-scoped (it only reads the configuration), so fixtures of any scope can use it.
    """
    return _loop_name(request.config)


@pytest.fixture(scope="session")
def rdma_device(request: pytest.FixtureRequest) -> RdmaDevice:
    """The RDMA device to test on; skips (or fails under AIODAT_REQUIRE_DEVICE=1) when there is none.

    Session-scoped (it is only a name and an address), so a user's module- or
    session-scoped fixtures can open their own IA or connections from it.
    """
    return _device_or_skip(request.config)


@pytest.fixture
def ia(rdma_device: RdmaDevice) -> Iterator[Any]:
    """An IA open on ``rdma_device``, closed after the test."""
    from aiodat import open_ia

    handle = open_ia(rdma_device.name)
    try:
        yield handle
    finally:
        handle.close()


@dataclass
class EPPair:
    """Two connected endpoints on one IA, each with its own EVDs and a registered buffer.

    ``client``/``server`` are the EPs, ``client_lmr``/``server_lmr`` registered
    ``buffer_size``-byte bytearrays (local write, remote read/write/atomic), and
    ``pz`` the protection zone they share.  Each EP has its own EVDs:
    ``ep.recv_evd`` (receive completions), ``ep.request_evd`` (send, RDMA and
    atomic completions) and ``ep.connect_evd`` (connection events, e.g. the
    peer's DISCONNECTED); ``client_evds``/``server_evds`` list them.
    ``close()`` frees everything the pair made (the ``ep_pair`` fixture calls
    it after the test; the IA stays open).
    """

    ia: Any
    pz: Any
    client: Any
    server: Any
    client_lmr: Any
    server_lmr: Any
    psp: Any
    cr_evd: Any = None

    @property
    def client_evds(self) -> Tuple[Any, Any, Any]:
        """The client EP's (recv_evd, request_evd, connect_evd)."""
        return self.client.recv_evd, self.client.request_evd, self.client.connect_evd

    @property
    def server_evds(self) -> Tuple[Any, Any, Any]:
        """The server EP's (recv_evd, request_evd, connect_evd)."""
        return self.server.recv_evd, self.server.request_evd, self.server.connect_evd

    def close(self) -> None:
        """Free the EPs (dropping the connection), the LMRs, the PZ, the PSP and its EVD. Idempotent.
        A close that raises does not stop the others: the first error is raised once all were tried."""
        first_error: Optional[Exception] = None
        for handle in (self.psp, self.client, self.server, self.pz, self.cr_evd):
            if handle is not None and not handle.closed:
                try:
                    handle.close()
                except Exception as exc:  # (the rest would stay registered until the IA closes)
                    first_error = first_error or exc
        if first_error is not None:
            raise first_error


async def make_ep_pair(ia: Any, buffer_size: int = 4096, attrs: Any = None) -> EPPair:
    """Connect two fresh EPs of ``ia`` through a PSP on a free port and return them."""
    from aiodat import Privileges
    from aiodat.cm import connect_pair

    pz = ia.create_pz()
    try:  # (a failure part way frees what was made: the PZ's close takes its LMRs and EPs)
        privileges = Privileges.ALL
        client_lmr = pz.register(bytearray(buffer_size), privileges)
        server_lmr = pz.register(bytearray(buffer_size), privileges)
        client = ia.create_ep(pz, attrs=attrs)
        server = ia.create_ep(pz, attrs=attrs)
        pair = EPPair(ia, pz, client, server, client_lmr, server_lmr, None, None)
        pair.psp = await connect_pair(client, server)
    except BaseException:
        pz.close()
        raise
    pair.cr_evd = pair.psp.cr_evd
    return pair


def _test_loop_scope(item: Any) -> str:
    """The loop scope pytest-asyncio runs ``item`` in: its ``asyncio`` marker's, else the ini default."""
    marker = item.get_closest_marker("asyncio") if isinstance(item, pytest.Item) else None
    scope = marker.kwargs.get("loop_scope") or marker.kwargs.get("scope") if marker is not None else None
    return str(scope or item.config.getini("asyncio_default_test_loop_scope") or "function")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_fixture_setup(fixturedef: Any, request: pytest.FixtureRequest) -> Any:
    """Run ``ep_pair`` on the loop of the test that uses it.

    An aiodat object belongs to the loop it first waited on, and pytest-asyncio
    would connect the pair on the loop of ``asyncio_default_fixture_loop_scope``:
    with that set to ``session``, or in a test of ``loop_scope="module"``, every
    wait of the test on the pair raised InvalidState.
    """
    func: Any = getattr(fixturedef, "func", None)
    if (fixturedef.argname != "ep_pair" or getattr(func, "__module__", None) != __name__
            or not request.config.pluginmanager.has_plugin("asyncio")):
        return (yield)  # (a user's own ep_pair fixture keeps its loop; no pytest-asyncio, no loop scopes)
    # pytest-asyncio (wrapped by this hook) reads the loop scope from the function's _loop_scope
    saved = getattr(func, "_loop_scope", None)
    func._loop_scope = _test_loop_scope(request.node)
    try:
        return (yield)
    finally:
        func._loop_scope = saved


@_async_fixture
async def ep_pair(ia: Any) -> AsyncIterator[EPPair]:
    """Two endpoints connected to each other on ``ia`` (see :class:`EPPair`), freed after the test.

    The pair is connected on the event loop the test runs on, whatever its loop scope.
    """
    pair = await make_ep_pair(ia)
    try:
        yield pair
    finally:
        pair.close()
