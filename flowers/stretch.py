"""A schedule written for one length, run over another from some point on.

A time budget re-plans its run's length at an epoch's end (flowers.budget). The learning rate and the image
sizes then carry on from where they are and reach their last values at the new end, with no jump: the rest of
the schedule is stretched or squeezed. Knots are ``(run position, schedule position)`` pairs, increasing; no
knots is the schedule as written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Knots = Sequence[Sequence[float]]


def position(run_at: float, knots: Knots) -> float:
    """Where the schedule is when the run is at ``run_at``: linear between knots, as written outside them."""
    if not knots:
        return run_at
    points = [(float(run), float(schedule)) for run, schedule in knots]
    if run_at <= points[0][0]:
        return run_at - points[0][0] + points[0][1]
    for (run_a, schedule_a), (run_b, schedule_b) in zip(points, points[1:], strict=False):
        if run_at <= run_b:
            return schedule_a + (schedule_b - schedule_a) * (run_at - run_a) / (run_b - run_a)
    return run_at - points[-1][0] + points[-1][1]


def stretched(knots: Knots, *, at: float, end: float, new_end: float) -> list[list[float]]:
    """``knots`` for a run that was to end at ``end`` and, from ``at`` on, ends at ``new_end`` instead."""
    if not at < new_end:
        raise ValueError(f"a schedule stretched at {at} must end after it, not at {new_end}")
    kept = [[float(run), float(schedule)] for run, schedule in knots if run < at]
    return [*kept, [float(at), position(at, knots)], [float(new_end), position(end, knots)]]


def checked(knots: object) -> list[list[float]]:
    """``knots`` as a checkpoint holds them, which is data: pairs of finite numbers whose run positions increase."""
    if not isinstance(knots, list | tuple) or not all(
            isinstance(knot, list | tuple) and len(knot) == 2
            and all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in knot)
            for knot in knots):
        raise ValueError("a stretched schedule's knots must be pairs of finite numbers")
    runs = [knot[0] for knot in knots]
    if any(b <= a for a, b in zip(runs, runs[1:], strict=False)):
        raise ValueError("a stretched schedule's run positions must increase")
    return [[float(run), float(schedule)] for run, schedule in knots]
