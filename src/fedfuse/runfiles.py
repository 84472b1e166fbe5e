"""The files of a run directory: every name fedfuse writes there, what it holds and which code writes it.

This is the one answer to "where is X written": the table :data:`FILES` names each file and its writer, and no
other module of ``src/fedfuse`` spells these names (``tests/test_runfiles.py`` checks it on the source).  The
round loop writes its files through :class:`fedfuse.engine.store.RunStore`; the human-facing files are drawn by
the output callbacks (``fedfuse.outputs``) into the paths the store gives them.

An algorithm's own files (FedMR's similarity heat-map, FedMerge's merging weights) are written by its ``finish``
hook into the run directory under names of its own.
"""

from __future__ import annotations

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
#: how a run that diverged stopped (round, why, lr): a finished outcome, not an interruption
DIVERGED = "diverged.json"
CHECKPOINT = "checkpoint.pt"
CHECKPOINT_TMP = CHECKPOINT + ".tmp"
MODEL_FINAL = "model_final.pt"
#: the global model of the round with the lowest validation loss (``summary.json``'s ``best_val_loss``)
MODEL_BEST_VAL_LOSS = "model_best_val_loss.pt"
MODEL_BEST_OLD = "model_best.pt"  # MODEL_BEST_VAL_LOSS's name in 0.1.0 (removed with an overwritten run)
LOG = "fedfuse.log"
PARTITION_JSON = "partition.json"
PARTITION_PNG = "partition.png"
CURVES = "curves.png"
FLOWER_CALLS = "flower_calls.json"
METRICS_CSV = "metrics.csv"
TENSORBOARD = "tensorboard"  # a directory

#: every file of a run directory: name -> (what it holds, the code that writes it)
FILES: dict[str, tuple[str, str]] = {
    CONFIG: ("the run's configuration, every key", "engine.store.RunStore.start / resume (a resume that extends "
                                                   "the rounds rewrites it)"),
    METRICS: ("one JSON record per round", "engine.store.RunStore.append_metrics (a resume rewrites it from the "
                                           "checkpoint's history)"),
    SUMMARY: ("the run's final, last, best and best_val_loss blocks, totals, executor", "engine.store.RunStore."
                                                                                        "write_summary"),
    DIVERGED: ("the round a run diverged in, why, and its lr (the run stopped there; its metrics.jsonl ends the "
               "round before)", "engine.store.RunStore.mark_diverged"),
    CHECKPOINT: ("everything a resumed run needs to continue bit-identically", "engine.store.RunStore."
                                                                               "save_checkpoint (atomic)"),
    CHECKPOINT_TMP: ("a checkpoint being written (renamed over checkpoint.pt)", "engine.store.RunStore."
                                                                                "save_checkpoint"),
    MODEL_FINAL: ("the global model after the last round", "engine.store.RunStore.save_model"),
    MODEL_BEST_VAL_LOSS: ("the global model of the round with the lowest validation loss",
                          "engine.store.RunStore.save_model"),
    MODEL_BEST_OLD: ("an 0.1.0 run's model_best_val_loss.pt (removed when --overwrite replaces the run)",
                     "fedfuse 0.1.0; nothing writes it now"),
    LOG: ("the run's log, with the traceback of an internal error", "runner (a logging file handler)"),
    PARTITION_JSON: ("per-client split sizes, groups and label histograms", "outputs.PartitionFiles"),
    PARTITION_PNG: ("the partition's label histograms (with plots)", "outputs.PartitionFiles"),
    CURVES: ("accuracy and loss against rounds and bytes (with plots)", "outputs.CurvesPlot"),
    FLOWER_CALLS: ("when each Flower call was pushed and answered", "flower.app (the ServerApp)"),
    METRICS_CSV: ("metrics.jsonl's scalars as a table (--log csv)", "engine.callbacks.CSVLogger"),
    TENSORBOARD: ("TensorBoard event files (--log tensorboard)", "engine.callbacks.TensorBoardLogger"),
}

#: the files that make a directory a run's (:mod:`fedfuse.rundir` refuses to write a fresh run over them)
RUN_FILES = (CHECKPOINT, METRICS, SUMMARY, CONFIG)
#: what ``--overwrite`` removes of an earlier run (its other files are replaced when the new run writes them)
REPLACED = (*RUN_FILES, DIVERGED, CHECKPOINT_TMP, MODEL_BEST_VAL_LOSS, MODEL_BEST_OLD, MODEL_FINAL, LOG)
