#!/usr/bin/env bash
# Packaging check (issue 16): build the sdist and the wheel (the wheel is built from the sdist,
# so the sdist is complete), check what the wheel holds and what its extension needs at run
# time (its own ELF dynamic section: only libibverbs.so.1, librdmacm.so.1 and libc, no rpath,
# no symbol version newer than Debian bookworm's rdma-core 44 and glibc 2.36), then install
# the wheel into a fresh venv where no C compiler and no -dev headers exist, import it from
# elsewhere and run `aiodat devices`: on the host (no device: a clean message, exit 1) and in
# an rxe guest (it must list the device).  About 30 s on the host plus one guest (~30 s, TCG).
#   AIODAT_WHEEL_GUEST=0   skip the guest run
#   AIODAT_WHEEL_KEEP=DIR  keep the built sdist and wheel in DIR
set -euo pipefail
cd "$(dirname "$0")/.."
PY="$PWD/.venv/bin/python"
work=$(mktemp -d "${TMPDIR:-/tmp}/aiodat-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT

echo "== check_wheel: python -m build (sdist, then the wheel from it)"
if ! "$PY" -m build --outdir "$work/dist" . >"$work/build.log" 2>&1; then
  cat "$work/build.log" >&2; echo "check_wheel: python -m build failed" >&2; exit 1
fi
wheel=$(echo "$work"/dist/aiodat-*.whl)
sdist=$(echo "$work"/dist/aiodat-*.tar.gz)
[ -f "$wheel" ] && [ -f "$sdist" ] || { echo "check_wheel: no wheel or sdist in $work/dist" >&2; exit 1; }
if [ -n "${AIODAT_WHEEL_KEEP:-}" ]; then mkdir -p "$AIODAT_WHEEL_KEEP" && cp "$wheel" "$sdist" "$AIODAT_WHEEL_KEEP"/; fi

echo "== check_wheel: contents, entry points and the extension's dynamic section ($(basename "$wheel"))"
git ls-files -- 'aiodat/*.py' >"$work/sources.txt" 2>/dev/null || find aiodat -name '*.py' -not -path '*/build/*' >"$work/sources.txt"
"$PY" - "$wheel" "$sdist" "$work/sources.txt" <<'EOF'
"""Check the wheel (and the sdist) as an installer would see them; exit 1 naming every problem."""
import configparser, re, struct, sys, tarfile, zipfile

wheel, sdist, sources = sys.argv[1:4]
problems = []
names = set(zipfile.ZipFile(wheel).namelist())

# every module of the source tree, every aiodat package by name, py.typed and the shim sources
packages = ["aiodat", "aiodat._shim", "aiodat.streams", "aiodat.integrations", "aiodat.bench",
            "aiodat.testbed", "aiodat.testing"]
wanted = {p.replace(".", "/") + "/__init__.py" for p in packages}
wanted |= set(open(sources).read().split())
wanted |= {"aiodat/py.typed", "aiodat/_shim/shim.c", "aiodat/_shim/shim.h", "aiodat/_shim/build_shim.py",
           "aiodat/_shim/completions.c", "aiodat/_shim/posts.c", "aiodat/_shim/streamcore.c",
           "aiodat/_shim/pyattrs.h", "aiodat/_shim/postcommon.h"}
problems += [f"wheel lacks {name}" for name in sorted(wanted - names)]
extensions = sorted(n for n in names if n.endswith(".so"))
HOT_PATHS = ["aiodat/_shim/_completions.abi3.so", "aiodat/_shim/_posts.abi3.so", "aiodat/_shim/_streamcore.abi3.so"]
EXPECTED = sorted(HOT_PATHS + ["aiodat/_shim/_core.abi3.so"])
if extensions != EXPECTED:
    problems.append(f"wheel's extensions are {extensions}, expected {EXPECTED}")

# entry points, and the module each one names must be in the wheel
info = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
eps = configparser.ConfigParser(delimiters=("=",))
eps.optionxform = str
eps.read_string(zipfile.ZipFile(wheel).read(info[0]).decode() if info else "")
for group, name, target in (("console_scripts", "aiodat", "aiodat.cli:main"),
                            ("pytest11", "aiodat", "aiodat.testing.plugin"),
                            ("distributed.comm.backends", "rdma", "aiodat.integrations.dask:RDMABackend")):
    got = eps.get(group, name, fallback=None)
    if got is None or got.strip() != target:
        problems.append(f"entry point [{group}] {name} is {got!r}, expected {target!r}")
    module = target.split(":")[0].replace(".", "/")
    if not {module + ".py", module + "/__init__.py"} & names:
        problems.append(f"entry point [{group}] {name} names {target}, whose module is not in the wheel")

# the sdist must carry what building needs
sdist_names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
problems += [f"sdist lacks {n}" for n in ("pyproject.toml", "setup.py", "README.md", "aiodat/_shim/shim.c",
                                          "aiodat/_shim/shim.h", "aiodat/_shim/build_shim.py",
                                          "aiodat/_shim/completions.c", "aiodat/_shim/posts.c", "aiodat/_shim/streamcore.c",
                                          "aiodat/_shim/pyattrs.h", "aiodat/_shim/postcommon.h") if n not in sdist_names]


def elf_needs(data):
    """(DT_NEEDED list, DT_RPATH/DT_RUNPATH list, {file: [version names]}) of an ELF64 little-endian object."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not an ELF64 little-endian object")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]

    def string(strtab, offset):
        start = sections[strtab][4] + offset
        return data[start:data.index(b"\0", start)].decode()

    needed, paths, versions = [], [], {}
    for _name, kind, _flags, _addr, offset, size, link, info, _align, _entsize in sections:
        if kind == 6:  # SHT_DYNAMIC
            for pos in range(offset, offset + size, 16):
                tag, value = struct.unpack_from("<qQ", data, pos)
                if tag == 1:  # DT_NEEDED
                    needed.append(string(link, value))
                elif tag in (15, 29):  # DT_RPATH, DT_RUNPATH
                    paths.append(string(link, value))
        elif kind == 0x6FFFFFFE:  # SHT_GNU_verneed: which versions of which library
            pos = offset
            for _ in range(info):
                _ver, count, file_, aux, next_ = struct.unpack_from("<HHIII", data, pos)
                names_, apos = versions.setdefault(string(link, file_), []), pos + aux
                for _ in range(count):
                    _hash, _flags, _other, name, anext = struct.unpack_from("<IHHII", data, apos)
                    names_.append(string(link, name))
                    apos += anext
                pos += next_
    return needed, paths, versions


# what Debian bookworm provides: glibc 2.36, rdma-core 44 (IBVERBS_1.0..1.14, RDMACM_1.0..1.3)
NEWEST = {"libc.so.6": ("GLIBC_2.", (36,)), "libibverbs.so.1": ("IBVERBS_1.", (14,)),
          "librdmacm.so.1": ("RDMACM_1.", (3,))}
if "aiodat/_shim/_core.abi3.so" in names:
    needed, paths, versions = elf_needs(zipfile.ZipFile(wheel).read("aiodat/_shim/_core.abi3.so"))
    print(f"  _core.abi3.so: NEEDED {needed}; versions {versions}", flush=True)
    if sorted(needed) != sorted(NEWEST):
        problems.append(f"the extension needs {needed}; only {sorted(NEWEST)} are allowed")
    if paths:
        problems.append(f"the extension carries an rpath/runpath {paths} (a build machine's path)")
    for file_, names_ in versions.items():
        prefix, newest = NEWEST.get(file_, ("?", ()))
        for version in names_:
            match = re.fullmatch(re.escape(prefix) + r"(\d+(?:\.\d+)*)", version)
            if not match or tuple(map(int, match.group(1).split("."))) > newest:
                problems.append(f"the extension needs {version} of {file_}: newer than Debian bookworm's, "
                                f"or private (allowed: {prefix}<= {'.'.join(map(str, newest))})")

# the hot-path modules (plain C on the limited API) need nothing beyond libc and the interpreter
for hot in HOT_PATHS:
    if hot in names:
        needed, paths, versions = elf_needs(zipfile.ZipFile(wheel).read(hot))
        print(f"  {hot.rsplit('/', 1)[1]}: NEEDED {needed}; versions {versions}", flush=True)
        if not set(needed) <= {"libc.so.6"} or paths:
            problems.append(f"{hot} needs {needed} (rpath {paths}); only libc.so.6 is allowed")

for problem in problems:
    print("check_wheel: " + problem, file=sys.stderr)
sys.exit(1 if problems else 0)
EOF

echo "== check_wheel: install the wheel where no compiler and no -dev headers exist"
# the wheel's own dependencies, binary only (so nothing can be compiled even if a compiler were there)
# (this one goes through the machine's pip configuration: an index, a mirror or a local cache)
"$PY" -m pip download -q --only-binary :all: --dest "$work/deps" "$wheel"
base_python=$("$PY" -c 'import sys; print(sys._base_executable)')
mkdir -p "$work/elsewhere"
cat >"$work/import_check.py" <<'EOF'
"""Run by the fresh venv's python -I: aiodat and its extension come from the venv, entry points registered."""
import importlib.metadata as md
import sys

import aiodat
import aiodat._shim._core as core

venv = sys.argv[1] + "/venv/"
assert aiodat.__file__.startswith(venv) and core.__file__.startswith(venv), (aiodat.__file__, core.__file__)
groups = {g: {e.name for e in md.entry_points(group=g)}
          for g in ("console_scripts", "pytest11", "distributed.comm.backends")}
assert "aiodat" in groups["console_scripts"] and "aiodat" in groups["pytest11"], groups
assert "rdma" in groups["distributed.comm.backends"], groups
print("  imported aiodat", aiodat.__version__, "from", aiodat.__file__, "with", core.__file__.rsplit("/", 1)[1])
EOF
cat >"$work/install.sh" <<'EOF'
set -eu
work=$1 base_python=$2 isolated=$3
if [ "$isolated" = 1 ]; then
  # inside a private mount namespace: no headers at all, and gcc has no cc1 to run
  mount -t tmpfs none /usr/include
  mount -t tmpfs none /usr/lib/gcc
  if printf 'int main(void){return 0;}\n' | gcc -x c -o /dev/null - 2>/dev/null; then
    echo "check_wheel: a C compiler still works in the isolated namespace" >&2; exit 1
  fi
  [ ! -e /usr/include/infiniband/verbs.h ] || { echo "check_wheel: libibverbs-dev headers still visible" >&2; exit 1; }
fi
cd "$work/elsewhere"
# only the venv on PATH, no compiler variable that could work, no pip configuration, no source tree
exec env -i HOME="$work" PATH="$work/venv/bin" CC=/bin/false CXX=/bin/false LDSHARED=/bin/false \
  PIP_CONFIG_FILE=/dev/null PIP_NO_CACHE_DIR=1 /bin/sh -euc '
  "$0" -m venv "$1/venv"
  python -m pip install -q --no-index --only-binary :all: --find-links "$1/deps" aiodat
  python -I "$1/import_check.py" "$1"
  set +e
  aiodat devices >"$1/devices.out" 2>&1
  echo $? >"$1/devices.rc"
' "$base_python" "$work"
EOF
isolated=0
if [ "$(id -u)" = 0 ] && unshare -m true 2>/dev/null; then isolated=1; fi
if [ "$isolated" = 1 ]; then
  echo "  (in a mount namespace with /usr/include and /usr/lib/gcc hidden: no headers, no working compiler)"
  unshare -m sh "$work/install.sh" "$work" "$base_python" 1
else
  echo "  (not root or no mount namespaces: CC=/bin/false and PATH=venv only, the compiler stays installed)"
  sh "$work/install.sh" "$work" "$base_python" 0
fi
sed 's/^/  aiodat devices: /' "$work/devices.out"
if [ "$(cat "$work/devices.rc")" != 1 ] || ! grep -q "no RDMA device on this machine" "$work/devices.out" \
   || grep -q Traceback "$work/devices.out"; then
  # a host that has an RDMA device (native rxe, real hardware) lists it instead
  if [ "$(cat "$work/devices.rc")" != 0 ] || grep -q Traceback "$work/devices.out"; then
    echo "check_wheel: 'aiodat devices' from the wheel failed on the host" >&2; exit 1
  fi
fi

if [ "${AIODAT_WHEEL_GUEST:-1}" != 0 ]; then
  echo "== check_wheel: the installed wheel in an rxe guest: aiodat devices (host part took ${SECONDS} s)"
  guest_start=$SECONDS
  out=$(.venv/bin/aiodat rxe run --share "$work" --timeout "${AIODAT_WHEEL_TIMEOUT:-300}" -- \
    sh -c 'cd "$1/elsewhere" && exec env -i HOME="$1" PATH="$1/venv/bin" aiodat devices' sh "$work")
  echo "$out" | sed 's/^/  guest: /'
  echo "$out" | grep -q "rxe0" || { echo "check_wheel: the guest's 'aiodat devices' did not list rxe0" >&2; exit 1; }
  echo "  (guest run took $((SECONDS - guest_start)) s)"
fi
echo "== check_wheel: passed in ${SECONDS} s"
