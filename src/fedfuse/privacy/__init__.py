"""Privacy mechanisms the round loop applies, below the engine: central differential privacy and its accountant
(:mod:`.dp`), central DP as a step of a server rule (:mod:`.central`), the mean-of-deltas declaration and secure
aggregation as a way to compute its sum (:mod:`.mean`), secure aggregation's orchestration (:mod:`.secure`).
Client-side DP-SGD is :mod:`fedfuse.engine.local_dp` (it trains through, and wraps, the engine's client step)."""
