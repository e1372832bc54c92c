"""The environment a CPU serving process must start with, in a module that imports nothing.

libgomp reads these variables once, as torch loads it, so ``launch.py`` sets them before it
spawns the children. It reads them from here rather than through the device-ops seam
(``CPU_PLATFORM.process_env``, the same tuple): with ``--device cpu`` the launcher then never
imports torch, whose import took a core for seconds before any child could start.
"""

from __future__ import annotations

# OpenMP threads that spin only briefly after a parallel region, then sleep. A decode step opens
# a few hundred regions microseconds apart: a thread that sleeps at once (OMP_WAIT_POLICY=PASSIVE
# alone) pays a wake-up for each, which on an idle 2-core host made a one-request decode step
# take 35 ms served against 20 ms in process; a short spin (GOMP_SPINCOUNT, libgomp's count of
# polls before it sleeps) bridges those gaps and gave 22-23 ms. libgomp's default spin (300,000
# polls) and spinning without end are the other extreme: between steps the spinning threads hold
# the cores that the scheduler's Python, the tokenizer, the detokenizer and any other program
# need, and on a host shared with other work a step then took 110-190 ms against 35-49 ms with no
# spin (docs/benchmarks.md, "The OpenMP wait"). One setting: a user's own value of either
# variable keeps both of ours out (launch.apply_platform_env).
CPU_OPENMP_ENV: tuple[tuple[str, str], ...] = (("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", "5000"))
