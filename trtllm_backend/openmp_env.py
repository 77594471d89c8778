"""How the engine's OpenMP threads wait between parallel regions: the environment every launcher sets.

libgomp reads these once, when torch loads it, so they go into a child process's environment (launchers) or
are exported (Makefile, Dockerfile); changing them in a running process has no effect.
- OMP_WAIT_POLICY=ACTIVE with GOMP_SPINCOUNT=200000: a worker spins a bounded while (a few ms) after each
  parallel region, then sleeps. A decode step runs from one (fused) to ~150 parallel regions microseconds
  apart; waking a sleeping worker costs tens of microseconds on this VM, more than a small INT4 linear.
  Measured on the 2-core machine, alone (`tools.bench_engine --policy full int4 --threads 2`, fp16-stored):
  all-INT4 batch-1 step 9.5-10.4 ms with PASSIVE + GOMP_SPINCOUNT=20000 (the earlier setting; under PASSIVE
  libgomp did not spin, whatever GOMP_SPINCOUNT said), 5.9 ms with ACTIVE + 20000, 3.9 ms with ACTIVE +
  200000; served batch-1 TPOT 10.8 -> 5.9 ms. Unbounded spinning (ACTIVE alone) would hold a core while the
  server idles and stall the other threads on a 2-core machine.
- Where the machine is shared with other heavy work (CI, the test suite: .ci/run), PASSIVE is the polite
  setting; a caller's own values always win (with_openmp_defaults fills only what is unset).
"""

from __future__ import annotations

from collections.abc import MutableMapping

from . import env_vars

OPENMP_ENV = {v.name: v.default for v in (env_vars.OMP_WAIT_POLICY, env_vars.GOMP_SPINCOUNT)}


def with_openmp_defaults(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """`env` with the settings above wherever it does not set them itself."""
    for key, value in OPENMP_ENV.items():
        env.setdefault(key, value)
    return env
