"""What one QEMU guest is given: its plan, the second-stage script that brings rxe up, the script that
runs the caller's command, and QEMU's command line.  Pure functions of the plan (no processes)."""
from __future__ import annotations

import dataclasses
import shlex
from typing import Dict, List, Optional, Tuple

from . import modules
from ._common import ADDR, GUEST_DEVICE, GUEST_HOSTS_DIR, NETDEV, PEER_WAIT_S, PREFIXLEN, gid_for
from .modules import NIC_MODULES, Kernel


@dataclasses.dataclass
class GuestPlan:
    """Everything one guest needs.  The two guests of ``--hosts 2`` are two
    plans differing in ``index``, ``addr`` and the network setup."""

    index: int
    cmd: List[str]
    cwd: str
    env: Dict[str, str]
    rw_paths: List[str]
    kernel: Kernel
    busybox: str
    qemu: str
    memory: str
    cpus: int
    accel: str
    addr: str = ADDR
    netdev: str = NETDEV
    device: str = GUEST_DEVICE
    verbose: bool = False
    tty_size: Optional[Tuple[int, int]] = None   # (columns, rows) for the guest's ttyS1/2
    #: Two-host runs: the QEMU ``-netdev`` spec (id ``aiodatnet``) and the MAC
    #: of the guest's virtio NIC, which stage2 renames to ``netdev``.  None:
    #: a dummy netdev and no NIC at all.
    nic: Optional[Tuple[str, str]] = None
    #: Two-host runs: the host directory both guests share (mailboxes,
    #: ready files), mounted at :data:`GUEST_HOSTS_DIR`.
    hosts_dir: Optional[str] = None
    #: Two-host runs: a file in the hosts directory to wait for before the
    #: command runs (the peer's agent is up).
    wait_for: Optional[str] = None


def stage2_script(plan: GuestPlan) -> str:
    """The guest's second stage (on the host's own tools): mounts, rxe up, wait for the peer, run the command, power off."""
    q = shlex.quote
    mounts = []
    for i, p in enumerate(plan.rw_paths):
        mounts.append(
            "mkdir -p %s && mount -t 9p -o $OPTS,cache=mmap aiodatrw%d %s "
            "|| fail 'cannot mount the shared directory %s'" % (q(p), i, q(p), p.replace("'", "")))
    gid = gid_for(plan.addr)
    return """#!/bin/sh
# aiodat rxe test bed, second stage (in the guest, on the host's own tools).
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
CTL=/run/aiodat
OPTS=trans=virtio,version=9p2000.L,msize=262144
say() {{ echo "aiodat-stage2: $*"; }}
off() {{
    sync
    {busybox} poweroff -f
    echo o > /proc/sysrq-trigger
    sleep 60
}}
fail() {{
    say "FAILED: $*"
    echo "$*" > $CTL/setup-error
    off
}}
up() {{ cat /proc/uptime | cut -d' ' -f1; }}
say "up at $(up) s"
mkdir -p /dev/pts /dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=1777 tmpfs /tmp
hostname aiodat-rxe{index}
{mounts}
modprobe -a {modules} || fail "modprobe {modules} failed"
ip link set lo up || fail "ip link set lo up"
{netsetup}
ip addr add {addr}/{prefix} dev {netdev} || fail "ip addr add {addr}/{prefix} dev {netdev}"
ip link set {netdev} up || fail "ip link set {netdev} up"
rdma link add {device} type rxe netdev {netdev} || fail "rdma link add {device} type rxe netdev {netdev}"
P=/sys/class/infiniband/{device}/ports/1
i=0
while :; do
    if grep -qs ACTIVE $P/state && grep -qsx '{gid}' $P/gids/*; then break; fi
    i=$((i+1))
    [ $i -gt 600 ] && fail "{device} did not become ACTIVE with GID {gid} in 60 s: state $(cat $P/state 2>/dev/null)"
    sleep 0.1
done
say "{device} ACTIVE on {netdev} {addr} at $(up) s"
{waitpeer}
up > $CTL/ready
{{
    stty raw -echo {size} <&1
    stty raw -echo {size} <&2
    /bin/sh $CTL/run.sh </dev/null
    echo $? > $CTL/exitstatus.tmp
    stty raw -echo <&1
    stty raw -echo <&2
}} >/dev/ttyS1 2>/dev/ttyS2
mv $CTL/exitstatus.tmp $CTL/exitstatus
say "command finished (status $(cat $CTL/exitstatus)) at $(up) s"
off
""".format(
        busybox=q(plan.busybox), index=plan.index, mounts="\n".join(mounts),
        modules=" ".join(modules.GUEST_MODULES), netdev=plan.netdev, addr=plan.addr,
        prefix=PREFIXLEN, device=plan.device, gid=gid,
        size="cols %d rows %d" % plan.tty_size if plan.tty_size else "",
        netsetup=netsetup(plan), waitpeer=waitpeer(plan),
    )


def netsetup(plan: GuestPlan) -> str:
    """Stage2 lines that create ``plan.netdev`` (a dummy, or the renamed virtio NIC)."""
    if plan.nic is None:
        return 'ip link add {0} type dummy || fail "ip link add {0} type dummy"'.format(plan.netdev)
    mac = plan.nic[1]
    hosts = ""
    if plan.hosts_dir is not None:
        hosts = ("mkdir -p {d} && mount -t 9p -o $OPTS,cache=none aiodathosts {d} "
                 "|| fail 'cannot mount the hosts directory'\n").format(d=GUEST_HOSTS_DIR)
    return hosts + """modprobe -a {mods} || fail "modprobe {mods} failed"
NIC=
i=0
while [ -z "$NIC" ]; do
    for n in /sys/class/net/*; do
        [ "$(cat $n/address 2>/dev/null)" = "{mac}" ] && NIC=${{n##*/}}
    done
    i=$((i+1))
    [ -z "$NIC" ] && [ $i -gt 100 ] && fail "no network interface with MAC {mac}"
    [ -z "$NIC" ] && sleep 0.1
done
ip link set dev "$NIC" name {netdev} || fail "ip link set dev $NIC name {netdev}"
ip link set dev {netdev} mtu 1500""".format(mods=" ".join(NIC_MODULES), mac=mac, netdev=plan.netdev)


def waitpeer(plan: GuestPlan) -> str:
    """Stage2 lines that wait for the peer host (two-host runs) before the command runs."""
    if not plan.wait_for:
        return ""
    return """i=0
while [ ! -e {d}/{f} ]; do
    i=$((i+1))
    [ $i -gt {n} ] && fail "the peer host did not come up in {s} s (no {f} in the hosts directory)"
    sleep 0.1
done
say "peer host up at $(up) s"
""".format(d=GUEST_HOSTS_DIR, f=plan.wait_for, n=PEER_WAIT_S * 10, s=PEER_WAIT_S)


def run_script(plan: GuestPlan) -> str:
    """The shell script that runs the caller's command with its environment and working directory."""
    q = shlex.quote
    assigns = " ".join(q("%s=%s" % (k, v)) for k, v in sorted(plan.env.items()) if "=" not in k and k)
    return """# the caller's command, its environment and working directory
ulimit -l unlimited 2>/dev/null || echo "aiodat rxe: warning: could not raise the memlock limit" >&2
cd {cwd} || exit 125
exec env -i -- {assigns} {cmd}
""".format(cwd=q(plan.cwd), assigns=assigns, cmd=" ".join(q(c) for c in plan.cmd))


def qemu_argv(plan: GuestPlan, initrd: str, ctl: str,
               fds: Dict[str, int]) -> List[str]:
    """QEMU's command line for ``plan``: kernel and initramfs, serial ports to the ``fds`` pipes, 9p shares, NIC."""
    append = "console=ttyS0 quiet loglevel=%d panic=-1 rdinit=/init" % (7 if plan.verbose else 4)
    argv = [
        plan.qemu, "-nodefaults", "-no-user-config",
        "-display", "none", "-monitor", "none", "-no-reboot",
        "-m", plan.memory, "-smp", str(plan.cpus),
        "-kernel", plan.kernel.image, "-initrd", initrd, "-append", append,
    ]
    if plan.accel == "kvm":
        argv += ["-accel", "kvm", "-cpu", "host"]
    else:
        argv += ["-accel", "tcg,thread=multi", "-cpu", "max"]
    for name in ("con", "out", "err"):
        argv += ["-chardev", "file,id=%s,path=/proc/self/fd/%d,append=on" % (name, fds[name]),
                 "-serial", "chardev:" + name]
    if plan.nic is None:
        argv += ["-nic", "none"]
    else:
        argv += ["-netdev", plan.nic[0],
                 "-device", "virtio-net-pci,netdev=aiodatnet,mac=%s" % plan.nic[1]]
    shares = [("aiodatroot", "/", True), ("aiodatctl", ctl, False)]
    shares += [("aiodatrw%d" % i, p, False) for i, p in enumerate(plan.rw_paths)]
    if plan.hosts_dir is not None:
        shares.append(("aiodathosts", plan.hosts_dir, False))
    for i, (tag, path, ro) in enumerate(shares):
        fs = "local,id=fs%d,path=%s,security_model=none,multidevs=remap" % (i, path.replace(",", ",,"))
        if ro:
            fs += ",readonly=on"
        argv += ["-fsdev", fs, "-device", "virtio-9p-pci,fsdev=fs%d,mount_tag=%s" % (i, tag)]
    return argv
