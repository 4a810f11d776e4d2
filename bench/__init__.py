"""flashtx's benchmark suite (pytest-benchmark) and its tools.

    pytest bench --benchmark-only                        # everything (GPU); skips with reasons without one
    pytest bench --benchmark-only --quick                # the quick subset (about 2 min at 29be9ff; not timed since)
    python -m bench.report results.json --out DIR        # ratio table + plots from --benchmark-json
    python -m bench.gpu_checks                           # large-shape correctness, O(N) memory, speed table
    python -m bench.overhead                             # host overhead per public call (CPU or GPU)
    python -m bench.tune                                 # sweep the attention tile configs on this GPU
    bash bench/device_check.sh                           # all of the above on a lent GPU machine

See bench/README.md.
"""
