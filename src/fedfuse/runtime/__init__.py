"""The process's compute settings, below the engine: training precision and memory format (:mod:`.precision`),
torch thread counts (:mod:`.threads`)."""
