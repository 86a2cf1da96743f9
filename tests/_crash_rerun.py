"""A test whose xdist worker dies of a signal runs once more, on the worker that replaces it.

Full runs here have lost a worker to a segfault inside XLA:CPU about once in three: in its compiler
(`backend_compile_and_load`), in reading a cached executable back, and (CI, 2026-12-03) while
`test_study_scripts` compiled the tiny pair's steps, each time in a test that passes alone and on
rerun; on 2026-12-04 one full run lost two (benchmarks/README.md, "The CI order again"), and
the next two full runs two each (abort and segfault, both in `backend_compile_and_load`, in
different tests each time): about two a run, so three allowed left a run red about one time in
seven (Poisson), and a session now allows five (about one in sixty). Three full runs in a row
(2026-12-04/05) lost theirs in the same two tests, both compiling the device loop's `resolve`,
which pass alone and under glibc's heap checker; the next lost one compiling the draft's
`propose` in another test (benchmarks/README.md, "A one-layer draft for the statistical pair"). A
crash is not a failure of the test's assertions, and one lost worker should not make the whole
suite red; but a crash that comes back is a real one. So, on the xdist controller:

- a crashed test is put back in the queue once; its second crash, or any crash after
  `MAX_CRASH_RERUNS` in one session, fails as xdist reports it;
- the crash report's outcome is "rerun" (an `R`, and "N rerun" in the summary line), and the
  summary lists every test that was run again with the worker that died. The dead worker's
  traceback is in the log above, where xdist prints it.

`tests/conftest.py` imports the hooks; `test_crash_rerun.py` runs them on a real crash.
"""
from __future__ import annotations

import pytest

MAX_CRASH_RERUNS = 5
_rerun: dict[str, str] = {}  # test id -> its crash message, for the tests put back (controller)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent under -p no:xdist
def pytest_handlecrashitem(crashitem, report, sched):
    if crashitem in _rerun or len(_rerun) >= MAX_CRASH_RERUNS:
        return None  # failed, as xdist reports it
    try:
        sched.mark_test_pending(crashitem)
    except NotImplementedError:  # a scheduler that cannot queue a test again (loadscope)
        return None
    _rerun[crashitem] = str(report.longrepr)
    report.outcome = "rerun"
    return True


def pytest_report_teststatus(report, config):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None


def pytest_terminal_summary(terminalreporter):
    if _rerun:
        tr = terminalreporter
        tr.write_sep("=", "crashed workers: these tests ran again on a fresh worker", yellow=True)
        for line in _rerun.values():
            tr.write_line(line)
