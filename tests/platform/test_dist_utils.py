"""workbench.platform.dist_utils: the stop request (SIGTERM/SIGINT once = finish the step and save; a second one =
at once), in a child process that receives real signals."""

from __future__ import annotations

import signal
import time

from tests.run_helpers import python_child

STOPPER = """
import sys, time
from workbench.platform.dist_utils import StopRequest
stop = StopRequest(same_within_s=1.0)
print('ready', flush=True)
while True:
    time.sleep(0.05)
    if stop.requested and not getattr(stop, 'said', False):
        stop.said = True
        print('requested', stop.name, flush=True)
"""


def test_second_signal_stops_at_once_and_a_repeat_counts_once():
    proc = python_child(STOPPER)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)  # Slurm signals every process and torchrun forwards: the same request twice
    assert proc.stdout.readline().strip() == "requested SIGTERM"
    time.sleep(1.5)
    assert proc.poll() is None, "a repeat within 1 s must not stop the process"
    proc.send_signal(signal.SIGINT)  # a second, later signal: at once
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 128 + signal.SIGINT, (proc.returncode, err)
    assert err.strip().splitlines()[-1] == ("workbench: stopped: a second SIGINT: stopped at once; nothing was saved "
                                             "after the newest checkpoint. Fix: relaunch the same command to resume "
                                             "from the newest checkpoint.")


def test_ctrl_c_twice_under_torchrun_is_sigint_130():
    """torchrun forwards the first Ctrl-C as SIGINT and relays the second as SIGTERM (its agent's default shutdown
    signal): the stop is reported as what the user sent, SIGINT, with the README's code 130."""
    proc = python_child(STOPPER)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().strip() == "requested SIGINT"
    time.sleep(1.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 130, (proc.returncode, err)
    assert err.strip().splitlines()[-1].startswith("workbench: stopped: a second SIGINT: stopped at once;")
