"""The Markdown pieces every table of a study's reports is built from: marks and cells."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from offpolicy_jax.study import stats as study_stats

MARK = {
  study_stats.WORSE: "worse",
  study_stats.BETTER: "better",
  study_stats.SAME: "~",
  study_stats.EQUIVALENT: "≈",
  study_stats.IDENTICAL: "=",
}

# Marks of a difference in steps to the threshold (more steps: slower).
FASTER = {
  study_stats.WORSE: "faster",
  study_stats.BETTER: "slower",
  study_stats.SAME: "~",
  study_stats.IDENTICAL: "=",
}


def by_seed(d: Mapping[int, float], seeds: Sequence[int]) -> list[float]:
  return [d[s] for s in seeds]


def md(header: Sequence[str], body: Iterable[Sequence[str]]) -> list[str]:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return lines + ["| " + " | ".join(row) + " |" for row in body]


def signed(iv: study_stats.Interval, fmt: str = "+.3f") -> str:
  return f"{iv.mean:{fmt}} [{iv.low:{fmt}}, {iv.high:{fmt}}]"
