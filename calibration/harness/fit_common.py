"""How the fits read calibration records: which records count and which statistic of a
benchmark's repetitions they reproduce."""
from __future__ import annotations

# Which per-benchmark statistic the fit reproduces: the median repetition, each repetition the
# mean of its calls (collectives: the mean over all calls, fit_comm.mean_call_time_s). zsim
# predicts the typical step (zsim validate compares with the median step), and a step sums many
# calls, so it pays the mean per-call cost, occasional stalls included. The fastest repetition
# (Chen & Revels 2016) is the more repeatable estimate of the uncontended time, but it biased
# every in-step prediction low (collectives by 2-3x on gloo). Records keep the minimum and the
# spread too.
FIT_STATISTIC = "time_s"


def fit_time_s(r: dict) -> float:
    return r.get(FIT_STATISTIC, r["time_s"])


def fit_rate(r: dict, key: str) -> float:
    """A rate the worker computed from the median, restated at the fit statistic."""
    return r[key] * r["time_s"] / fit_time_s(r) if r.get("time_s") else r[key]


def usable(records, kind):
    """The records of one kind that measured something (no error, a positive time)."""
    return [r for r in records if r.get("kind") == kind and "error" not in r and r.get("time_s", 0) > 0]


def relative_errors(predicted, measured) -> list[float]:
    return [(p - m) / m for p, m in zip(predicted, measured)]
