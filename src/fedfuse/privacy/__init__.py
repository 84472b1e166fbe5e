"""Privacy mechanisms the round loop applies, below the engine: central differential privacy and its accountant
(:mod:`.dp`), secure aggregation's orchestration (:mod:`.secure`).  Client-side DP-SGD is
:mod:`fedfuse.engine.local_dp` (it trains through the engine's client step)."""
