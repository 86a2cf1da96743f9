"""tests/_crash_rerun.py on real crashes: pytest-xdist workers that abort mid-test."""
import os
import sys

pytest_plugins = ["pytester"]

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# `once` aborts its worker the first time only (a file remembers); `always` aborts every time
CASES = """
import os, pathlib

def test_once(tmp_path_factory):
    mark = pathlib.Path(os.environ["CRASH_MARK"])
    if not mark.exists():
        mark.write_text("crashed")
        os.abort()

def test_always():
    os.abort()

def test_fine():
    pass
"""


def _run(pytester, *args):
    pytester.makeconftest(f"import sys\nsys.path.insert(0, {TESTS!r})\n"
                          "from _crash_rerun import (pytest_handlecrashitem, "
                          "pytest_report_teststatus, pytest_terminal_summary)\n")
    pytester.makepyfile(test_cases=CASES)
    os.environ["CRASH_MARK"] = str(pytester.path / "crash_mark")
    try:
        return pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider",
                                             *args)
    finally:
        del os.environ["CRASH_MARK"]


def test_a_crash_runs_once_more_and_a_second_crash_fails(pytester):
    res = _run(pytester)
    out = res.stdout.str()
    # test_once crashed, ran again and passed; test_always crashed twice: once put back, then failed
    assert res.parseoutcomes() == dict(passed=2, failed=1, rerun=2), res.stdout.str()
    assert res.ret == 1
    assert "FAILED test_cases.py::test_always" in out and "test_once" not in out.split(
        "short test summary info")[1], out
    summary = out.split("crashed workers: these tests ran again on a fresh worker")[1]
    assert "test_cases.py::test_once" in summary and "test_cases.py::test_always" in summary, out
    assert "test_fine" not in summary, out


def test_the_reruns_a_session_allows_are_capped(pytester):
    import _crash_rerun
    cap = _crash_rerun.MAX_CRASH_RERUNS
    assert cap == 5 and sys.modules["_crash_rerun"] is _crash_rerun
    pytester.makepyfile(test_more="import os\n" + "".join(
        f"def test_{i}():\n    os.abort()\n" for i in range(cap + 1)))
    # 2 cap + 1 workers die here: more than xdist's default of 4 restarts per worker allows
    res = _run(pytester, "test_more.py", "--max-worker-restart", str(2 * cap + 2))
    # cap + 1 tests crash: cap are put back, each crashes again and fails; the last fails at once
    assert res.parseoutcomes() == dict(failed=cap + 1, rerun=cap), res.stdout.str()
