"""Tests of the rxe test bed (aiodat.testbed).

Most tests need no RDMA device and no guest: they check the pure pieces (the
cpio writer, module ordering, the status report on a fake filesystem, the
scripts handed to the guest).  The ones marked ``testbed`` really boot a QEMU
guest (or use native rxe) and take tens of seconds.
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
import subprocess
import sys
import time

import pytest

from aiodat import testbed
from aiodat.testbed import _common, guest, modules, probe


# --------------------------------------------------------------------------
# helpers


def parse_newc(data: bytes) -> list:
    """An independent reader of newc cpio archives: [(name, mode, rdev, body)]."""
    out = []
    pos = 0
    while True:
        assert data[pos:pos + 6] == b"070701", "bad magic at %d" % pos
        fields = [int(data[pos + 6 + 8 * i: pos + 14 + 8 * i], 16) for i in range(13)]
        mode, filesize, rmaj, rmin, namesize = fields[1], fields[6], fields[9], fields[10], fields[11]
        name_start = pos + 110
        name = data[name_start: name_start + namesize - 1].decode()
        assert data[name_start + namesize - 1] == 0
        body_start = (name_start + namesize + 3) & ~3
        body = data[body_start: body_start + filesize]
        pos = (body_start + filesize + 3) & ~3
        if name == "TRAILER!!!":
            assert pos == len(data)
            return out
        out.append((name, mode, (rmaj, rmin), body))


def fake_elf(path, static: bool) -> None:
    """A minimal ELF64 header with one program header: PT_LOAD or PT_INTERP."""
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    hdr = ident + struct.pack("<HHIQQQIHHHHHH", 2, 62, 1, 0, 64, 0, 0, 64, 56, 1, 0, 0, 0)
    ph = struct.pack("<IIQQQQQQ", 1 if static else 3, 0, 0, 0, 0, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(hdr + ph)
    os.chmod(path, 0o755)


def make_exe(root, rel: str) -> None:
    path = os.path.join(str(root), rel.lstrip("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("#!/bin/sh\n")
    os.chmod(path, 0o755)


def make_file(root, rel: str, text: str = "") -> str:
    path = os.path.join(str(root), rel.lstrip("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


MODULES_DEP = """\
kernel/fs/overlayfs/overlay.ko:
kernel/fs/9p/9p.ko: kernel/net/9p/9pnet.ko kernel/fs/fscache/fscache.ko kernel/fs/netfs/netfs.ko
kernel/drivers/virtio/virtio_pci.ko: kernel/drivers/virtio/virtio_pci_legacy_dev.ko kernel/drivers/virtio/virtio_pci_modern_dev.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/net/9p/9pnet_virtio.ko: kernel/net/9p/9pnet.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/net/9p/9pnet.ko:
kernel/fs/fscache/fscache.ko: kernel/fs/netfs/netfs.ko
kernel/fs/netfs/netfs.ko:
kernel/drivers/virtio/virtio.ko:
kernel/drivers/virtio/virtio_ring.ko:
kernel/drivers/virtio/virtio_pci_legacy_dev.ko:
kernel/drivers/virtio/virtio_pci_modern_dev.ko:
kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko.xz: kernel/drivers/infiniband/core/ib_uverbs.ko
"""


def fake_moddir(root, version="6.1.0-99-amd64") -> str:
    moddir = os.path.join(str(root), "lib/modules", version)
    make_file(root, "/lib/modules/%s/modules.dep" % version, MODULES_DEP)
    for line in MODULES_DEP.splitlines():
        make_file(moddir, line.split(":")[0], "ELF")
    return moddir


# --------------------------------------------------------------------------
# the cpio writer


def test_cpio_writer_round_trip(tmp_path):
    w = testbed.CpioWriter()
    w.add_dir("bin")
    w.add_file("bin/busybox", b"\x7fELF" + bytes(range(256)) * 3, 0o755)
    w.add_symlink("bin/sh", "busybox")
    w.add_chardev("dev/console", 5, 1)
    w.add_file("init", b"#!/bin/sh\necho hi\n", 0o755)
    w.add_file("empty", b"")
    data = w.finish()
    assert len(data) % 4 == 0

    entries = parse_newc(data)
    names = [e[0] for e in entries]
    assert names == ["bin", "bin/busybox", "bin/sh", "dev/console", "init", "empty"]
    by = {e[0]: e for e in entries}
    assert stat.S_ISDIR(by["bin"][1])
    assert stat.S_ISREG(by["bin/busybox"][1]) and by["bin/busybox"][1] & 0o777 == 0o755
    assert by["bin/busybox"][3] == b"\x7fELF" + bytes(range(256)) * 3
    assert stat.S_ISLNK(by["bin/sh"][1]) and by["bin/sh"][3] == b"busybox"
    assert stat.S_ISCHR(by["dev/console"][1]) and by["dev/console"][2] == (5, 1)
    assert by["init"][3] == b"#!/bin/sh\necho hi\n"
    assert by["empty"][3] == b""

    cpio = shutil.which("cpio")
    if cpio:
        listing = subprocess.run([cpio, "-t", "--quiet"], input=data, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, check=True).stdout.decode().split()
        assert listing == names
        # extract the regular files and the symlink (devices need root)
        dest = tmp_path / "x"
        dest.mkdir()
        subprocess.run([cpio, "-idm", "--quiet", "--no-absolute-filenames", "bin", "bin/*", "init"],
                       input=data, cwd=dest, check=True)
        assert (dest / "init").read_bytes() == b"#!/bin/sh\necho hi\n"
        assert os.readlink(dest / "bin" / "sh") == "busybox"
        assert os.access(dest / "bin" / "busybox", os.X_OK)


def test_cpio_writer_to_file(tmp_path):
    path = tmp_path / "a.cpio"
    with open(path, "wb") as f:
        w = testbed.CpioWriter(f)
        w.add_file("x", b"abc")
        assert w.finish() == b""
    assert [e[0] for e in parse_newc(path.read_bytes())] == ["x"]
    with pytest.raises(ValueError):
        w.add_file("y", b"")


# --------------------------------------------------------------------------
# modules, kernels, status


def test_module_load_order_puts_dependencies_first(tmp_path):
    moddir = fake_moddir(tmp_path)
    order = [os.path.basename(p) for p in modules.load_order(moddir, modules.STAGE1_TARGETS)]
    assert sorted(order) == sorted(m + ".ko" for m in modules.STAGE1_FALLBACK)
    pos = {m: i for i, m in enumerate(order)}
    for before, after in [("virtio_ring.ko", "virtio.ko"), ("virtio.ko", "virtio_pci.ko"),
                          ("virtio_pci_legacy_dev.ko", "virtio_pci.ko"),
                          ("9pnet.ko", "9pnet_virtio.ko"), ("netfs.ko", "fscache.ko"),
                          ("fscache.ko", "9p.ko"), ("9pnet.ko", "9p.ko")]:
        assert pos[before] < pos[after], order


def test_module_load_order_skips_builtin_and_reports_missing(tmp_path):
    moddir = fake_moddir(tmp_path)
    make_file(moddir, "modules.builtin", "kernel/fs/overlayfs/overlay.ko\n")
    order = modules.load_order(moddir, modules.STAGE1_TARGETS)
    assert not any(p.endswith("overlay.ko") for p in order)
    with pytest.raises(LookupError, match="no_such"):
        modules.load_order(moddir, ["no_such"])


def test_compressed_module_is_found_and_decompressed(tmp_path):
    import lzma

    moddir = fake_moddir(tmp_path)
    assert modules.find_module(moddir, "rdma_rxe").endswith("rdma_rxe.ko.xz")
    path = tmp_path / "m.ko.xz"
    path.write_bytes(lzma.compress(b"\x7fELFmodule"))
    assert modules.read_module(str(path)) == b"\x7fELFmodule"


def test_elf_static_detection(tmp_path):
    fake_elf(tmp_path / "static", static=True)
    fake_elf(tmp_path / "dynamic", static=False)
    assert probe.elf_is_static(str(tmp_path / "static"))
    assert not probe.elf_is_static(str(tmp_path / "dynamic"))
    assert not probe.elf_is_static(str(tmp_path / "nonexistent"))


def test_status_of_empty_root_names_missing_packages(tmp_path):
    st = testbed.status(root=str(tmp_path))
    assert st["method"] is None
    assert not st["native"]["usable"]
    assert not st["qemu"]["usable"]
    for pkg in ("qemu-system-x86", "linux-image-amd64", "busybox-static", "rdma-core",
                "ibverbs-providers", "iproute2", "kmod"):
        assert pkg in st["missing_packages"], pkg
    report = testbed.format_status(st)
    assert "apt-get install" in report
    for pkg in st["missing_packages"]:
        assert pkg in report


def test_status_of_complete_fake_root(tmp_path):
    root = tmp_path
    fake_moddir(root)
    make_file(root, "/boot/vmlinuz-6.1.0-99-amd64", "kernel")
    make_file(root, "/boot/vmlinuz-5.0.0-1-amd64", "old kernel without modules")
    for exe in ("/usr/bin/qemu-system-x86_64", "/usr/sbin/ip", "/usr/bin/rdma", "/usr/sbin/modprobe",
                "/usr/bin/ibv_devinfo", "/usr/bin/rping", "/usr/bin/ib_send_lat"):
        make_exe(root, exe)
    os.makedirs(root / "usr/bin", exist_ok=True)
    fake_elf(root / "usr/bin/busybox", static=True)
    os.makedirs(root / "etc/rdma")
    make_file(root, "/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so")
    make_file(root, "/usr/lib/x86_64-linux-gnu/libibverbs.so.1")
    make_file(root, "/usr/lib/x86_64-linux-gnu/librdmacm.so.1")
    os.makedirs(root / "sys/module/kvm")  # a nested hypervisor's kvm only
    os.makedirs(root / "dev")
    (root / "dev/kvm").write_text("")

    st = testbed.status(root=str(root))
    assert st["missing_packages"] == [], st
    assert st["recommended_packages"] == []
    q = st["qemu"]
    assert q["usable"], testbed.format_status(st)
    assert q["kernel_version"] == "6.1.0-99-amd64"
    assert q["busybox"].endswith("/usr/bin/busybox")
    assert q["accel"] == "tcg"
    assert "nested" in q["accel_reason"]
    assert st["method"] == "qemu"

    # ordinary KVM is only trusted with kvm_intel/kvm_amd and /dev/kvm
    os.makedirs(root / "sys/module/kvm_intel")
    assert testbed.status(root=str(root))["qemu"]["accel"] == "kvm"
    (root / "dev/kvm").unlink()
    assert testbed.status(root=str(root))["qemu"]["accel"] == "tcg"

    # a dynamically linked busybox is not enough
    fake_elf(root / "usr/bin/busybox", static=False)
    st = testbed.status(root=str(root))
    assert "busybox-static" in st["missing_packages"]
    assert not st["qemu"]["usable"]


def test_gid_text():
    assert _common.gid_for("169.254.77.1") == "0000:0000:0000:0000:0000:ffff:a9fe:4d01"


# --------------------------------------------------------------------------
# the scripts handed to the guest


def _plan(tmp_path, cmd, env):
    kernel = modules.Kernel("6.1.0-99-amd64", "/boot/vmlinuz-6.1.0-99-amd64", "/lib/modules/6.1.0-99-amd64")
    return guest.GuestPlan(index=0, cmd=cmd, cwd=str(tmp_path), env=env, rw_paths=[str(tmp_path)],
                          kernel=kernel, busybox="/bin/busybox", qemu="qemu-system-x86_64",
                          memory="2G", cpus=2, accel="tcg")


def test_run_script_restores_environment_and_cwd(tmp_path):
    """run.sh is plain sh: run it on the host and check what the command sees."""
    weird = "a b'c\"d\n$HOME `x` \\ end"
    env = {"PATH": os.environ["PATH"], "AIODAT_WEIRD": weird, "EMPTY": ""}
    code = ("import os, sys, json; print(json.dumps([os.getcwd(), dict(os.environ), sys.argv[1:]]))")
    plan = _plan(tmp_path, [sys.executable, "-c", code, "arg 1", "$x"], env)
    script = tmp_path / "run.sh"
    script.write_text(guest.run_script(plan))
    res = subprocess.run(["sh", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cwd="/", env={"PATH": "/usr/bin:/bin", "LEAK": "1"})
    assert res.returncode == 0, res.stderr
    import json

    cwd, seen, args = json.loads(res.stdout)
    assert cwd == str(tmp_path)
    assert seen["AIODAT_WEIRD"] == weird
    assert seen["EMPTY"] == ""
    assert "LEAK" not in seen
    assert args == ["arg 1", "$x"]


def test_guest_scripts_and_qemu_argv(tmp_path):
    env = _common.caller_env({"HOME": "/root"}, str(tmp_path), "qemu", "rxe0")
    assert env["AIODAT_RXE_DEVICE"] == "rxe0"
    assert env["AIODAT_RXE_ADDR"] == "169.254.77.1"
    assert env["AIODAT_RXE_NETDEV"] == "aiodat0"
    assert env["AIODAT_TESTBED"] == "qemu"
    plan = _plan(tmp_path, ["true"], env)
    stage2 = guest.stage2_script(plan)
    assert "rdma link add rxe0 type rxe netdev aiodat0" in stage2
    assert "169.254.77.1/24" in stage2
    assert str(tmp_path) in stage2
    argv = guest.qemu_argv(plan, "/x/initrd", "/x/ctl", {"con": 10, "out": 11, "err": 12})
    joined = " ".join(argv)
    assert "-accel tcg,thread=multi -cpu max" in joined
    assert "-no-reboot" in argv and "-nic" in argv
    assert "path=/proc/self/fd/11" in joined
    assert "readonly=on" in joined
    assert "mount_tag=aiodatrw0" in joined


def test_cli_usage_errors(capsys):
    assert testbed.main(["run"]) == 2
    assert testbed.main(["run", "--bogus", "--", "true"]) == 2
    assert testbed.main(["frobnicate"]) == 2
    assert testbed.main(["--help"]) == 0
    assert "rxe run" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["--method", "foo"],
    ["--method", "native", "--hosts", "2"],
    ["--hosts", "2", "--method=native"],
    ["--timeout", "nan"],
    ["--timeout", "inf"],
    ["--timeout", "0"],
    ["--timeout", "-5"],
    ["--timeout", "soon"],
    ["--cpus", "0"],
    ["--cpus", "two"],
    ["--hosts", "3"],
    ["--hosts", "x"],
    ["--memory", "lots"],
    ["--memory", "0G"],
    ["--memory", "-5"],
    ["--share", "/nonexistent/aiodat-share"],
])
def test_run_option_errors_exit_2_before_anything_runs(argv, monkeypatch, capsys):
    from aiodat.testbed import command

    def must_not_run(*args, **kwargs):
        raise AssertionError("the test bed ran")

    monkeypatch.setattr(command, "run", must_not_run)
    assert testbed.main(["run", *argv, "--", "true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rxe run: ") and "usage: rxe" in err
    assert argv[0].partition("=")[0] in err.splitlines()[0]  # (the option named)


@pytest.mark.parametrize("argv, code", [
    (["--help"], 0),
    (["-h"], 0),
    (["--json", "--help"], 0),
    (["--bogus"], 2),
    (["extra"], 2),
    (["--json", "x"], 2),
])
def test_status_help_and_extra_arguments_do_not_probe(argv, code, monkeypatch, capsys):
    """``rxe status --help`` prints the usage and exits 0; any argument but --json is a usage error
    (exit 2); neither probes the machine."""
    from aiodat.testbed import command

    def must_not_probe(*args, **kwargs):
        raise AssertionError("rxe status probed")

    monkeypatch.setattr(command, "status", must_not_probe)
    assert testbed.main(["status", *argv]) == code
    out, err = capsys.readouterr()
    if code == 0:
        assert out.startswith("usage: rxe status") and not err
    else:
        assert err.startswith("rxe status: unexpected argument") and "usage: rxe" in err and not out


def test_run_refuses_a_non_finite_timeout():
    with pytest.raises(ValueError, match="finite"):
        testbed.run(["true"], timeout=float("nan"))


def _alive(pid: int) -> bool:
    try:
        with open("/proc/%d/stat" % pid) as f:
            state = f.read().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # (a zombie waits for init to reap it: it is gone)


def _wait_dead(pid: int, seconds: float = 5.0) -> bool:
    until = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > until:
            return False
        time.sleep(0.05)
    return True


def test_native_command_leaves_nothing_running_after_it_exits(tmp_path, capfd):
    """What the command left in the background is killed with its process group when it exits (rxe's
    device could not be deleted under it), and its output is not waited for."""
    from aiodat.testbed import native

    pidfile = tmp_path / "pid"
    t0 = time.monotonic()
    rc = native.run_command(["sh", "-c", "sleep 999 & echo $! > %s; echo out; exit 3" % pidfile],
                            time.monotonic() + 60, 60, dict(os.environ), str(tmp_path))
    assert rc == 3
    assert time.monotonic() - t0 < 4.0  # (the sleep held the output pipe: the pumps waited 5 s)
    assert _wait_dead(int(pidfile.read_text())), "the background sleep outlived the command"
    assert "out" in capfd.readouterr().out


def test_native_command_killed_at_the_deadline(tmp_path, capfd):
    from aiodat.testbed import native

    pidfile = tmp_path / "pid"
    t0 = time.monotonic()
    rc = native.run_command(["sh", "-c", "sleep 999 & echo $! > %s; wait" % pidfile],
                            time.monotonic() + 1, 1, dict(os.environ), str(tmp_path))
    assert rc == testbed.EXIT_TIMEOUT
    assert time.monotonic() - t0 < 5.0
    assert _wait_dead(int(pidfile.read_text()))
    assert "deadline of 1 s passed" in capfd.readouterr().err


def test_two_hosts_when_qemu_cannot_start(tmp_path, monkeypatch, capfd):
    """QEMU failing to start (OSError) is a test-bed failure, 125, not a RuntimeError from joining
    pumps never started."""
    from aiodat.testbed import qemu_pair

    monkeypatch.setenv("AIODAT_CACHE_DIR", str(tmp_path / "cache"))
    kernel = modules.Kernel("6.1.0-99-amd64", "/boot/vmlinuz-6.1.0-99-amd64", "/lib/modules/6.1.0-99-amd64")
    q = {"qemu": str(tmp_path / "no-such-qemu"), "busybox": "/bin/busybox", "accel": "tcg"}
    monkeypatch.setattr(qemu_pair, "prepare_guests",
                        lambda env, cwd, rw: (q, kernel, dict(os.environ), None, [str(tmp_path)], "/x/initrd"))
    rc = qemu_pair.run_qemu_hosts(["true"], time.monotonic() + 30, 30, "1G", 1, None, str(tmp_path), False, None)
    assert rc == testbed.EXIT_TESTBED_FAILED
    assert "cannot start QEMU" in capfd.readouterr().err


# --------------------------------------------------------------------------
# real runs (boot a guest, or use native rxe where the host kernel has it)


def _need_testbed():
    if testbed.status()["method"] is None:
        pytest.skip("the rxe test bed cannot run here: " + testbed.format_status())


@pytest.mark.testbed
def test_deadline_kills_a_guest_that_never_finishes(capfd):
    _need_testbed()
    t0 = time.monotonic()
    rc = testbed.run(["sleep", "1000"], timeout=20)
    elapsed = time.monotonic() - t0
    assert rc == testbed.EXIT_TIMEOUT == 124
    assert elapsed < 20 + 15
    assert "deadline of 20 s passed" in capfd.readouterr().err


@pytest.mark.testbed
def test_real_boot_has_an_active_rxe_device(tmp_path, capfd):
    _need_testbed()
    script = ("cat /sys/class/infiniband/*/ports/1/state; ibv_devinfo; "
              "echo \"$AIODAT_TESTBED $AIODAT_RXE_DEVICE $AIODAT_RXE_ADDR\"; "
              "echo to-stderr >&2; echo written-in-guest > marker.txt; exit 7")
    rc = testbed.run(["sh", "-c", script], timeout=300, cwd=str(tmp_path))
    out, err = capfd.readouterr()
    assert rc == 7, err
    assert "ACTIVE" in out
    assert "PORT_ACTIVE" in out  # ibv_devinfo's port state
    assert " 169.254.77.1" in out
    assert "to-stderr" in err
    assert (tmp_path / "marker.txt").read_text() == "written-in-guest\n"


@pytest.mark.testbed
def test_failed_rxe_setup_does_not_run_the_command(monkeypatch, capfd):
    _need_testbed()
    monkeypatch.setattr(modules, "GUEST_MODULES", modules.GUEST_MODULES + ("aiodat_no_such_module",))
    rc = testbed.run(["echo", "the-command-ran"], timeout=300)
    out, err = capfd.readouterr()
    assert rc == testbed.EXIT_TESTBED_FAILED == 125
    assert "the-command-ran" not in out
    assert "did not run" in err and "aiodat_no_such_module" in err
