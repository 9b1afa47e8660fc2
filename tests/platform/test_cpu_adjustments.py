"""workbench.platform.cpu_adjustments, in this process: the end of training without torchtitan's fixed sleep."""

from __future__ import annotations

import ast
import importlib.util
import time
from pathlib import Path

from workbench.platform import cpu_adjustments, titan_device

titan_device.pin("cpu")

import torchtitan.trainer as titan_trainer  # noqa: E402  (after the device is pinned)


def test_the_closing_sleep_is_the_only_one_and_is_skipped_while_the_rest_of_time_still_works():
    source = Path(importlib.util.find_spec("torchtitan.trainer").origin).read_text()
    sleeps = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
              and ast.unparse(n.func) == "time.sleep"]
    assert [ast.unparse(n) for n in sleeps] == ["time.sleep(2)"]  # what the no-op replaces, and nothing else
    seen = []

    def train():  # stands in for Trainer.train: times a step with the module's `time`, then the closing sleep
        t0 = titan_trainer.time.perf_counter()
        titan_trainer.time.sleep(2)
        seen.append(titan_trainer.time.perf_counter() - t0)

    t0 = time.perf_counter()
    cpu_adjustments.end_of_training_without_sleep(train)  # no process group here: no barrier either
    assert len(seen) == 1 and 0 <= seen[0] < 0.5 and time.perf_counter() - t0 < 0.5
    assert titan_trainer.time.monotonic() > 0  # anything else goes to the real `time`
