"""Statistics over seeds: mean ± std, final-window accuracy, rounds-to-target and paired tests.

These are the numbers a comparison table reports.  Everything here is a pure function of per-round
histories (lists of the dicts written to ``metrics.jsonl``) or of per-seed scalars, so tables built by the
CLI, the Python API and the reproductions agree.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedfuse.errors import UserError


@dataclass(frozen=True)
class MeanStd:
    """Mean, sample standard deviation (ddof = 1; 0 when n = 1) and count of a set of per-seed values."""

    mean: float
    std: float
    n: int

    def ci95(self) -> float:
        """Half-width of the 95% confidence interval of the mean (Student t, n - 1 degrees of freedom); NaN for
        n < 2."""
        if self.n < 2 or math.isnan(self.std):
            return float("nan")
        from scipy import stats as sps

        return float(sps.t.ppf(0.975, self.n - 1) * self.std / math.sqrt(self.n))

    def fmt(self, scale: float = 1.0, digits: int = 2) -> str:
        """``"81.60 ± 1.20"``; the ± part is left out when n = 1."""
        if self.n == 0 or math.isnan(self.mean):
            return "—"
        m = f"{self.mean * scale:.{digits}f}"
        return m if self.n == 1 else f"{m} ± {self.std * scale:.{digits}f}"


def mean_std(values: Sequence[float | None]) -> MeanStd:
    """Mean ± sample std over the non-missing values (None and NaN are skipped)."""
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    n = len(vals)
    if n == 0:
        return MeanStd(float("nan"), float("nan"), 0)
    m = sum(vals) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
    return MeanStd(m, sd, n)


def evaluations(history: Sequence[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(round, value) for every round of ``history`` where ``key`` was measured."""
    return [(int(h["round"]), float(h[key])) for h in history if h.get(key) is not None]


#: The evaluations "final" averages (``last`` everywhere it is a parameter): see :func:`final_window`.
FINAL_WINDOW = 5


def final_window(evaluated: int, last: int = FINAL_WINDOW) -> int:
    """How many of a run's ``evaluated`` evaluations its "final" value averages: the last ``last``, but never
    more than the later half of them (rounded up), so a short run's first rounds stay out.

    This is the one definition of "final" (``fedfuse run``, ``compare``, ``summary.json``, the API, reports):
    ``min(last, ceil(evaluated / 2))``.  With ``last`` = 5: 1 of 1 or 2 evaluations, 2 of 3 or 4, 3 of 5 or 6,
    4 of 7 or 8, and 5 from 9 evaluations on."""
    if evaluated <= 0:
        return 0
    return min(max(1, last), math.ceil(evaluated / 2))


def final_mean(history: Sequence[dict[str, Any]], key: str = "global_accuracy",
               last: int = FINAL_WINDOW) -> float | None:
    """The "final" value of ``key``: its mean over the last :func:`final_window` evaluations (a noisy FL curve's
    final accuracy); None when ``key`` was never evaluated."""
    ev = evaluations(history, key)
    ev = ev[len(ev) - final_window(len(ev), last):]
    return sum(v for _, v in ev) / len(ev) if ev else None


def final_rule(last: int = FINAL_WINDOW) -> str:
    """The definition of "final", in words, for ``last``."""
    last = max(1, last)
    if last == 1:
        return "final = the last evaluation"
    return (f"final = the mean of the last {last} evaluations, or of the later half (rounded up) of a run's "
            f"evaluations when it has fewer than {2 * last}")


def final_note(last: int, counts: Sequence[int], subject: str = "these runs") -> str:
    """What "final" is, in words, for runs with ``counts`` evaluations each (:func:`final_rule`), saying how many
    evaluations it averaged when some runs have fewer than twice ``last`` (:func:`final_window`)."""
    last = max(1, last)
    if last == 1:
        return final_rule(1)
    what = f"final = the mean of the last {last} evaluations"
    windows = sorted({(c, final_window(c, last)) for c in counts if final_window(c, last) < last})
    if not windows:
        return what
    if len(set(counts)) == 1:
        c, w = windows[0]
        its = "its" if subject.startswith("this ") else "their"
        had = f"{its} only evaluation" if c == 1 else (f"{its} last evaluation" if w == 1 else
                                                        f"the mean of {its} later half, the last {w}")
        return f"{what}; {subject} evaluated {c} time{'s' if c != 1 else ''}, so final = {had}"
    shown = ", ".join(f"the last {w} of {c}" for c, w in windows)
    return f"{what}, or of the later half of a run that has fewer ({shown} evaluations here)"


def is_evaluation_metric(key: str) -> bool:
    """A metric measured by evaluation on held-out data (accuracies, losses, perplexities, ROUGE of the global
    and personal models, validation metrics), as opposed to training statistics, costs and counters."""
    return key in ("loss", "perplexity") or key.startswith(("global_", "personal_", "val_"))


def primary_metric(history: Sequence[dict[str, Any]]) -> str:
    """The accuracy "best" and "final" refer to when no metric is named: ``global_accuracy`` when the run
    evaluated a global model, else ``personal_accuracy`` (the mean over clients of their personal models)."""
    return "global_accuracy" if any(h.get("global_accuracy") is not None for h in history) else "personal_accuracy"


def best_round(history: Sequence[dict[str, Any]], key: str = "global_accuracy") -> dict[str, Any] | None:
    """The record of the evaluation with the best ``key`` (highest; lowest for a loss or perplexity; the earliest
    on a tie); None when ``key`` was never evaluated."""
    lower = lower_is_better(key)
    best: dict[str, Any] | None = None
    for h in history:
        v = h.get(key)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        if best is None or (v < best[key] if lower else v > best[key]):
            best = h
    return best


def lower_is_better(key: str) -> bool:
    """Losses and perplexities improve downwards; accuracies (and anything else) upwards."""
    return "loss" in key or "perplexity" in key


def _reached(value: float, target: float, lower: bool) -> bool:
    return value <= target if lower else value >= target


def best_value(history: Sequence[dict[str, Any]], key: str = "global_accuracy",
               lower: bool | None = None) -> float | None:
    """Best evaluation of ``key``: the maximum, or the minimum for a loss/perplexity (``lower`` overrides)."""
    ev = evaluations(history, key)
    if not ev:
        return None
    lower = lower_is_better(key) if lower is None else lower
    return (min if lower else max)(v for _, v in ev)


def rounds_to_target(history: Sequence[dict[str, Any]], target: float, key: str = "global_accuracy",
                     lower: bool | None = None) -> int | None:
    """First round at which ``key`` reaches ``target`` (>= it; <= it for a loss/perplexity); None if never."""
    lower = lower_is_better(key) if lower is None else lower
    for r, v in evaluations(history, key):
        if _reached(v, target, lower):
            return r
    return None


def cost_to_target(history: Sequence[dict[str, Any]], target: float, key: str = "global_accuracy",
                   cost: str = "total_bytes", lower: bool | None = None) -> float | None:
    """Cumulative cost (``total_bytes``, ``total_client_flops``, ...) when ``key`` first reaches ``target``."""
    lower = lower_is_better(key) if lower is None else lower
    for h in history:
        if h.get(key) is not None and _reached(float(h[key]), target, lower):
            return float(h[cost]) if h.get(cost) is not None else None
    return None


@dataclass(frozen=True)
class PairedTest:
    """A paired comparison of a method against a baseline over the same seeds."""

    diff: float
    p_value: float
    n: int
    test: str

    def significant(self, alpha: float = 0.05) -> bool:
        return self.tested and self.p_value < alpha

    @property
    def tested(self) -> bool:
        """False when no test was made: fewer than :data:`MIN_PAIRS` pairs, or every pair differs by the same
        amount (zero variance of the differences: the t statistic is 0/0 or infinite)."""
        return self.n >= MIN_PAIRS and not math.isnan(self.p_value)

    def mark(self, alpha: float = 0.05) -> str:
        """``"*"`` when significant at ``alpha``, ``"(n.s.)"`` when tested and not, ``"(no test)"`` when no test
        could be made (see :attr:`tested`)."""
        if not self.tested:
            return "(no test)"
        return "*" if self.significant(alpha) else "(n.s.)"


#: fewest paired seeds a table tests (with 2 the paired t-test has one degree of freedom: any two nearly equal
#: differences give a tiny p-value)
MIN_PAIRS = 3

#: the footnote's words for the marks of :meth:`PairedTest.mark`
MARKS_NOTE = (f"(no test) fewer than {MIN_PAIRS} shared seeds or the same difference on every seed, so no test "
              "was made")


def paired_test(method: Sequence[float], baseline: Sequence[float], test: str = "t") -> PairedTest:
    """Two-sided paired test over seeds: ``t`` (paired t-test) or ``wilcoxon`` (signed-rank).

    Pairs where either side is missing are dropped.  With fewer than :data:`MIN_PAIRS` pairs, or when every
    pair differs by the same amount (a degenerate test), the p-value is NaN: no claim is made.
    """
    pairs = [(float(a), float(b)) for a, b in zip(method, baseline, strict=False)
             if a is not None and b is not None and not (math.isnan(float(a)) or math.isnan(float(b)))]
    n = len(pairs)
    diffs = [a - b for a, b in pairs]
    mean_diff = sum(diffs) / n if n else float("nan")
    spread = max(diffs) - min(diffs) if diffs else 0.0
    if n < MIN_PAIRS or spread <= 1e-12 + 1e-9 * max(abs(d) for d in diffs):  # equal up to rounding
        return PairedTest(mean_diff, float("nan"), n, test)
    from scipy import stats as sps

    if test == "t":
        p = float(sps.ttest_rel([a for a, _ in pairs], [b for _, b in pairs]).pvalue)
    elif test == "wilcoxon":
        p = float(sps.wilcoxon(diffs).pvalue)
    else:
        raise UserError(f"paired_test: test must be 't' or 'wilcoxon', got {test!r}")
    return PairedTest(mean_diff, p, n, test)


def parse_seeds(spec: str | int | Sequence[int]) -> list[int]:
    """``"3"`` or ``3`` → [0, 1, 2] (a bare number is a count); ``"0,4,7"`` → [0, 4, 7]; ``"5,"`` → [5].

    A sequence is returned as a list."""
    if isinstance(spec, int):
        if spec < 1:
            raise UserError(f"seeds: a count must be >= 1, got {spec} (a bare number is a count: "
                            f"write '{spec},' for the single seed {spec})")
        return list(range(spec))
    if not isinstance(spec, str):
        return [int(s) for s in spec]
    s = spec.strip()
    if not s:
        raise UserError("seeds: empty")
    try:
        values = [int(x) for x in s.split(",") if x.strip()]
    except ValueError as e:
        raise UserError(f"seeds: expected a count (3) or a comma list (0,1,2), got {spec!r}") from e
    return parse_seeds(values[0]) if "," not in s else values


def with_bytes(history: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the records with ``total_bytes`` (down + up + peer, cumulative) and ``bytes`` (this round)."""
    out = []
    for h in history:
        h = dict(h)
        if "total_bytes" not in h:
            h["total_bytes"] = sum(h.get(k) or 0 for k in ("total_bytes_down", "total_bytes_up", "total_bytes_peer"))
        if "bytes" not in h:
            h["bytes"] = sum(h.get(k) or 0 for k in ("bytes_down", "bytes_up", "bytes_peer"))
        out.append(h)
    return out


def stability(history: Sequence[dict[str, Any]], metric: str = "global_accuracy",
              window: int = 10) -> tuple[float | None, float | None]:
    """(mean of ``metric`` over the last ``window`` rounds, best mean over any ``window`` consecutive rounds)
    from the evaluated rounds of a history; a run shorter than ``window`` has one window, all of it."""
    ev = [(int(h["round"]), float(h[metric])) for h in history if h.get(metric) is not None]
    if not ev:
        return None, None
    first, last_round = ev[0][0], ev[-1][0]
    last = [a for r, a in ev if r > last_round - window]
    means = []
    for start in range(first, max(first, last_round - window + 1) + 1):
        w = [a for r, a in ev if start <= r < start + window]
        if w:
            means.append(sum(w) / len(w))
    return sum(last) / len(last), max(means)


# ---- many methods over many problems (the benchmark matrix) --------------------------------------------------
def swing(values: Sequence[float], window: int) -> float | None:
    """The largest change between consecutive values among the last ``window`` (at least 2): how far an evaluated
    model moves from one evaluation to the next inside a headline window (None with fewer than 2 values)."""
    pts = list(values)[-max(2, window):]
    return max(abs(b - a) for a, b in itertools.pairwise(pts)) if len(pts) > 1 else None


def ranks(matrix: Sequence[Sequence[float]], higher_is_better: bool = True) -> list[list[float]]:
    """Per row (a problem) the rank of every column (a method): 1 = best, ties share their average rank."""
    from scipy.stats import rankdata

    sign = -1.0 if higher_is_better else 1.0
    return [[float(r) for r in rankdata([sign * float(v) for v in row], method="average")] for row in matrix]


def mean_ranks(matrix: Sequence[Sequence[float]], higher_is_better: bool = True) -> list[float]:
    """Every column's rank averaged over the rows (:func:`ranks`)."""
    rk = ranks(matrix, higher_is_better)
    return [sum(r[j] for r in rk) / len(rk) for j in range(len(rk[0]))] if rk else []


@dataclass(frozen=True)
class Friedman:
    """Friedman's test that k methods rank alike over n problems: chi-square statistic and p-value."""

    statistic: float
    p_value: float
    n: int
    k: int


def friedman(matrix: Sequence[Sequence[float]]) -> Friedman:
    """Friedman's test over a problems × methods matrix (rows: problems; at least 2 rows and 3 columns; NaN
    result when the test is undefined, e.g. all values tied)."""
    from scipy.stats import friedmanchisquare

    n, k = len(matrix), len(matrix[0]) if matrix else 0
    if n < 2 or k < 3:
        return Friedman(float("nan"), float("nan"), n, k)
    res = friedmanchisquare(*[[float(row[j]) for row in matrix] for j in range(k)])
    return Friedman(float(res.statistic), float(res.pvalue), n, k)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates, for (cost, value) pairs: lower cost and higher value are
    better; a point is dominated by one at most as costly and at least as good, strictly better in one."""
    front = []
    for i, (c, v) in enumerate(points):
        if not any((c2 <= c and v2 >= v) and (c2 < c or v2 > v) for j, (c2, v2) in enumerate(points) if j != i):
            front.append(i)
    return sorted(front, key=lambda i: (points[i][0], -points[i][1]))
