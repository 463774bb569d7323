"""How the torchrun workers of the tests end: their results saved and the process group destroyed, they
skip the interpreter's teardown, as ``functrain.cli.run`` does for a torchrun rank.

About 1 gloo run in 100 aborted in C++ teardown after finishing ("terminate called without an active
exception", no Python frame left; 3 of 287 runs of distributed_worker's train mode here, once in each of two
CI runs): torchrun's failed status then failed every test reading that run's results, which were complete.
The cause, found since: a gloo worker thread releasing a finished collective's tensors after the
interpreter began finalizing (functrain/distributed/teardown.py); ``distributed.initialize()`` now waits
for those threads at exit, and test_distributed_torchrun.py's late-worker test covers it. Skipping the
teardown stays: the workers' results are saved, and nothing after that is what these tests check.
"""

from __future__ import annotations

import os
import sys


def exit_skipping_teardown() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
