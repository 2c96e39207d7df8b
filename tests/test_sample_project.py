"""docs/ci.md's recipe for another project's test suite, run on tests/sample_project.

The sample project (``rdma-echo``: its own pyproject.toml, package, conftest and event-loop
choices) is copied to a temporary directory, installed with aiodat's freshly built wheel into
a virtual env of its own (the one the recipe makes: nothing of aiodat's source tree is
visible), and its suite runs exactly as the recipe says: ``aiodat rxe run -- pytest`` in the
project's directory, with ``AIODAT_REQUIRE_DEVICE=1`` and a JUnit report.  The test then
reads the report: every test passed, none skipped, the device tests among them.  A second
run on the host with ``--aiodat-loop uvloop`` (no device: the device tests skip) shows the
project's own loop choices untouched while aiodat's test follows the option.

Host-side and marked ``testbed``: it boots its own guest (boot plus one run of the suite
under TCG), so it runs in CI's host stage like tests/test_testbed.py's boots.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List

import pytest

from aiodat import testbed

pytestmark = pytest.mark.testbed

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = Path(__file__).resolve().parent / "sample_project"

#: the sample suite's tests, and which of them need the device
EXPECTED = {
    "tests.test_echo::test_echo[tcp]": False,
    "tests.test_echo::test_echo[rdma]": True,
    "tests.test_echo::test_ep_pair_message": True,
    "tests.test_loops::test_plain_test_runs_on_the_projects_loop": False,
    "tests.test_loops::test_plain_tests_share_the_module_loop": False,
    "tests.test_loops::test_aiodat_tests_follow_the_aiodat_loop": False,
}


def _run(argv: List[str], cwd: Path, env: Dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=str(cwd), env=env, timeout=timeout, capture_output=True, text=True)
    assert proc.returncode == 0, f"{argv} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def _results(report: Path) -> Dict[str, str]:
    """{classname::name: outcome} from a JUnit XML report (outcome: passed, skipped, failure, error)."""
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        children = [child.tag for child in case if child.tag in ("skipped", "failure", "error")]
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = children[0] if children else "passed"
    return outcomes


def test_sample_project_suite_runs_on_rxe_with_the_documented_recipe(tmp_path: Path) -> None:
    if testbed.status()["method"] is None:
        pytest.skip("the rxe test bed cannot run here: " + testbed.format_status())
    # aiodat as the project's CI gets it (an index there; a wheel built from this tree here)
    _run([sys.executable, "-m", "build", "--outdir", str(tmp_path / "dist"), str(ROOT)],
         tmp_path, dict(os.environ), 300)
    (wheel,) = (tmp_path / "dist").glob("aiodat-*.whl")
    project = tmp_path / "rdma-echo"
    shutil.copytree(SAMPLE, project, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build", ".venv"))

    # the recipe: a venv of the project's, pip install the project (with its test extra) and aiodat
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "AIODAT_LOOP")}
    _run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", ".venv"], project, env, 120)
    venv_bin = project / ".venv" / "bin"
    env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(project / ".venv")
    _run([str(venv_bin / "pip"), "install", "-q", str(wheel), ".[test]"], project, env, 600)
    where = _run([str(venv_bin / "python"), "-c", "import aiodat; print(aiodat.__file__)"], project, env, 60)
    assert where.stdout.startswith(str(project / ".venv")), where.stdout  # not this source tree

    # ... then, in the project's directory, its whole suite on rxe
    env["AIODAT_REQUIRE_DEVICE"] = "1"
    started = time.monotonic()
    guest = _run(["aiodat", "rxe", "run", "--timeout", "300", "--", "pytest", "--junitxml=results.xml"],
                 project, env, 400)
    took = time.monotonic() - started
    assert _results(project / "results.xml") == {name: "passed" for name in EXPECTED}, guest.stdout
    assert "aiodat: loop=asyncio device=rxe0 testbed=" in guest.stdout, guest.stdout  # the plugin's header
    assert "6 passed" in guest.stdout and "skipped" not in guest.stdout, guest.stdout
    print(f"sample project on rxe: guest run {took:.0f} s")

    # on the host (no device) with aiodat's tests on uvloop: the device tests skip, the project's
    # plain tests still get its own loop class and module loop, aiodat's test gets uvloop
    del env["AIODAT_REQUIRE_DEVICE"]
    _run(["pytest", "--aiodat-loop", "uvloop", "--junitxml=results-host.xml"], project, env, 120)
    host = _results(project / "results-host.xml")
    assert host.keys() == EXPECTED.keys(), host
    for name, device in EXPECTED.items():  # a host with native rxe runs the device tests too
        assert host[name] in (("skipped", "passed") if device else ("passed",)), (name, host)
