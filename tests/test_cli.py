"""The ``aiodat`` command line, ``python -m aiodat``, the benchmark and the echo examples.

Host-only tests check argument handling and the no-device message; the
``rxe`` tests run the real commands against the test bed's device.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from procs import live_pids

from aiodat import ProviderNotFound, bench
from aiodat.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def run_module(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiodat", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


# -- host-only -----------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    [],
    ["bogus"],
    ["query", "--bogus"],
    ["bench"],
    ["bench", "latency", "--iters", "x"],
    ["bench", "latency", "--loop", "trio"],
    ["ping"],
    ["ping", "169.254.77.1"],
    ["ping", "169.254.77.1", "99999"],  # checked before any device is looked for
    ["ping", "--server", "-1"],
    ["ping", "169.254.77.1", "7471", "--server", "7000"],  # a server takes no HOST or PORT
])
def test_usage_errors_exit_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "error" in err


@pytest.mark.parametrize("argv, said", [
    (["bench", "latency", "--iters", "0"], "argument --iters/-n: must be >= 1, got 0"),
    (["bench", "latency", "--size", "3000000000"], "argument --size/-s: must be between 1 and 2147483648"),
    (["bench", "latency", "--repeat", "-2"], "argument --repeat: must be >= 1, got -2"),
    (["bench", "latency", "--busy-poll-us", "-1"], "argument --busy-poll-us: must be between 0 and 1000000"),
    (["bench", "bandwidth", "--size", "4294967296"], "argument --size/-s: must be between 1 and 2147483648"),
    (["bench", "rate", "--depth", "0"], "argument --depth/-t: must be >= 1, got 0"),
    (["bench", "rate", "--batch", "0"], "argument --batch: must be >= 1, got 0"),
    (["bench", "streams", "--write-size", "0"], "argument --write-size: must be >= 1, got 0"),
    (["bench", "streams", "--iters", "0"], "argument --iters/-n: must be >= 1, got 0"),
    (["bench", "connect", "--connections", "-5"], "argument --connections/-c: must be >= 1, got -5"),
    (["bench", "connect", "--repeat", "0"], "argument --repeat: must be >= 1, got 0"),
    (["bench", "dask", "--size", "0"], "argument --size/-s: must be >= 1, got 0"),
    (["ping", "1.2.3.4", "7471", "--count", "0"], "argument --count/-c: must be >= 1, got 0"),
    (["ping", "1.2.3.4", "7471", "--size", "5000"], "argument --size/-s: must be between 1 and 4096, got 5000"),
    (["ping", "1.2.3.4", "0"], "PORT must be between 1 and 65535, got 0"),  # (0 is a listener's "pick one")
    (["ping", "--server", "70000"], "--server PORT must be between 0 and 65535, got 70000"),
])
def test_out_of_range_values_name_the_flag(argv, said, capsys):
    """A value out of range is a usage error naming that flag and value (not a list of every rule),
    refused before any device is looked for."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and "usage:" in err, err


@pytest.mark.parametrize("argv, said", [
    (["bench", "rate", "--batch", "64", "--depth", "8"], "--batch (64) cannot exceed --depth (8)"),
    (["bench", "streams", "--total", "10", "--write-size", "100"], "--total (10) must be at least --write-size (100)"),
])
def test_values_out_of_step_name_both(argv, said, capsys):
    assert main(argv) == 2
    assert said in capsys.readouterr().err


def test_busy_poll_max_is_the_pollers():
    from aiodat import cli
    from aiodat.poller import MAX_BUSY_POLL_US

    assert cli.BUSY_POLL_MAX == MAX_BUSY_POLL_US


@pytest.mark.parametrize("exc", [MemoryError(), OverflowError("cannot fit 'int' into an index-sized integer"),
                                 OSError(24, "Too many open files")])
def test_a_bench_out_of_resources_is_one_line(exc, monkeypatch, capsys):
    """--iters 10**10 (a list of time stamps), a huge --depth: exit 1 with what ran out, no traceback."""
    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(bench, "bench_latency", fail)
    assert main(["bench", "latency", "--iters", "10000000000", "--no-perftest"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"aiodat bench latency: {type(exc).__name__}") and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _interrupt_in(seconds):
    """Raise KeyboardInterrupt in the main thread after ``seconds``, as Ctrl-C does."""
    import signal

    def raise_kbi(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, raise_kbi)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    return lambda: (signal.setitimer(signal.ITIMER_REAL, 0), signal.signal(signal.SIGALRM, old))


@pytest.mark.parametrize("tool", ["ib_send_lat", "rstream"])
def test_ctrl_c_during_a_peer_tool_stops_its_server(tool, tmp_path, monkeypatch):
    """Ctrl-C while perftest's or rstream's pair runs: both processes end at once (the server used to
    be waited for until the run's deadline, then killed)."""
    import time

    from aiodat.bench.perftest import run_perftest_pair
    from aiodat.bench.rstream import run_rstream_pair

    pids = tmp_path / "pids"
    fake = tmp_path / tool
    fake.write_text(f"#!/bin/sh\necho $$ >> {pids}\nexec sleep 300\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    restore = _interrupt_in(1.0)
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            if tool == "rstream":
                run_rstream_pair("192.0.2.1", [], timeout=30.0, start_delay=0.1)
            else:
                run_perftest_pair(tool, [], device="rxe0", address="192.0.2.1", timeout=30.0, start_delay=0.1)
        took = time.monotonic() - start
    finally:
        restore()
        started = [int(p) for p in pids.read_text().split()] if pids.exists() else []
        deadline = time.monotonic() + 3  # (SIGKILL sent: give the kernel a moment)
        while any(_alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [p for p in started if _alive(p)]
        for pid in left:
            os.kill(pid, 9)
    assert len(started) == 2 and not left, (started, left)
    assert took < 10, took


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_ctrl_c_during_a_run_kills_its_child(loop, monkeypatch):
    """Ctrl-C stops run_on_loop between two steps: the run is cancelled and its finally blocks kill
    the child server it started (a stream server serves forever; it used to be left running)."""
    import asyncio

    from aiodat.bench import streams_vs_tcp
    from aiodat.bench.harness import run_on_loop

    pytest.importorskip(loop)
    children = []
    start_child = streams_vs_tcp.start_child

    async def recording(args, loop_name):
        proc, port = await start_child(args, loop_name)
        children.append(proc)
        asyncio.get_running_loop().call_later(0.5, interrupt)  # mid-run
        return proc, port

    monkeypatch.setattr(streams_vs_tcp, "start_child", recording)

    def interrupt():
        raise KeyboardInterrupt

    async def run():
        # (so much to send that Ctrl-C comes first)
        return await streams_vs_tcp.measure_child(asyncio, "tcp", "127.0.0.1", 65536, 1 << 42, 64, 10, loop)

    try:
        with pytest.raises(KeyboardInterrupt):
            run_on_loop(loop, run)
        assert len(children) == 1
        assert not _alive(children[0].pid)
    finally:
        for proc in children:
            if _alive(proc.pid):
                os.kill(proc.pid, 9)


def test_ctrl_c_in_a_bench_child_is_quiet():
    """Ctrl-C goes to the whole process group: a child (`python -m aiodat.bench ...`) ends with 130
    and no traceback; the parent says it was interrupted."""
    import signal

    # (SIGINT at its default in the child: a shell's background job, as CI may run this, inherits it ignored)
    child = subprocess.Popen([sys.executable, "-m", "aiodat.bench", "stream-server", "tcp", "127.0.0.1", "0", "0",
                              "asyncio"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert child.stdout.readline().startswith("port ")
        child.send_signal(signal.SIGINT)
        _out, err = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 130 and "Traceback" not in err, err


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("devices", "query", "rxe", "ping", "bench"):
        assert command in out


def test_rxe_delegates_to_the_testbed(capsys):
    assert main(["rxe", "--help"]) == 0
    assert "rxe run" in capsys.readouterr().out
    assert main(["rxe", "frobnicate"]) == 2


def test_python_m_aiodat_same_as_main():
    result = run_module("bench", "latency", "--size", "0", timeout=60)
    assert result.returncode == 2
    assert "argument --size/-s: must be between 1 and 2147483648, got 0" in result.stderr


def test_cli_py_run_as_a_script():
    """`python aiodat/cli.py ...` runs main() only once the whole module is defined."""
    result = subprocess.run([sys.executable, os.path.join(ROOT, "aiodat", "cli.py"), "--help"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "devices" in result.stdout and "NameError" not in result.stderr


def test_query_without_device_says_how(monkeypatch, capsys):
    from aiodat import list_providers

    if list_providers():
        pytest.skip("this machine has an RDMA device")
    monkeypatch.delenv("AIODAT_RXE_DEVICE", raising=False)
    assert main(["query"]) == 1
    err = capsys.readouterr().err
    assert "no RDMA device" in err and "aiodat rxe run -- aiodat query" in err
    assert main(["devices"]) == 1


def _fake_ports(monkeypatch):
    """Two ports (an active one first, then a down one) in place of this machine's, for the one
    reading of AIODAT_RXE_DEVICE / AIODAT_RXE_ADDR (aiodat.ia.environment_port)."""
    import aiodat
    import aiodat.ia
    from aiodat import Provider

    ports = [Provider("mlx0", "mlx0", 1, "Ethernet", "PORT_ACTIVE", (), ("10.0.0.1",)),
             Provider("rxe1", "rxe1", 1, "Ethernet", "PORT_DOWN", (), ("10.0.0.2",))]
    for where in (aiodat, aiodat.ia):  # (the package's name, and the one aiodat.ia's functions call)
        monkeypatch.setattr(where, "list_providers", lambda: ports)
    monkeypatch.setattr("aiodat.cli._providers", lambda: ports)
    return ports


@pytest.mark.parametrize("var,value", [("AIODAT_RXE_DEVICE", "nosuchdev9"), ("AIODAT_RXE_DEVICE", "rxe1"),
                                       ("AIODAT_RXE_ADDR", "10.9.9.9")])
def test_an_environment_naming_no_port_is_an_error(monkeypatch, capsys, var, value):
    """AIODAT_RXE_DEVICE (or AIODAT_RXE_ADDR) alone naming no active port stops the benchmark, query and
    ping with one line naming the variable, its value and the ports there are, exit status 1 as a wrong
    --device or NAME: the benchmark used to run on the first device, saying nothing."""
    _fake_ports(monkeypatch)
    for each in ("AIODAT_RXE_DEVICE", "AIODAT_RXE_ADDR"):
        monkeypatch.delenv(each, raising=False)
    monkeypatch.setenv(var, value)
    expected = (f"no active port matches {var}={value} (set in the environment); the RDMA ports here: "
                "mlx0 (PORT_ACTIVE, 10.0.0.1); rxe1 (PORT_DOWN, 10.0.0.2)")
    with pytest.raises(ProviderNotFound) as caught:
        bench.device_and_address()
    assert str(caught.value) == expected
    for argv in (["bench", "latency", "--iters", "1", "--repeat", "1"], ["bench", "rate"], ["query"],
                 ["ping", "10.0.0.1", "7471"]):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err == f"aiodat {argv[0]}{' ' + argv[1] if argv[0] == 'bench' else ''}: {expected}\n", argv


def test_an_environment_naming_a_port_picks_it(monkeypatch):
    """Either variable alone picks the active port it names (AIODAT_RXE_ADDR alone was ignored too);
    both are taken as given; neither: the first active port."""
    _fake_ports(monkeypatch)
    monkeypatch.delenv("AIODAT_RXE_ADDR", raising=False)
    monkeypatch.setenv("AIODAT_RXE_DEVICE", "mlx0:1")
    assert bench.device_and_address() == ("mlx0:1", "10.0.0.1")
    monkeypatch.delenv("AIODAT_RXE_DEVICE")
    monkeypatch.setenv("AIODAT_RXE_ADDR", "10.0.0.1")
    assert bench.device_and_address() == ("mlx0", "10.0.0.1")
    monkeypatch.setenv("AIODAT_RXE_DEVICE", "given0")
    assert bench.device_and_address() == ("given0", "10.0.0.1")
    for each in ("AIODAT_RXE_DEVICE", "AIODAT_RXE_ADDR"):
        monkeypatch.delenv(each)
    assert bench.device_and_address() == ("mlx0", "10.0.0.1")


def _echo_server_module():
    """examples/echo_server.py, imported (a script, not part of a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("echo_server_example", os.path.join(EXAMPLES, "echo_server.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Opened(Exception):
    """Raised by the fake open_ia once it has recorded its arguments: nothing further runs."""


@pytest.mark.parametrize("argv, env, expected", [
    (["--host", "169.254.77.9"], None, "169.254.77.9"),
    ([], "169.254.77.8", "169.254.77.8"),  # $AIODAT_RXE_ADDR is the default
    ([], None, None),  # neither: open_ia's default, the device's first address
    ([], "", None),
])
def test_echo_server_opens_the_ia_on_host(argv, env, expected, monkeypatch):
    """--host is where the PSP listens: the IA is opened on that address (no device is opened here)."""
    import asyncio

    import aiodat

    echo_server = _echo_server_module()
    seen = []

    def fake_open_ia(name, *args, address=None, **kwargs):
        seen.append((name, address))
        raise _Opened

    monkeypatch.setattr(echo_server, "default_device", lambda: "rxe9")
    monkeypatch.setattr(aiodat, "open_ia", fake_open_ia)
    if env is None:
        monkeypatch.delenv("AIODAT_RXE_ADDR", raising=False)
    else:
        monkeypatch.setenv("AIODAT_RXE_ADDR", env)
    with pytest.raises(_Opened):
        asyncio.run(echo_server.main(argv))
    assert seen == [("rxe9", expected)]


def test_echo_server_host_not_on_the_device_is_a_clear_error(monkeypatch):
    import asyncio

    import aiodat

    echo_server = _echo_server_module()

    def fake_open_ia(name, *args, address=None, **kwargs):
        raise aiodat.InvalidParameter(f"{address!r} is not an address of {name}; its netdevs have: 169.254.77.1")

    monkeypatch.setattr(echo_server, "default_device", lambda: "rxe9")
    monkeypatch.setattr(aiodat, "open_ia", fake_open_ia)
    with pytest.raises(SystemExit) as exc:
        asyncio.run(echo_server.main(["--host", "10.1.2.3"]))
    text = str(exc.value.code)
    assert "--host 10.1.2.3" in text and "169.254.77.1" in text


def test_parse_perftest_table():
    output = """
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] 
 2       500          11.82          201.51       12.05    	       12.96       	7.45   		40.06   		201.51 
---------------------------------------------------------------------------------------
"""
    rows = bench.parse_perftest(output)
    assert rows == [{"#bytes": 2.0, "#iterations": 500.0, "t_min[usec]": 11.82, "t_max[usec]": 201.51,
                     "t_typical[usec]": 12.05, "t_avg[usec]": 12.96, "t_stdev[usec]": 7.45,
                     "99%_percentile[usec]": 40.06, "99.9%_percentile[usec]": 201.51}]


def test_percentile_nearest_rank():
    values = list(range(1, 101))
    assert bench.percentile(values, 50) == 50
    assert bench.percentile(values, 99) == 99
    assert bench.percentile([7.0], 99) == 7.0


# -- on rxe --------------------------------------------------------------------------


@pytest.mark.loop_independent
@pytest.mark.rxe
def test_devices_lists_the_port(rdma_device, capsys):
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^\s+{re.escape(rdma_device.name)}\s+\S+\s+1\s+PORT_ACTIVE\s+Ethernet\s+[0-9a-f]{{4}}:",
                     out, re.M), out
    assert f"::ffff:{rdma_device.address}" in out


@pytest.mark.loop_independent
@pytest.mark.rxe
def test_python_m_aiodat_devices(rdma_device):
    result = run_module("devices")
    assert result.returncode == 0, result.stderr
    assert rdma_device.name in result.stdout and "PORT_ACTIVE" in result.stdout


@pytest.mark.loop_independent
@pytest.mark.rxe
def test_query_json_matches_ia_query(ia, rdma_device, capsys):
    assert main(["query", rdma_device.name, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = json.loads(json.dumps(ia.query().as_dict()))
    assert printed == expected
    assert printed["ia_attr"]["adapter_name"]
    assert printed["ia_attr"]["max_eps"] == ia.query().ia_attr.max_eps


@pytest.mark.loop_independent
@pytest.mark.rxe
def test_query_default_name_and_text(ia, rdma_device, capsys, monkeypatch):
    monkeypatch.setenv("AIODAT_RXE_DEVICE", rdma_device.name)
    assert main(["query"]) == 0
    out = capsys.readouterr().out
    q = ia.query()
    assert f"max_eps: {q.ia_attr.max_eps}" in out
    assert f"max_evd_qlen: {q.ia_attr.max_evd_qlen}" in out
    assert f"provider_name: {q.provider_attr.provider_name}" in out


@pytest.mark.loop_independent
@pytest.mark.rxe
def test_bench_refuses_an_environment_device_that_is_not_there(rdma_device, monkeypatch, capsys):
    """AIODAT_RXE_DEVICE alone naming no port: the benchmark stops before it starts, naming the
    variable, its value and the ports there are (it ran on the first device, saying nothing); naming
    the device's port picks it, with that port's address."""
    from aiodat import list_providers

    monkeypatch.delenv("AIODAT_RXE_ADDR", raising=False)
    monkeypatch.setenv("AIODAT_RXE_DEVICE", "nosuchdev9")
    assert main(["bench", "latency", "--iters", "1", "--repeat", "1", "--no-perftest", "--no-pyverbs",
                 "--mode", "await"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("aiodat bench latency: no active port matches AIODAT_RXE_DEVICE=nosuchdev9 "), err
    port = next(p for p in list_providers() if p.state == "PORT_ACTIVE" and p.addresses)
    assert f"{port.name} (PORT_ACTIVE, {port.addresses[0]}" in err and err.count("\n") == 1, err
    assert main(["query"]) == 1 and "AIODAT_RXE_DEVICE=nosuchdev9" in capsys.readouterr().err
    monkeypatch.setenv("AIODAT_RXE_DEVICE", port.name)
    assert bench.device_and_address() == (port.name, port.addresses[0])


@pytest.mark.loop_independent
@pytest.mark.rxe
def test_query_unknown_name(capsys):
    assert main(["query", "nosuchdev0"]) == 1
    assert "nosuchdev0" in capsys.readouterr().err


@pytest.mark.loop_independent
@pytest.mark.rxe
def test_ping_against_ping_server(rdma_device, capsys):
    # port 0: the server prints the port it was given (it used to print ":0")
    server = subprocess.Popen([sys.executable, "-u", "-m", "aiodat", "ping", "--server", "0"],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = server.stdout.readline()
        assert "listening" in line, line
        port = int(line.rsplit(":", 1)[1])
        assert port > 0, line
        assert main(["ping", rdma_device.address, str(port), "--count", "3", "--size", "100"]) == 0
        out = capsys.readouterr().out
        assert len(re.findall(r"100 bytes from .*seq=\d rtt=[\d.]+ us", out)) == 3, out
        assert "3 round trips" in out
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.loop_independent
@pytest.mark.rxe
def test_echo_demo(rdma_device):
    result = subprocess.run([sys.executable, os.path.join(EXAMPLES, "demo.py"), "--count", "5", "--size", "100"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "server: listening on" in out
    assert len(re.findall(r"client: 100 bytes echoed .* seq=\d rtt=[\d.]+ us", out)) == 5, out
    assert "client: 5 echoes verified" in out
    assert "demo: ok" in out


@pytest.mark.loop_independent
@pytest.mark.rxe
def test_echo_client_reports_a_missing_server(rdma_device):
    result = subprocess.run([sys.executable, os.path.join(EXAMPLES, "echo_client.py"), "--port", "9",
                             "--count", "1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode != 0
    assert "Rejected" in result.stderr or "Unreachable" in result.stderr or "rejected" in result.stderr


def _session(sid):
    """The live processes of session ``sid`` (pid, command line)."""
    found = []
    for pid in live_pids("sid", sid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found.append((pid, f.read().replace(b"\0", b" ").decode(errors="replace")))
        except OSError:
            continue  # gone meanwhile
    return found


@pytest.mark.rxe
@pytest.mark.parametrize("target", ["group", "parent"])
@pytest.mark.parametrize("which", ["latency", "rate"])
def test_ctrl_c_mid_bench_leaves_nothing_running(which, target, rdma_device, request):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it, or to aiodat alone) while aiodat's
    child runs: exit 130 saying so, no traceback from any process, no child left (it used to wait
    for its peer forever, or print a KeyboardInterrupt traceback)."""
    import signal
    import time

    loop = request.config.getoption("--aiodat-loop") or "asyncio"
    argv = [sys.executable, "-m", "aiodat", "bench", which, "--repeat", "1", "--mode", "await", "--no-perftest",
            "--progress", "--loop", loop, "--device", rdma_device.name]
    argv += ["--iters", "2000000", "--processes", "2", "--no-pyverbs"] if which == "latency" else ["--iters", "100000000"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True,  # (SIGINT at its default: see the test above)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert "round 1: aiodat await" in proc.stderr.readline()
        deadline = time.monotonic() + 60
        while not any("aiodat.bench" in cmd for _pid, cmd in _session(proc.pid)):
            assert time.monotonic() < deadline and proc.poll() is None, "the bench child did not start"
            time.sleep(0.2)
        time.sleep(2.0)  # mid-run
        if target == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
        time.sleep(1.0)
        left = _session(proc.pid)
    finally:
        for pid, _cmd in _session(proc.pid):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.wait()
    assert proc.returncode == 130 and "aiodat: interrupted" in err, err
    assert "Traceback" not in err, err
    assert not left, left


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_bench_child_ignores_ctrl_c(loop):
    """The terminal's Ctrl-C reaches the bench's children too: they ignore it, so none prints a
    traceback (not even while still importing), and the interrupted parent kills them."""
    import signal

    from aiodat.bench.harness import run_on_loop
    from aiodat.bench.peer import kill_child, start_child

    pytest.importorskip(loop)

    async def run():
        proc, port = await start_child(["stream-server", "tcp", "127.0.0.1", "0", "0"], loop)
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                ignored = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
            os.kill(proc.pid, signal.SIGINT)
            await asyncio.sleep(0.5)
            return port, ignored, proc.returncode
        finally:
            await kill_child(proc)

    import asyncio

    port, ignored, returncode = run_on_loop(loop, run)
    assert port > 0 and ignored & (1 << (signal.SIGINT - 1)) and returncode is None


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_bench_child_interrupted_while_starting_ignores_it(loop, tmp_path, monkeypatch):
    """Ctrl-C reaching a bench child while its interpreter still starts (its site import, before any
    line of aiodat; here a sitecustomize that takes a second) is ignored too: the child goes on to
    serve and prints nothing.  A child that ignored it from its first line of code died there with
    "Fatal Python error: init_import_site" and a traceback (a busy host, 2026-11-30)."""
    import asyncio
    import signal

    from aiodat.bench import peer
    from aiodat.bench.harness import run_on_loop

    pytest.importorskip(loop)
    (tmp_path / "sitecustomize.py").write_text("import time\nprint('starting', flush=True)\ntime.sleep(1)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))

    async def run():
        proc = await asyncio.create_subprocess_exec(
            *peer._CHILD, "stream-server", "tcp", "127.0.0.1", "0", "0", loop, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            first = await asyncio.wait_for(proc.stdout.readline(), 60)
            os.kill(proc.pid, signal.SIGINT)  # (inside the site import)
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
        finally:
            await peer.kill_child(proc)
        return first, line, await proc.stderr.read()

    first, line, err = run_on_loop(loop, run)
    assert first == b"starting\n" and not err, err.decode(errors="replace")
    assert line.startswith(b"port "), line


def test_docs_name_every_flag_in_its_section():
    """docs/cli.md and the parser agree: each subcommand has its section, and each of its flags is named
    there (the shared bench flags once, above)."""
    import argparse

    from aiodat.cli import _parser

    with open(os.path.join(ROOT, "docs", "cli.md")) as f:
        doc = f.read()
    sections = {s.split("\n")[0]: s for s in doc.split("\n## ")[1:] + doc.split("\n### ")[1:]}
    shared = {"--help", "--loop", "--repeat", "--device", "--json", "--progress"}

    def subcommands(parser):
        return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))

    commands = {f"aiodat {name}": sp for name, sp in subcommands(_parser()).items() if name != "bench"}
    commands.update({f"aiodat bench {name}": sp for name, sp in subcommands(subcommands(_parser())["bench"]).items()})
    missing = []
    for command, sp in commands.items():
        section = next((text for head, text in sections.items()
                        if f"`{command}`" in head or f"`{command} " in head), None)
        if section is None:
            missing.append(command)
            continue
        missing += [f"{command} {flag}" for a in sp._actions for flag in a.option_strings
                    if flag.startswith("--") and flag not in shared and flag not in section]
    assert not missing, missing


def test_output_into_a_closed_pipe_is_quiet():
    """`aiodat ... | head -1`: the reader has gone; exit without a BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)
    try:
        # (a device's `aiodat query` prints pages; here a stand-in prints more than a pipe buffer)
        code = ("import aiodat.cli as cli; cli.cmd_devices = lambda: print('x' * 100000) or 0; "
                "raise SystemExit(cli.main(['devices']))")
        result = subprocess.run([sys.executable, "-c", code], stdout=write,
                                stderr=subprocess.PIPE, text=True, timeout=60, cwd=ROOT)
    finally:
        os.close(write)
    assert result.returncode == 1 and "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, \
        result.stderr


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_ctrl_c_cancels_every_task_of_the_run(loop):
    """The soak runs a task per connection: after Ctrl-C each is cancelled and ends (its finally frees
    what it holds), none is left pending on a closed loop."""
    import asyncio

    from aiodat.bench.harness import run_on_loop

    pytest.importorskip(loop)
    tasks, cleaned = [], []

    async def worker():
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.append(True)

    def interrupt():
        raise KeyboardInterrupt

    async def run():
        tasks.extend(asyncio.ensure_future(worker()) for _ in range(3))
        asyncio.get_running_loop().call_later(0.2, interrupt)
        await asyncio.sleep(3600)

    with pytest.raises(KeyboardInterrupt):
        run_on_loop(loop, run)
    assert all(t.cancelled() for t in tasks) and len(cleaned) == 3
