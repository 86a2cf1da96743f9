"""A test whose xdist worker dies of a signal runs once more, on the worker that replaces it.

Full runs here lost one to three workers each to aborts and segfaults inside XLA:CPU's compiler
(`backend_compile_and_load`), in tests that passed alone and on rerun. The cause, found on
2026-12-05 from a crashed worker's core: the process had run out of memory mappings (the kernel's
`vm.max_map_count`, 65,530), which XLA:CPU's JIT uses three of per compiled kernel while JAX's
caches keep every program, and LLVM's JIT linker aborted mapping a new section. Since then
`tests/conftest.py` drops JAX's caches before a worker gets near the limit
(`_compile_level.release_executables_near_the_map_limit`). This hook stays as the net for any other
crash: a crash is not a failure of the test's assertions, and one lost worker should not make the
whole suite red; but a crash that comes back is a real one. So, on the xdist controller:

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
