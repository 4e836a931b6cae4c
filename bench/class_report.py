"""The figures of a class for bench.class_load: percentiles, the summary it prints, the ratio line.

Result is one class's figures, what --json writes; Class is one class's outcome, what main prints
from. Made from what the students recorded (bench.class_students), after the run (bench.class_run).
"""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from locust.env import Environment

from bench.app_load import percentile
from bench.class_students import ClassReport, HeavyReport


@dataclass
class Result:
    """One class's figures, as printed (and written with --json)."""

    students: int
    seconds: float
    runs: int
    views: int
    runs_per_s: float
    views_per_s: float
    p50: float | None
    p95: float | None
    max: float | None
    by_kind: dict[str, tuple[int, float, float]]  # kind -> (count, p50, p95)
    server_cpu: float | None
    cpu_per_run: float | None
    cpu_per_view: float | None
    generator_cpu: float
    predictions: int
    actions: dict[int, int]
    errors: list[str]
    mixups: list[str]
    replicas: dict[str, int]  # behind vit-explorer serve's proxy: replica -> students it served


def figures(report: ClassReport, students: int, seconds: float, measured_runs: list[tuple[str, float]],
            measured_views: int, server_cpu: float | None, generator_cpu: float) -> Result:
    """The figures of a class of ``students`` that ran ``seconds``: the runs and page views measured
    in that time, the rest as ``report`` holds it at the end."""
    times = [seconds_ for _, seconds_ in measured_runs]
    kinds = sorted({kind for kind, _ in measured_runs})
    by_kind = {}
    for kind in kinds:
        values = [s for k, s in measured_runs if k == kind]
        by_kind[kind] = (len(values), percentile(values, 50), percentile(values, 95))
    return Result(
        students=students, seconds=seconds, runs=len(times), views=measured_views,
        runs_per_s=len(times) / seconds, views_per_s=measured_views / seconds,
        p50=percentile(times, 50) if times else None, p95=percentile(times, 95) if times else None,
        max=max(times, default=None), by_kind=by_kind, server_cpu=server_cpu,
        cpu_per_run=server_cpu / len(times) if server_cpu is not None and times else None,
        cpu_per_view=server_cpu / measured_views if server_cpu is not None and measured_views else None,
        generator_cpu=generator_cpu, predictions=report.predictions, actions=dict(report.actions),
        errors=report.errors, mixups=report.mixups,
        replicas=dict(Counter(session.replica for session in report.sessions if session.replica)),
    )


def summary(result: Result, think: tuple[float, float]) -> list[str]:
    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f} s"

    done = sorted(result.actions.values()) or [0]
    lines = [
        (f"students: {result.students}, {len(result.actions)} started; actions finished per student:"
         f" min {done[0]}, median {statistics.median(done):g}, max {done[-1]}"),
        (f"throughput: {result.runs_per_s:.2f} finished runs/s, {result.views_per_s:.2f} page views/s"
         f" ({result.runs} runs, {result.views} page views in {result.seconds:.0f} s)"),
        f"time to a finished run: p50 {s(result.p50)}, p95 {s(result.p95)}, max {s(result.max)}",
    ]
    lines += [f"  {kind:<7} {count:4d} runs  p50 {s(p50)}  p95 {s(p95)}" for kind, (count, p50, p95) in result.by_kind.items()]
    if result.server_cpu is None:
        lines.append("server CPU: not measured (give --server-pid with --url)")
    else:
        lines.append(
            f"server CPU: {result.server_cpu:.1f} s in {result.seconds:.0f} s"
            f" ({result.server_cpu / result.seconds:.2f} cores): {s(result.cpu_per_run)} per finished run,"
            f" {s(result.cpu_per_view)} per page view"
        )
    if result.replicas:
        lines.append("students per replica: " + ", ".join(f"{name} {count}" for name, count in sorted(result.replicas.items())))
    lines.append(f"load generator's own CPU: {result.generator_cpu:.1f} s (on the same machine)")
    lines.append(f"errors: {len(result.errors)}")
    lines += [f"  {line}" for line in result.errors[:20]]
    lines.append(f"mix-ups: {len(result.mixups)} (every run's sidebar image checked;"
                 f" {result.predictions} Pipeline predictions checked)")
    lines += [f"  {line}" for line in result.mixups[:20]]
    if result.students >= 30 and think == (5, 10):
        met = result.p95 is not None and result.p95 <= 2 and not result.errors and not result.mixups
        lines.append(f"goal (30 students, think 5-10 s: p95 <= 2 s, 0 errors, 0 mix-ups): {'met' if met else 'MISSED'}")
    return lines


@dataclass
class Class:
    """One class's outcome: the light students' figures, Locust's stats, the heavy students'."""

    result: Result
    environment: Environment
    heavy: list[HeavyReport]
    workers_ended: int
    log: Path


def heavy_summary(heavy: HeavyReport) -> str:
    waits = sorted(heavy.waits)
    took = f" ({waits[0]:.0f}-{waits[-1]:.0f} s from the click)" if waits else ""
    return (f"heavy student {heavy.number}: jobs {heavy.finished} finished{took}, {heavy.cancelled} cancelled,"
            f" {heavy.failed} failed, {heavy.lost} lost; {heavy.inline} drawn without a job; errors {len(heavy.errors)}")


def ratio_line(alone: Result, beside: Class, heavy: int) -> str:
    """The last line: the light students' p95 beside the heavy ones over alone, and the heavy jobs."""
    def ratio(what: str, before: float | None, after: float | None) -> str:
        if not before or after is None:
            return f"{what} -"
        return f"{what} {after:.2f} s / {before:.2f} s = {after / before:.2f}x"

    slider = [result.by_kind.get("slider", (0, None, None))[2] for result in (alone, beside.result)]
    return "; ".join([
        ratio(f"light p95 beside {heavy} heavy / alone:", alone.p95, beside.result.p95),
        ratio("slider moves", *slider),
        *(f"heavy {report.number}: {report.finished} finished / {report.cancelled} cancelled / {report.lost} lost,"
          f" {len(report.errors)} errors" for report in beside.heavy),
    ])
