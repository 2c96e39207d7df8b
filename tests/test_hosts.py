"""The two-host test bed's pure pieces, on the host (no guest): the mailbox protocol of
aiodat.testbed.hosts against a real agent process, and the generated guest scripts and QEMU
arguments of ``rxe run --hosts 2``."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Iterator

import pytest

from aiodat import testbed
from aiodat.testbed import _common, guest, hosts, modules, qemu_pair

HOSTS_PY = os.path.join(os.path.dirname(os.path.abspath(hosts.__file__)), "hosts.py")


@pytest.fixture
def agent(tmp_path: "os.PathLike[str]", monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A real agent serving ``tmp_path`` as host 1; we are host 0."""
    d = str(tmp_path)
    proc = subprocess.Popen([sys.executable, HOSTS_PY, "agent", "--dir", d, "--index", "1"],
                            stderr=subprocess.PIPE)
    end = time.monotonic() + 20
    while not os.path.exists(os.path.join(d, "ready-1")):
        assert proc.poll() is None and time.monotonic() < end, "agent did not come up"
        time.sleep(0.02)
    monkeypatch.setenv("AIODAT_HOSTS", "2")
    monkeypatch.setenv("AIODAT_HOSTS_DIR", d)
    monkeypatch.setenv("AIODAT_HOST_INDEX", "0")
    monkeypatch.setenv("AIODAT_HOST_ADDRS", ",".join(testbed.HOST_ADDRS))
    yield d
    proc.kill()
    proc.wait()


def test_unavailable_outside_a_two_host_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIODAT_HOSTS", raising=False)
    assert not hosts.available() and hosts.count() == 1
    with pytest.raises(hosts.HostsUnavailable, match="--hosts 2"):
        hosts.run_on(1, ["true"])


def test_run_on_peer_returns_status_and_output(agent: str) -> None:
    assert hosts.this_host() == 0 and hosts.peer() == 1 and hosts.address(1) == "169.254.78.2"
    res = hosts.run_on(1, ["sh", "-c", "echo out; echo err >&2; echo $EXTRA; exit 3"], env={"EXTRA": "x1"},
                       timeout=30)
    assert res == hosts.Result(3, "out\nx1\n", "err\n")
    with pytest.raises(RuntimeError, match="exited with 3"):
        res.check()
    assert hosts.run_on(1, ["/nonexistent/program"], timeout=30).rc == 127


def test_kill_on_peer_and_on_self(agent: str) -> None:
    for host in (1, 0):
        p = hosts.start_on(host, ["sh", "-c", "echo started; exec sleep 1000"])
        assert p.wait_started(30) > 0
        import asyncio

        asyncio.run(p.wait_output("started", 30))
        assert p.poll() is None
        p.kill(signal.SIGKILL)
        assert p.wait(30).rc == 128 + signal.SIGKILL
    q = hosts.start_on(1, ["sleep", "1000"])
    with pytest.raises(TimeoutError):
        q.wait(0.2)
    q.kill()
    assert q.wait(30).rc == 137


def test_guest_scripts_for_two_hosts(tmp_path: "os.PathLike[str]") -> None:
    kernel = modules.Kernel("6.1.0-test", "/boot/vmlinuz-6.1.0-test", "/lib/modules/6.1.0-test")
    plan = guest.GuestPlan(
        index=0, cmd=["true"], cwd="/work", env={}, rw_paths=[], kernel=kernel, busybox="/bin/busybox",
        qemu="qemu-system-x86_64", memory="2G", cpus=2, accel="tcg", addr=testbed.HOST_ADDRS[0],
        nic=("stream,id=aiodatnet,server=on,addr.type=unix,addr.path=/tmp/x.sock", _common.HOST_MACS[0]),
        hosts_dir=str(tmp_path), wait_for="ready-1")
    stage2 = guest.stage2_script(plan)
    assert "type dummy" not in stage2
    assert "virtio_net sch_netem" in stage2 and _common.HOST_MACS[0] in stage2
    assert 'name aiodat0' in stage2 and "169.254.78.1/24" in stage2
    assert "aiodathosts /run/aiodat-hosts" in stage2 and "ready-1" in stage2
    assert stage2.index("rdma link add") < stage2.index("ready-1") < stage2.index("run.sh")
    argv = guest.qemu_argv(plan, "/initrd", "/ctl", {"con": 3, "out": 4, "err": 5})
    assert "-nic" not in argv
    assert plan.nic[0] in argv and "virtio-net-pci,netdev=aiodatnet,mac=%s" % _common.HOST_MACS[0] in argv
    assert any("mount_tag=aiodathosts" in a for a in argv)
    single = guest.GuestPlan(index=0, cmd=["true"], cwd="/work", env={}, rw_paths=[], kernel=kernel,
                            busybox="/bin/busybox", qemu="q", memory="2G", cpus=2, accel="tcg")
    assert "type dummy" in guest.stage2_script(single)
    assert "none" == guest.qemu_argv(single, "/i", "/c", {"con": 3, "out": 4, "err": 5})[
        guest.qemu_argv(single, "/i", "/c", {"con": 3, "out": 4, "err": 5}).index("-nic") + 1]


def test_hosts_env() -> None:
    env = qemu_pair.hosts_env({"PATH": "/bin"}, 1, "/run/aiodat-hosts")
    assert env["AIODAT_RXE_ADDR"] == "169.254.78.2" and env["AIODAT_PEER_ADDR"] == "169.254.78.1"
    assert env["AIODAT_HOSTS"] == "2" and env["AIODAT_HOST_INDEX"] == "1" and env["PATH"] == "/bin"


def test_cli_rejects_bad_hosts() -> None:
    assert testbed.main(["run", "--hosts", "3", "--", "true"]) == 2
    with pytest.raises(ValueError):
        testbed.run(["true"], timeout=1, hosts=2, method="native")
