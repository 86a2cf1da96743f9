"""A draft process with planted faults (tests/_two_process_faults.py), armed through the file named
by SSD_JAX_TEST_FAULT_FILE (and slow compiles under SSD_JAX_TEST_SLOW_COMPILE); otherwise `python -m ssd_jax.runtime.draft_process`."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _two_process_faults as faults  # noqa: E402
from ssd_jax.runtime import draft_process  # noqa: E402

if __name__ == "__main__":
    path = os.environ["SSD_JAX_TEST_FAULT_FILE"]
    faults.install_tree_fault(path)
    faults.install_malformed_reply(path)
    faults.install_slow_compile()
    draft_process.run()
