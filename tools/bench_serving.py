"""The serving benchmark: the design note's deployment table at one fixed KV byte budget
(five arms, chat / long-document / no-sharing workloads, closed and open loop, crash rate,
prefix reuse by tier). The same as ``tieredkv serve-bench``; see
``runtime/serving/bench.py`` for the arms and workloads and docs/serving.md for how to read
the tables.

    python tools/bench_serving.py --suite concurrency prefix docs control poisson crash \\
        [--budget-tokens 16384] [--max-model-len 4096] [--clients 8 24] [--out results/serving]
"""

import sys

from tieredkv.runtime.serving.bench import main

if __name__ == "__main__":
    sys.exit(main())
