"""The hold of ea_elastic.py and hvd_elastic.py (``--hold-file``, ``--hold-at``), written once.

Framework-free: each script passes its own allreduce and ring size, so hvd_elastic.py stays a
plain Horovod script.
"""

import os
import time


def hold(state, hold_file, *, agree, size, report, check=True):
    """Wait at a commit while any rank sees ``hold_file``: ``agree(x)`` is the ranks' allreduce
    of ``x`` (all ranks get the same answer). A membership change interrupts the wait through
    ``state.check_host_updates()`` (``check=False``: only through a failed ``agree``, as for a
    script that never commits); ``report("held", state)`` is printed once per ring size."""
    shown = None
    while agree(1.0 if os.path.exists(hold_file) else 0.0) > 0:
        if shown != size():
            shown = size()
            report("held", state)
        time.sleep(0.05)
        if check:
            state.check_host_updates()
