"""When this process started, by the wall clock: where a segment's timing_s/startup counts from.

psutil's create_time adds the start's clock ticks since boot to the boot time, which Linux gives in
whole seconds, cut short: the start comes out up to 1 s early (0.75 s on the 2-core CPU host) and the
startup as much longer. Here: now, less the time since the start by the boot clock (to a clock tick, 10 ms).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil


def process_start() -> float:
    """This process's start, as seconds since the epoch (time.time()'s clock)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime; the name in (...) may hold spaces
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, AttributeError, ValueError):  # not Linux
        return psutil.Process().create_time()
