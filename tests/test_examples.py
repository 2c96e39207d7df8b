"""Every file in examples/ runs on the device and prints what shows it worked.

A new example without an entry in EXAMPLES fails ``test_every_example_is_covered``,
so none can be added without being run here.
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, List, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE_DIR = os.path.join(ROOT, "examples")

# file -> (arguments, lines the output must contain)
EXAMPLES: Dict[str, Tuple[List[str], List[str]]] = {
    "aiohttp_rdma.py": (["demo"], ["echoed intact: True", "got 'desserts'", "aiohttp over RDMA: ok"]),
    "dask_rdma.py": (["--size-mib", "16"], ["checksum matches: True", "dask over rdma:// ok"]),
    "grpc_rdma.py": (["--calls", "10"], ["1 MiB message verified", "over RDMA"]),
    "httpx_rdma.py": (["--requests", "10"], ["1 MiB echo verified", "over RDMA"]),
    "demo.py": (["--count", "3", "--size", "32"], ["3 echoes verified", "demo: ok"]),
    # echo_server.py and echo_client.py are the two halves demo.py starts and checks
    "echo_server.py": (["__via__", "demo.py"], []),
    "echo_client.py": (["__via__", "demo.py"], []),
    "kv_atomic.py": (["--clients", "2", "--increments", "10"],
                     ["counter = 20 (expected 20)", "distinct and complete: True"]),
    "kvstore.py": (["demo", "--transport", "rdma"],
                   ["FETCH blob sha256 matches: True", "demo done over aiodat (RDMA)"]),
    # nvmeof.py needs the kernel's NVMe-oF target, which tests/test_nvmeof.py sets up and runs it against
    "nvmeof.py": (["__via__", "test_nvmeof.py"], []),
    "rdma_write.py": (["--size", "262144"], ["contents verified"]),
    "srq_server.py": (["--clients", "3", "--messages", "10"],
                      ["received 30 of 30 messages from 3 clients", "every message arrived, in order"]),
}


#: examples that free all they make: run with ResourceWarning shown (their children too), none may appear
#: (an unclosed LMR or pipe there teaches the reader to leave them; the framework examples are left out,
#: as their libraries' own warnings are not aiodat's to answer for)
FREES_ALL = {"demo.py", "kv_atomic.py", "kvstore.py", "rdma_write.py", "srq_server.py"}


def test_every_example_is_covered() -> None:
    present = sorted(f for f in os.listdir(EXAMPLE_DIR) if f.endswith(".py"))
    assert present == sorted(EXAMPLES), "add the new example to tests/test_examples.py"


@pytest.mark.loop_independent
@pytest.mark.rxe
@pytest.mark.parametrize("name", sorted(n for n, (args, _) in EXAMPLES.items() if args[:1] != ["__via__"]))
def test_example_runs(name: str) -> None:
    args, expected = EXAMPLES[name]
    env = dict(os.environ, PYTHONWARNINGS="always::ResourceWarning") if name in FREES_ALL else None
    result = subprocess.run([sys.executable, os.path.join(EXAMPLE_DIR, name), *args], cwd=ROOT,
                            capture_output=True, text=True, timeout=600, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{name} exited {result.returncode}:\n{output[-3000:]}"
    for line in expected:
        assert line in output, f"{name} did not print {line!r}:\n{output[-3000:]}"
    if name in FREES_ALL:
        assert "ResourceWarning" not in output, f"{name} left something unclosed:\n{output[-3000:]}"


def test_kvstore_runs_over_tcp_unchanged() -> None:
    """The same service over asyncio's TCP streams (no device needed)."""
    result = subprocess.run([sys.executable, os.path.join(EXAMPLE_DIR, "kvstore.py"), "demo", "--transport", "tcp"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "demo done over asyncio (TCP)" in result.stdout


@pytest.mark.parametrize("script", ["echo_client.py", "demo.py"])
@pytest.mark.parametrize("args,message", [(["--size", "5000"], "--size 5000: must be 1 to 4096"),
                                          (["--count", "0"], "--count 0: must be at least 1")])
def test_echo_client_refuses_what_the_server_cannot_echo(script: str, args: List[str], message: str) -> None:
    """A message larger than the echo server's receive buffer, or no message at all, is a usage error
    before anything is opened or started (the client failed with a completion error on both sides, or a
    traceback; the demo started the server first, which then waited for a client that never came)."""
    result = subprocess.run([sys.executable, os.path.join(EXAMPLE_DIR, script), *args],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stdout + result.stderr
