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

from aiodat import bench
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
    assert "--size and --iters must be >= 1" in result.stderr


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


@pytest.mark.rxe
def test_devices_lists_the_port(rdma_device, capsys):
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^\s+{re.escape(rdma_device.name)}\s+\S+\s+1\s+PORT_ACTIVE\s+Ethernet\s+[0-9a-f]{{4}}:",
                     out, re.M), out
    assert f"::ffff:{rdma_device.address}" in out


@pytest.mark.rxe
def test_python_m_aiodat_devices(rdma_device):
    result = run_module("devices")
    assert result.returncode == 0, result.stderr
    assert rdma_device.name in result.stdout and "PORT_ACTIVE" in result.stdout


@pytest.mark.rxe
def test_query_json_matches_ia_query(ia, rdma_device, capsys):
    assert main(["query", rdma_device.name, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = json.loads(json.dumps(ia.query().as_dict()))
    assert printed == expected
    assert printed["ia_attr"]["adapter_name"]
    assert printed["ia_attr"]["max_eps"] == ia.query().ia_attr.max_eps


@pytest.mark.rxe
def test_query_default_name_and_text(ia, rdma_device, capsys, monkeypatch):
    monkeypatch.setenv("AIODAT_RXE_DEVICE", rdma_device.name)
    assert main(["query"]) == 0
    out = capsys.readouterr().out
    q = ia.query()
    assert f"max_eps: {q.ia_attr.max_eps}" in out
    assert f"max_evd_qlen: {q.ia_attr.max_evd_qlen}" in out
    assert f"provider_name: {q.provider_attr.provider_name}" in out


@pytest.mark.rxe
def test_query_unknown_name(capsys):
    assert main(["query", "nosuchdev0"]) == 1
    assert "nosuchdev0" in capsys.readouterr().err


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


@pytest.mark.rxe
def test_echo_client_reports_a_missing_server(rdma_device):
    result = subprocess.run([sys.executable, os.path.join(EXAMPLES, "echo_client.py"), "--port", "9",
                             "--count", "1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode != 0
    assert "Rejected" in result.stderr or "Unreachable" in result.stderr or "rejected" in result.stderr
