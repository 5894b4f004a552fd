"""Every number the results docs quote from a committed study, recomputed from its CSV.

A claim names a doc, a template of the text it quotes (`{}` stands for a
number, `{m}` for a verdict mark: `worse`, `better`, `~`, `≈`, `faster`,
`slower`, `(baseline)`; a run of spaces for any whitespace, line breaks and
the `# ` of a comment's next line included), the committed file under
`experiments/results/` the numbers come from, and a function that returns
them in the order they are quoted. The numbers are recomputed with the code
that wrote the reports (`study.report.read_csv`, `study.report_tables`,
`study.stats`): t intervals, sign-flip tests with Holm's correction,
equivalence tests, A/A rates. A fact is a sentence of a doc with no number
to compare but a statement about the data (`no cell is ≈`): its text must be
in the doc and its check true.

A claim fails when its text is not in the doc (the doc changed: change the
claim with it) or when a quoted number differs from the recomputed one at the
precision printed (`0.13` is checked to two decimals, `+0.019` to three with
its sign, `4e-4` to its one digit). The docs also quote numbers of runs that
kept no per-run data (first runs, probes, benchmarks, wall times): those are
not claims here, and the docs say which runs they come from.
"""

from __future__ import annotations

import csv
import functools
import json
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import pytest

from offpolicy_jax.study import report as study_report
from offpolicy_jax.study import report_aa, report_tables
from offpolicy_jax.study import stats as study_stats

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "experiments", "results")
LAGS5 = ("onpolicy", "interval20", "offset10", "stale32", "offline")
LAGGED = LAGS5[1:]

# ------------------------------------------------------------------------------------------
# A committed study's data.


class Study:
  """One committed study: per-seed summaries and curves from its `study.csv`, its config."""

  def __init__(self, name: str):
    self.name = name
    path = os.path.join(RESULTS, name)
    rows = study_report.read_csv(os.path.join(path, "study.csv"))
    self.methods, self.lags, self.values = report_tables.summary_table(rows)
    self.curves: dict[tuple[str, str, str], dict[int, dict[int, float]]] = {}
    for r in rows:
      if r["step"] is not None:
        key = (r["method"], r["lag"], r["metric"])
        self.curves.setdefault(key, {}).setdefault(r["seed"], {})[r["step"]] = r["value"]
    with open(os.path.join(path, "study_config.json")) as f:
      spec = json.load(f)["study"]
    self.baseline = tuple(spec["baseline"].split("@"))
    self.alpha = spec["alpha"]
    self.margin = spec["equivalence_margin"] or None
    self.seeds = sorted(self.values[(*self.baseline, "final_accuracy")])
    self.main = [m for m in self.methods if not m.startswith("aa-")]
    self._same_lag: dict[str, dict] = {}

  def x(self, method: str, lag: str, metric: str = "final_accuracy") -> np.ndarray:
    """Per-seed values of a summary metric, in seed order."""
    got = self.values[method, lag, metric]
    return np.array([got[s] for s in self.seeds])

  def iv(self, method: str, lag: str, metric: str = "final_accuracy") -> study_stats.Interval:
    """Mean over seeds with its 95% t interval (`study.stats.interval`)."""
    return study_stats.interval(self.x(method, lag, metric))

  def mean(self, method: str, lag: str, metric: str = "final_accuracy") -> float:
    return float(self.x(method, lag, metric).mean())

  def gains(self, method: str, lag: str) -> np.ndarray:
    """Final accuracy minus the warm start's (step 0), per seed."""
    return self.x(method, lag) - self.x(method, lag, "start_accuracy")

  def gain(self, method: str, lag: str) -> study_stats.Interval:
    return study_stats.interval(self.gains(method, lag))

  def at(self, method: str, lag: str, step: int, metric: str = "eval_accuracy") -> np.ndarray:
    """Per-seed values of a curve at one step."""
    got = self.curves[method, lag, metric]
    return np.array([got[s][step] for s in self.seeds])

  def collapsed(self, method: str, lag: str) -> int:
    return int(self.x(method, lag, "collapsed").sum())

  def reached(self, method: str, lag: str) -> int:
    return int(self.x(method, lag, "threshold_reached").sum())

  def same(self, a: tuple[str, str], b: tuple[str, str], metric="final_accuracy") -> bool:
    """Whether two cells are the same runs (equal on every seed)."""
    return bool(np.array_equal(self.x(*a, metric), self.x(*b, metric)))

  def compare(
    self, method: str, lag: str, base: tuple[str, str], metric: str = "final_accuracy"
  ) -> study_stats.Comparison:
    """Paired comparison of two cells over the same seeds (`study.stats.compare`)."""
    margin = None if metric in ("steps_to_threshold", "tokens_to_threshold") else self.margin
    return study_stats.compare(self.x(method, lag, metric), self.x(*base, metric), margin=margin)

  @functools.cached_property
  def tests(self) -> dict[tuple[str, str], tuple[study_stats.Comparison, float, str]]:
    """{(method, lag): (comparison, Holm p, mark)} against the baseline: study.md's marks."""
    comps = {
      (m, g): self.compare(m, g, self.baseline)
      for m in self.main
      for g in self.lags
      if (m, g) != self.baseline and self.values.get((m, g, "final_accuracy"))
    }
    return {
      k: (comps[k], p, report_tables.MARK[v])
      for k, (p, v) in study_stats.verdicts(comps, self.alpha).items()
    }

  def mark(self, method: str, lag: str) -> str:
    """The mark of a cell against the baseline, as study.md's first table prints it."""
    return "(baseline)" if (method, lag) == self.baseline else self.tests[method, lag][2]

  def diff(self, method: str, lag: str) -> study_stats.Interval:
    """The paired difference to the baseline (mean, 95% t interval)."""
    return self.tests[method, lag][0].diff

  def same_lag(self, metric: str) -> dict[tuple[str, str], tuple[study_stats.Comparison, str]]:
    """{(method, lag): (comparison, mark)} against the baseline method in the same lag.

    study.md's "Learning speed" tables: Holm over each table's comparisons.
    """
    if metric not in self._same_lag:
      base = self.baseline[0]
      comps = {
        (m, g): self.compare(m, g, (base, g), metric)
        for m in self.main
        for g in self.lags
        if m != base and self.values.get((m, g, metric)) and self.values.get((base, g, metric))
      }
      faster = metric in ("steps_to_threshold", "tokens_to_threshold")
      marks = report_tables.FASTER if faster else report_tables.MARK
      verdicts = study_stats.verdicts(comps, self.alpha)
      self._same_lag[metric] = {k: (comps[k], marks[v]) for k, (_, v) in verdicts.items()}
    return self._same_lag[metric]

  def aa(self, metric: str) -> dict[str, tuple[study_stats.Comparison, str]]:
    """{lag: (comparison, mark)} of the A/A pairs on one metric (`report_aa.aa_tests`)."""
    aa_methods = [m for m in self.methods if m.startswith("aa-")]
    tests = report_aa.aa_tests(self.values, aa_methods, self.lags, self.seeds, self.alpha)
    return {g: (c, report_tables.MARK[v]) for _, g, met, c, v in tests if met == metric}

  def aa_rate(self, metric: str) -> tuple[int, int, float, float, float]:
    """(false verdicts, informative pairs, rate, 95% Clopper-Pearson low, high), as study.md.

    Pairs whose differences are all 0 are left out, as the report does.
    """
    pairs = [(c, v) for c, v in self.aa(metric).values() if not c.diff.low == c.diff.high == 0]
    k = sum(v != "~" for _, v in pairs)
    return (k, len(pairs), k / len(pairs), *study_stats.clopper_pearson(k, len(pairs)))


def _aa_tests(st: Study) -> list:
  """Every A/A pair's test of `st` (`report_aa.aa_tests`, as study.md runs them)."""
  aa_methods = [m for m in st.methods if m.startswith("aa-")]
  return report_aa.aa_tests(st.values, aa_methods, st.lags, st.seeds, st.alpha)


@functools.cache
def S(name: str) -> Study:
  return Study(name)


def ivs(iv: study_stats.Interval) -> tuple[float, float, float]:
  return iv.mean, iv.low, iv.high


def _first_run_table() -> dict[tuple[str, str], str]:
  """The default grid's first run's final-accuracy cells (`study_first_run.md`, no CSV)."""
  path = os.path.join(RESULTS, "lag_study_default", "study_first_run.md")
  with open(path) as f:
    table = f.read().split("## Final greedy accuracy")[1].split("## Paired")[0]
  out = {}
  for line in table.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 6 and cells[0] not in ("method", "---"):
      out.update({(cells[0], g): cell for g, cell in zip(LAGS5, cells[1:], strict=True)})
  return out


def first_run_mark(method: str, lag: str) -> str:
  cell = _first_run_table()[method, lag]
  return "(baseline)" if cell.endswith("(baseline)") else cell.split()[-1]


def first_run_mean(method: str, lag: str) -> float:
  return float(_first_run_table()[method, lag].split()[0])


def default_vs_first_run() -> dict[tuple[str, str], float]:
  """|committed mean - first run's mean| of each cell, both at the 3 decimals printed."""
  d = S("lag_study_default")
  return {(m, g): abs(round(d.mean(m, g), 3) - first_run_mean(m, g)) for m in d.main for g in LAGS5}


def changed_marks() -> set[tuple[str, str]]:
  """Cells whose mark against GRPO on-policy differs between the first and committed run."""
  d = S("lag_study_default")
  return {(m, g) for m in d.main for g in LAGS5 if first_run_mark(m, g) != d.mark(m, g)}


# ------------------------------------------------------------------------------------------
# Matching.

_NUMBER = r"([+-]?\d+(?:\.\d+)?(?:e[+-]?\d+)?)"
_MARK = r"(worse|better|~|≈|=|faster|slower|\(baseline\))"


def pattern(text: str) -> re.Pattern:
  """The regex of a claim's text: `{}` a number, `{m}` a mark, spaces any whitespace."""
  out = []
  for piece in re.split(r"(\{\}|\{m\}|\s+)", text):
    if piece == "{}":
      out.append(_NUMBER)
    elif piece == "{m}":
      out.append(_MARK)
    elif piece.isspace():
      out.append(r"\s+")
    elif piece:
      out.append(re.escape(piece))
  return re.compile("".join(out))


def agrees(quoted: str, value: Any) -> bool:
  """Whether a quoted number (or mark) is `value` at the precision printed.

  A tuple of values: each of them must agree (one quoted number for several cells).
  """
  if isinstance(value, tuple):
    return all(agrees(quoted, v) for v in value)
  if isinstance(value, str):
    return quoted == value
  if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
    return "." not in quoted and "e" not in quoted and int(quoted) == int(value)
  mantissa, _, exponent = quoted.partition("e")
  decimals = len(mantissa.partition(".")[2])
  if exponent:  # 4e-4: one significant digit
    return float(f"{float(value):.{decimals}e}") == float(quoted)
  sign = "+" if quoted.startswith("+") else ""
  return f"{float(value):{sign}.{decimals}f}" == quoted


@functools.cache
def read(doc: str) -> str:
  """A doc's text; in a `.py` file a comment's `# ` continuing a line reads as a space."""
  with open(os.path.join(REPO, doc), encoding="utf-8") as f:
    text = f.read()
  return re.sub(r"\n[ \t]*# ?", "\n", text) if doc.endswith(".py") else text


def scope(doc_text: str, heading: str) -> str:
  """The part of a doc from the line starting with `heading` to the next heading of its level."""
  if not heading:
    return doc_text
  level = heading.split()[0] + " "
  lines = doc_text.split("\n")
  starts = [i for i, line in enumerate(lines) if line.startswith(heading)]
  if len(starts) != 1:
    return ""
  end = next(
    (i for i in range(starts[0] + 1, len(lines)) if lines[i].startswith(level)), len(lines)
  )
  return "\n".join(lines[starts[0] : end])


def mismatches(doc_text: str, c: Claim) -> list[str]:
  """What is wrong with one claim in `doc_text`: nothing when every quoted number agrees."""
  found = list(pattern(c.text).finditer(scope(doc_text, c.section)))
  if not found:
    where = f"{c.doc} ({c.section or 'anywhere'})"
    return [f"{where}: text not found (change the claim with the doc): {c.text!r}"]
  want = list(c.values())
  errors = []
  for m in found:
    quoted = m.groups()
    if len(quoted) != len(want):
      return [f"{c.doc}: {c.text!r} quotes {len(quoted)} values, the claim computes {len(want)}"]
    for i, (q, v) in enumerate(zip(quoted, want, strict=True)):
      if not agrees(q, v):
        errors.append(f"{c.doc}: {c.text!r}: value {i + 1} is {q}, {c.source} gives {v!r}")
  return errors


def _id(item: Claim | Fact) -> str:
  return f"{os.path.basename(item.doc)}:{item.text[:60]}"


# ------------------------------------------------------------------------------------------
# The claims.


class Claim(NamedTuple):
  doc: str  # path from the repository root
  section: str  # the heading of the doc's section the text is in ("" for the whole doc)
  text: str  # the quoted text: `{}` a number, `{m}` a mark
  source: str  # the committed file the numbers come from
  values: Callable[[], Sequence[Any]]  # the numbers (and marks) in the order quoted


class Fact(NamedTuple):
  doc: str
  section: str
  text: str  # quoted verbatim (spaces match any whitespace)
  source: str
  check: Callable[[], bool]


CLAIMS: list[Claim] = []
FACTS: list[Fact] = []
_SECTION: dict[str, str] = {}  # doc -> the heading the next claims of that doc are in


def section(doc: str, heading: str) -> None:
  """The claims of `doc` that follow are in the section under `heading` (a `## ` line)."""
  _SECTION[doc] = heading


def claim(doc: str, text: str, source: str, values: Callable[[], Sequence[Any]]) -> None:
  CLAIMS.append(Claim(doc, _SECTION.get(doc, ""), text, source, values))


def fact(doc: str, text: str, source: str, check: Callable[[], bool]) -> None:
  FACTS.append(Fact(doc, _SECTION.get(doc, ""), text, source, check))


NAMES = {
  "reinforce": "REINFORCE",
  "grpo": "GRPO",
  "rec_oneside_nois": "REC-OneSide-NoIS",
  "rec_oneside_nois_wide": "REC-OneSide-NoIS wide",
  "opmd": "OPMD",
  "asymre": "AsymRE",
  "red_drop": "RED-Drop",
  "red_weight": "RED-Weight",
  "rec_oneside_is": "REC-OneSide-IS",
  "rec_twoside_nois": "REC-TwoSide-NoIS",
  "rec_ring_nois": "REC-Ring-NoIS",
  "cispo": "CISPO",
  "m2po": "M2PO",
  "bapo": "BAPO",
  "topr": "TOPR",
  "decoupled_ppo": "decoupled PPO",
}

NAMES_DEFAULT = tuple(NAMES)[:8]  # the default grid's methods, in its order

LAG = "docs/results/lag_study.md"
MT = "docs/results/multiturn.md"
OP = "docs/results/off_policyness.md"
REF = "docs/lag_and_study.md"
CFG = "configs/lag_study.py"
SW = "docs/results/sweeps.md"

# --- docs/results/lag_study.md, "A warm start where learning shows": the small grid ---------

section(LAG, "## A warm start where learning shows")

DIS = "lag_study_distractor/study.csv"
_dis = lambda: S("lag_study_distractor")

for _m in ("grpo", "rec_oneside_nois"):
  claim(
    LAG,
    f"| {NAMES[_m]} | {{}} [{{}}, {{}}] | {{}} [{{}}, {{}}] | {{}} [{{}}, {{}}] |",
    DIS,
    lambda m=_m: [v for g in _dis().lags for v in ivs(_dis().iv(m, g))],
  )
claim(
  LAG,
  "| REINFORCE | {} [{}, {}] | {} [{}, {}] ({}/4 collapsed) | {} [{}, {}] ({}/4) |",
  DIS,
  lambda: (
    *ivs(_dis().iv("reinforce", "onpolicy")),
    *ivs(_dis().iv("reinforce", "interval20")),
    _dis().collapsed("reinforce", "interval20"),
    *ivs(_dis().iv("reinforce", "offline")),
    _dis().collapsed("reinforce", "offline"),
  ),
)
claim(
  LAG,
  "(the warm start {} vs 0.352)",
  DIS,
  lambda: [_dis().mean("grpo", "onpolicy", "start_accuracy")],
)
claim(
  LAG,
  "the per-seed spread of the warm start, {},",
  DIS,
  lambda: [np.std(_dis().x("grpo", "onpolicy", "start_accuracy"))],
)
claim(
  LAG,
  "per seed {} / {} / {} / {}: mean **{}, 95% t [{}, {}]**",
  DIS,
  lambda: (*_dis().gains("grpo", "onpolicy"), *ivs(_dis().gain("grpo", "onpolicy"))),
)
claim(
  LAG,
  "`study.stats.bootstrap`, gives [{}, {}]",
  DIS,
  lambda: ivs(study_stats.bootstrap(_dis().gains("grpo", "onpolicy")))[1:],
)
claim(
  LAG,
  "REINFORCE loses {} [{}, {}] under interval 20 and {} [{}, {}] offline, never reaches warm "
  "start + 0.10 offline ({}/4 runs) and needs {} steps under interval 20 ({}/4 runs reach it) "
  "against GRPO's {} there and {} on-policy; REC-OneSide-NoIS stays within {} to {} of GRPO "
  "on-policy and interval 20 ({} offline, GRPO itself {}).",
  DIS,
  lambda: (
    *ivs(_dis().diff("reinforce", "interval20")),
    *ivs(_dis().diff("reinforce", "offline")),
    _dis().reached("reinforce", "offline"),
    _dis().mean("reinforce", "interval20", "steps_to_threshold"),
    _dis().reached("reinforce", "interval20"),
    _dis().mean("grpo", "interval20", "steps_to_threshold"),
    _dis().mean("grpo", "onpolicy", "steps_to_threshold"),
    _dis().diff("rec_oneside_nois", "onpolicy").mean,
    _dis().diff("rec_oneside_nois", "interval20").mean,
    _dis().diff("rec_oneside_nois", "offline").mean,
    _dis().diff("grpo", "offline").mean,
  ),
)
claim(
  LAG,
  "No equivalence within 0.03 is shown at 4 seeds (smallest TOST p {}, REC-OneSide-NoIS at "
  "interval 20), and with 4 seeds no Holm-corrected verdict is attainable (smallest p {}),",
  DIS,
  lambda: (
    _dis().tests["rec_oneside_nois", "interval20"][0].p_equivalent,
    min(c.p for c, _, _ in _dis().tests.values()),
  ),
)
fact(
  LAG,
  "(smallest TOST p",
  DIS,
  lambda: (
    min(_dis().tests, key=lambda k: _dis().tests[k][0].p_equivalent)
    == ("rec_oneside_nois", "interval20")
    and {v for _, _, v in _dis().tests.values()} == {"~"}
  ),
)
claim(
  LAG,
  "The A/A pair differed by {} [{}, {}]: the permutation test gives p = {},",
  DIS,
  lambda: (
    *ivs(_dis().aa("final_accuracy")["onpolicy"][0].diff),
    _dis().aa("final_accuracy")["onpolicy"][0].p,
  ),
)

# --- docs/results/lag_study.md, the default grid ---------------------------------------------

section(LAG, "## The default grid")

DEF = "lag_study_default/study.csv"
FULL = "lag_study_full/study.csv"
FIRST = "lag_study_default/study_first_run.md"
_d = lambda: S("lag_study_default")
_f = lambda: S("lag_study_full")

claim(
  LAG,
  "the cell means of final accuracy moved by {} on average and at most {} (REINFORCE at offset 10;",
  f"{DEF}, {FIRST}",
  lambda: (np.mean(list(default_vs_first_run().values())), max(default_vs_first_run().values())),
)
fact(
  LAG,
  "(REINFORCE at offset 10;",
  f"{DEF}, {FIRST}",
  lambda: max(default_vs_first_run(), key=default_vs_first_run().get) == ("reinforce", "offset10"),
)
claim(
  LAG,
  "and {} of its Holm verdicts read `~` in the committed run",
  f"{DEF}, {FIRST}",
  lambda: [len(changed_marks())],
)
fact(
  LAG,
  "(GRPO at lag 32, the wide mask at offset 10, lag 32 and offline, OPMD at lag 32 and offline, "
  "AsymRE offline, RED-Weight on-policy); none changed the other way.",
  f"{DEF}, {FIRST}",
  lambda: (
    changed_marks()
    == {
      ("grpo", "stale32"),
      ("rec_oneside_nois_wide", "offset10"),
      ("rec_oneside_nois_wide", "stale32"),
      ("rec_oneside_nois_wide", "offline"),
      ("opmd", "stale32"),
      ("opmd", "offline"),
      ("asymre", "offline"),
      ("red_weight", "onpolicy"),
    }
    and all(_d().mark(*k) == "~" for k in changed_marks())
  ),
)
fact(
  LAG,
  "The `toy_full` grid ([below](#the-full-grid-all-16-methods-toy_full)) reproduces it exactly "
  "on these 8 methods,",
  f"{FULL}, {FIRST}",
  lambda: all(round(_f().mean(m, g), 3) == first_run_mean(m, g) for m in _d().main for g in LAGS5),
)
claim(
  LAG,
  "Warm start {} [{}, {}] greedy accuracy (mean over the 12 seeds, 95% t). On-policy GRPO ends "
  "at {} [{}, {}]: a gain of **{}, 95% t [{}, {}]** over its warm start (per seed {} to {}; mean "
  "curve {} / {} / {} / {} / {} at steps 0-200), clear of 0 (first run: {}).",
  DEF,
  lambda: (
    *ivs(_d().iv("grpo", "onpolicy", "start_accuracy")),
    *ivs(_d().iv("grpo", "onpolicy")),
    *ivs(_d().gain("grpo", "onpolicy")),
    _d().gains("grpo", "onpolicy").min(),
    _d().gains("grpo", "onpolicy").max(),
    *(_d().at("grpo", "onpolicy", step).mean() for step in (0, 50, 100, 150, 200)),
    _f().gain("grpo", "onpolicy").mean,
  ),
)
claim(
  LAG,
  "here seeds 0-3 gain {} on average and seeds 4-11 {}:",
  DEF,
  lambda: (_d().gains("grpo", "onpolicy")[:4].mean(), _d().gains("grpo", "onpolicy")[4:].mean()),
)
claim(
  LAG,
  "Holm over the {} comparisons, alpha 0.05; 12 seeds make p >= {}, Holm's first step needs {};",
  DEF,
  lambda: (len(_d().tests), study_stats.smallest_p(12), 0.05 / len(_d().tests)),
)
fact(
  LAG,
  "no cell is `≈`, shown within 0.03 by the equivalence test",
  DEF,
  lambda: all(v != "≈" for _, _, v in _d().tests.values()),
)
for _m in NAMES_DEFAULT:
  claim(
    LAG,
    f"| {NAMES[_m]} | " + " | ".join(["{} {m}"] * 5) + " |",
    DEF,
    lambda m=_m: [v for g in LAGS5 for v in (_d().mean(m, g), _d().mark(m, g))],
  )
fact(
  LAG,
  "On-policy REINFORCE and both REC-OneSide-NoIS masks are one update",
  DEF,
  lambda: (
    _d().same(("reinforce", "onpolicy"), ("rec_oneside_nois", "onpolicy"))
    and _d().same(("reinforce", "onpolicy"), ("rec_oneside_nois_wide", "onpolicy"))
  ),
)
claim(
  LAG,
  "| GRPO | {} | {} | {} | {} | {} ({}/12) | {} ({}/12) |",
  DEF,
  lambda: (
    *(_d().mean("grpo", g, "accuracy_auc") for g in LAGGED),
    _d().mean("grpo", "onpolicy", "steps_to_threshold"),
    _d().reached("grpo", "onpolicy"),
    _d().mean("grpo", "interval20", "steps_to_threshold"),
    _d().reached("grpo", "interval20"),
  ),
)


def _speed_row(m: str) -> list[Any]:
  auc = _d().same_lag("accuracy_auc")
  out: list[Any] = [v for g in LAGGED for v in (auc[m, g][0].diff.mean, auc[m, g][1])]
  for g in ("onpolicy", "interval20"):
    out += [_d().mean(m, g, "steps_to_threshold"), _d().reached(m, g)]
  return out


for _m in ("reinforce", "rec_oneside_nois", "rec_oneside_nois_wide", "opmd", "asymre", "red_drop"):
  claim(
    LAG,
    f"| {NAMES[_m]} | " + " | ".join(["{} {m}"] * 4) + " | {} ({}/12) | {} ({}/12) |",
    DEF,
    lambda m=_m: _speed_row(m),
  )
claim(
  LAG,
  "| RED-Weight | " + " | ".join(["{} {m}"] * 4) + " | **{} ({}/12)** | {} ({}/12) |",
  DEF,
  lambda: _speed_row("red_weight"),
)
claim(
  LAG,
  "no difference in steps is a Holm verdict, the smallest p being {})",
  DEF,
  lambda: [min(c.p for c, _ in _d().same_lag("steps_to_threshold").values())],
)
fact(
  LAG,
  "no difference in steps is a Holm verdict",
  DEF,
  lambda: {v for _, v in _d().same_lag("steps_to_threshold").values()} == {"~"},
)
claim(
  LAG,
  "REINFORCE {} / {} / {} / {} / {} of 12 from on-policy to offline, RED-Drop {} / {} / {} / {} "
  "/ {}; no run of the other six methods (first run: REINFORCE {} / {} / {} / {} / {}, RED-Drop "
  "{} / {} / {} / {} / {}).",
  f"{DEF}, {FULL}",
  lambda: [
    s.collapsed(m, g) for s in (_d(), _f()) for m in ("reinforce", "red_drop") for g in LAGS5
  ],
)
fact(
  LAG,
  "no run of the other six methods",
  DEF,
  lambda: all(
    _d().collapsed(m, g) == 0
    for m in _d().main
    if m not in ("reinforce", "red_drop")
    for g in LAGS5
  ),
)
claim(
  LAG,
  "Final accuracy, the headline test: **{}/{} = {} [{}, {}]** against the nominal 0.05 (the "
  "interval-20 pair, {} [{}, {}], p {}); accuracy AUC {}/{} = {} [{}, {}] (offset 10, {} [{}, "
  "{}], p {}); steps to the threshold {}/{} = {} [{}, {}]",
  DEF,
  lambda: (
    *_d().aa_rate("final_accuracy"),
    *ivs(_d().aa("final_accuracy")["interval20"][0].diff),
    _d().aa("final_accuracy")["interval20"][0].p,
    *_d().aa_rate("accuracy_auc"),
    *ivs(_d().aa("accuracy_auc")["offset10"][0].diff),
    _d().aa("accuracy_auc")["offset10"][0].p,
    *_d().aa_rate("steps_to_threshold"),
  ),
)
claim(
  LAG,
  "metric whose A/A rate exceeds alpha reports no findings: in the committed run, final "
  "accuracy and accuracy AUC ({}/{} each), so",
  DEF,
  lambda: (*_d().aa_rate("final_accuracy")[:2],),
)
fact(
  LAG,
  "marks of this section's two tables are marked `†` in its study.md",
  DEF,
  lambda: (
    report_aa.not_findings(_aa_tests(_d()), _d().alpha).keys() == {"final_accuracy", "accuracy_auc"}
    and _d().aa_rate("final_accuracy")[:2] == _d().aa_rate("accuracy_auc")[:2]
  ),
)
claim(
  LAG,
  "RED-Drop under lag lose {} to {}); they do not hold chance to alpha.",
  DEF,
  lambda: (
    -max(
      _d().mean(m, g) - _d().mean("grpo", "onpolicy")
      for m in ("reinforce", "red_drop")
      for g in LAGGED
    ),
    -min(
      _d().mean(m, g) - _d().mean("grpo", "onpolicy")
      for m in ("reinforce", "red_drop")
      for g in LAGGED
    ),
  ),
)
fact(
  LAG,
  "(the offset-10 pair, whose differences are all 0, left out)",
  DEF,
  lambda: (
    not np.any(_d().aa("steps_to_threshold")["offset10"][0].diff.mean)
    and _d().aa("final_accuracy")["interval20"][1] != "~"
    and _d().aa("accuracy_auc")["offset10"][1] != "~"
  ),
)
claim(
  LAG,
  "The first run (in `lag_study_full/study.csv`): final accuracy {}/{} = {} [{}, {}], steps "
  "{}/{}, but accuracy AUC {}/{} = {} [{}, {}] (lag 32 and offline, p {} and {}, the twin ahead "
  "both times),",
  FULL,
  lambda: (
    *_f().aa_rate("final_accuracy"),
    *_f().aa_rate("steps_to_threshold")[:2],
    *_f().aa_rate("accuracy_auc"),
    _f().aa("accuracy_auc")["stale32"][0].p,
    _f().aa("accuracy_auc")["offline"][0].p,
  ),
)
fact(
  LAG,
  "the twin ahead both times",
  FULL,
  lambda: (
    [g for g, (c, v) in _f().aa("accuracy_auc").items() if v != "~"] == ["stale32", "offline"]
    and all(_f().aa("accuracy_auc")[g][1] == "better" for g in ("stale32", "offline"))
  ),
)
claim(
  LAG,
  "({} of the {} AUC pairs of the two runs)",
  f"{DEF}, {FULL}",
  lambda: (
    _d().aa_rate("accuracy_auc")[0] + _f().aa_rate("accuracy_auc")[0],
    _d().aa_rate("accuracy_auc")[1] + _f().aa_rate("accuracy_auc")[1],
  ),
)

# The paper's claims.
_reinforce_lagged = lambda s: [-s.diff("reinforce", g).mean for g in LAGGED]
_collapsed_lagged = lambda s, m: [s.collapsed(m, g) for g in LAGGED]
claim(
  LAG,
  "On-policy it learns like GRPO ({}, `{m}`); under every lag it ends {}-{} below GRPO on-policy "
  "(Holm `worse` at all four) and collapses in {}-{} of 12 runs (first run: {}-{} below, {}-{} "
  "collapsed).",
  f"{DEF}, {FULL}",
  lambda: (
    _d().diff("reinforce", "onpolicy").mean,
    _d().mark("reinforce", "onpolicy"),
    min(_reinforce_lagged(_d())),
    max(_reinforce_lagged(_d())),
    min(_collapsed_lagged(_d(), "reinforce")),
    max(_collapsed_lagged(_d(), "reinforce")),
    min(_reinforce_lagged(_f())),
    max(_reinforce_lagged(_f())),
    min(_collapsed_lagged(_f(), "reinforce")),
    max(_collapsed_lagged(_f(), "reinforce")),
  ),
)
fact(
  LAG,
  "(Holm `worse` at all four)",
  DEF,
  lambda: all(_d().mark("reinforce", g) == "worse" for g in LAGGED),
)
claim(
  LAG,
  "collapses the same way ({}-{} of 12 runs under lag) and is `{m}` on-policy too ({} [{}, {}])",
  DEF,
  lambda: (
    min(_collapsed_lagged(_d(), "red_drop")),
    max(_collapsed_lagged(_d(), "red_drop")),
    _d().mark("red_drop", "onpolicy"),
    *ivs(_d().diff("red_drop", "onpolicy")),
  ),
)
LR = "lag_study_lr/study.csv"
_lr = lambda: S("lag_study_lr")
RATES = ("1e-4", "3e-4", "1e-3")
claim(
  LAG,
  "Offline REINFORCE collapses at every learning rate tried (1e-4, 3e-4, 1e-3: {}, {} and {} of "
  "12 runs),",
  LR,
  lambda: [_lr().collapsed(f"reinforce_lr{r}", "offline") for r in RATES],
)
fact(
  LAG,
  "where the masked REC-OneSide-NoIS never does.",
  LR,
  lambda: all(_lr().collapsed(f"narrow_lr{r}", "offline") == 0 for r in RATES),
)
SP = "lag_study_spell/study.csv"
_sp = lambda: S("lag_study_spell")
claim(
  LAG,
  "method `{m}` at interval 20 ({} against {}), and offline it gains least ({} over its warm "
  "start, {} of 12 runs collapsed).",
  SP,
  lambda: (
    _sp().mark("reinforce", "interval20"),
    _sp().mean("reinforce", "interval20"),
    _sp().mean("grpo", "onpolicy"),
    _sp().gain("reinforce", "offline").mean,
    _sp().collapsed("reinforce", "offline"),
  ),
)
fact(
  LAG,
  "it is the only method `worse` at interval 20",
  SP,
  lambda: (
    [m for m in _sp().main if _sp().mark(m, "interval20") == "worse"] == ["reinforce"]
    and min(_sp().main, key=lambda m: _sp().gain(m, "offline").mean) == "reinforce"
  ),
)
claim(
  LAG,
  "Against GRPO on-policy it is {} at interval 20, {} at offset 10, {} at lag 32 and {} offline, "
  "all `~`: no difference is shown, and no lagged cell passes the equivalence test within 0.03 "
  "either (TOST p {} to {}).",
  DEF,
  lambda: (
    *(_d().diff("rec_oneside_nois", g).mean for g in LAGGED),
    min(_d().tests["rec_oneside_nois", g][0].p_equivalent for g in LAGGED),
    max(_d().tests["rec_oneside_nois", g][0].p_equivalent for g in LAGGED),
  ),
)
fact(
  LAG,
  "all `~`: no difference is shown",
  DEF,
  lambda: all(_d().mark("rec_oneside_nois", g) == "~" for g in LAGGED),
)
claim(
  LAG,
  "final accuracy {} [{}, {}] at lag 32 (Holm `{m}` in the same-lag table) and {} [{}, {}] "
  "offline (p {}, `{m}`); accuracy AUC `≈` GRPO's at interval 20, offset 10 and lag 32, `{m}` "
  "offline ({} [{}, {}]).",
  DEF,
  lambda: (
    *ivs(_d().same_lag("final_accuracy")["rec_oneside_nois", "stale32"][0].diff),
    _d().same_lag("final_accuracy")["rec_oneside_nois", "stale32"][1],
    *ivs(_d().same_lag("final_accuracy")["rec_oneside_nois", "offline"][0].diff),
    _d().same_lag("final_accuracy")["rec_oneside_nois", "offline"][0].p,
    _d().same_lag("final_accuracy")["rec_oneside_nois", "offline"][1],
    _d().same_lag("accuracy_auc")["rec_oneside_nois", "offline"][1],
    *ivs(_d().same_lag("accuracy_auc")["rec_oneside_nois", "offline"][0].diff),
  ),
)
fact(
  LAG,
  "accuracy AUC `≈` GRPO's at interval 20, offset 10 and lag 32",
  DEF,
  lambda: all(_d().same_lag("accuracy_auc")["rec_oneside_nois", g][1] == "≈" for g in LAGGED[:3]),
)
claim(
  LAG,
  "(First run: {} and {} against GRPO on-policy at interval 20 and offset 10; {} and {} against "
  "GRPO at lag 32 and offline, p {} and {}.)",
  FULL,
  lambda: (
    _f().diff("rec_oneside_nois", "interval20").mean,
    _f().diff("rec_oneside_nois", "offset10").mean,
    _f().compare("rec_oneside_nois", "stale32", ("grpo", "stale32")).diff.mean,
    _f().compare("rec_oneside_nois", "offline", ("grpo", "offline")).diff.mean,
    _f().compare("rec_oneside_nois", "stale32", ("grpo", "stale32")).p,
    _f().compare("rec_oneside_nois", "offline", ("grpo", "offline")).p,
  ),
)
claim(
  LAG,
  "On spell_backward it is `{m}` on-policy GRPO at interval 20 ({} against {}, {} [{}, {}], TOST "
  "p {}: shown within the 0.03 margin) and, like every method, `{m}` offline ({}).",
  SP,
  lambda: (
    _sp().mark("rec_oneside_nois", "interval20"),
    _sp().mean("rec_oneside_nois", "interval20"),
    _sp().mean("grpo", "onpolicy"),
    *ivs(_sp().diff("rec_oneside_nois", "interval20")),
    _sp().tests["rec_oneside_nois", "interval20"][0].p_equivalent,
    _sp().mark("rec_oneside_nois", "offline"),
    _sp().mean("rec_oneside_nois", "offline"),
  ),
)
_wide_steps = lambda: [
  _d().same_lag("steps_to_threshold")["rec_oneside_nois_wide", g][0].diff.mean for g in LAGGED
]
_clip_ratio = lambda: [
  _d().mean("rec_oneside_nois", g, "clip_frac") / _d().mean("rec_oneside_nois_wide", g, "clip_frac")
  for g in LAGGED
]
claim(
  LAG,
  "learns more slowly than GRPO at the same lag at interval 20 and offset 10 (accuracy AUC {} and "
  "{}, Holm `{m}`) and as fast at lag 32 and offline ({} and {}, `{m}`), needs {}-{} more steps "
  "to the threshold (no Holm verdict) and clips {}-{} times fewer tokens than the narrow mask "
  "(`clip_frac`, offline to offset 10); it does not collapse ({}/60 runs), and offline it ends "
  "level with the narrow mask ({} against {}).",
  DEF,
  lambda: (
    _d().same_lag("accuracy_auc")["rec_oneside_nois_wide", "interval20"][0].diff.mean,
    _d().same_lag("accuracy_auc")["rec_oneside_nois_wide", "offset10"][0].diff.mean,
    _d().same_lag("accuracy_auc")["rec_oneside_nois_wide", "offset10"][1],
    _d().same_lag("accuracy_auc")["rec_oneside_nois_wide", "stale32"][0].diff.mean,
    _d().same_lag("accuracy_auc")["rec_oneside_nois_wide", "offline"][0].diff.mean,
    _d().same_lag("accuracy_auc")["rec_oneside_nois_wide", "offline"][1],
    min(_wide_steps()),
    max(_wide_steps()),
    min(_clip_ratio()),
    max(_clip_ratio()),
    sum(_d().collapsed("rec_oneside_nois_wide", g) for g in LAGS5),
    _d().mean("rec_oneside_nois_wide", "offline"),
    _d().mean("rec_oneside_nois", "offline"),
  ),
)
fact(
  LAG,
  "(`clip_frac`, offline to offset 10)",
  DEF,
  lambda: (
    np.argmin(_clip_ratio()) == 3
    and np.argmax(_clip_ratio()) == 1
    and _d().same_lag("accuracy_auc")["rec_oneside_nois_wide", "interval20"][1] == "worse"
    and _d().same_lag("accuracy_auc")["rec_oneside_nois_wide", "stale32"][1] == "~"
  ),
)


def _wide_minus_narrow(metric: str) -> list[study_stats.Interval]:
  return [
    _lr().compare(f"wide_lr{r}", "offline", (f"narrow_lr{r}", "offline"), metric).diff
    for r in RATES
  ]


claim(
  LAG,
  "(wide minus narrow offline: final accuracy within +-{}, AUC {} to {};",
  LR,
  lambda: (
    max(abs(iv.mean) for iv in _wide_minus_narrow("final_accuracy")),
    max(iv.mean for iv in _wide_minus_narrow("accuracy_auc")),
    min(iv.mean for iv in _wide_minus_narrow("accuracy_auc")),
  ),
)
claim(
  LAG,
  "GRPO does ({} and {}, `{m}`) and never collapse, and no cell of theirs is `worse` than GRPO "
  "on-policy (first run: OPMD at lag 32 and offline, AsymRE offline);",
  DEF,
  lambda: (
    _d().diff("opmd", "onpolicy").mean,
    _d().diff("asymre", "onpolicy").mean,
    _d().mark("asymre", "onpolicy"),
  ),
)
fact(
  LAG,
  "no cell of theirs is `worse` than GRPO on-policy (first run: OPMD at lag 32 and offline, "
  "AsymRE offline);",
  f"{DEF}, {FIRST}",
  lambda: (
    all(_d().mark(m, g) != "worse" for m in ("opmd", "asymre") for g in LAGS5)
    and [(m, g) for m in ("opmd", "asymre") for g in LAGS5 if first_run_mark(m, g) == "worse"]
    == [("opmd", "stale32"), ("opmd", "offline"), ("asymre", "offline")]
    and all(_d().collapsed(m, g) == 0 for m in ("opmd", "asymre") for g in LAGS5)
  ),
)
_auc = lambda m, g: _d().same_lag("accuracy_auc")[m, g]
_fin = lambda m, g: _d().same_lag("final_accuracy")[m, g]
claim(
  LAG,
  "(accuracy AUC {} and {} for OPMD, {} and {} for AsymRE, Holm `{m}`) and end lower (final "
  "accuracy: OPMD {} at interval 20, Holm `{m}`; AsymRE {} at offset 10 and {} offline, p {} and "
  "{}, `{m}`).",
  DEF,
  lambda: (
    _auc("opmd", "interval20")[0].diff.mean,
    _auc("opmd", "offset10")[0].diff.mean,
    _auc("asymre", "interval20")[0].diff.mean,
    _auc("asymre", "offset10")[0].diff.mean,
    _auc("asymre", "offset10")[1],
    _fin("opmd", "interval20")[0].diff.mean,
    _fin("opmd", "interval20")[1],
    _fin("asymre", "offset10")[0].diff.mean,
    _fin("asymre", "offline")[0].diff.mean,
    _fin("asymre", "offset10")[0].p,
    _fin("asymre", "offline")[0].p,
    _fin("asymre", "offline")[1],
  ),
)
claim(
  LAG,
  "RED-Weight learns fastest on-policy: {}/12 runs reach the threshold, in {} steps against "
  "GRPO's {} ({}/12), and its accuracy AUC is {} [{}, {}] above GRPO's (Holm `{m}` in the "
  "same-lag table). Its final accuracy on-policy, {} [{}, {}] (p {}, Holm p {}), is `{m}`: the "
  "first run's `better` there (p {}) does not hold.",
  f"{DEF}, {FULL}",
  lambda: (
    _d().reached("red_weight", "onpolicy"),
    _d().mean("red_weight", "onpolicy", "steps_to_threshold"),
    _d().mean("grpo", "onpolicy", "steps_to_threshold"),
    _d().reached("grpo", "onpolicy"),
    *ivs(_auc("red_weight", "onpolicy")[0].diff),
    _auc("red_weight", "onpolicy")[1],
    *ivs(_d().diff("red_weight", "onpolicy")),
    _d().tests["red_weight", "onpolicy"][0].p,
    _d().tests["red_weight", "onpolicy"][1],
    _d().mark("red_weight", "onpolicy"),
    _f().tests["red_weight", "onpolicy"][0].p,
  ),
)
fact(
  LAG,
  "RED-Weight learns fastest on-policy:",
  DEF,
  lambda: (
    max(_d().main, key=lambda m: _d().mean(m, "onpolicy", "accuracy_auc")) == "red_weight"
    and min(_d().main, key=lambda m: _d().mean(m, "onpolicy", "steps_to_threshold")) == "red_weight"
    and first_run_mark("red_weight", "onpolicy") == "better"
  ),
)
claim(
  LAG,
  "({} [{}, {}] there, p {}, `{m}`; the first run's `better` at lag 32, {} [{}, {}], p {}, does "
  "not hold either) and `{m}` than GRPO on-policy offline ({}; {} [{}, {}] against GRPO offline, "
  "`{m}`).",
  f"{DEF}, {FULL}",
  lambda: (
    *ivs(_fin("red_weight", "stale32")[0].diff),
    _fin("red_weight", "stale32")[0].p,
    _fin("red_weight", "stale32")[1],
    *ivs(_f().same_lag("final_accuracy")["red_weight", "stale32"][0].diff),
    _f().same_lag("final_accuracy")["red_weight", "stale32"][0].p,
    _d().mark("red_weight", "offline"),
    _d().diff("red_weight", "offline").mean,
    *ivs(_fin("red_weight", "offline")[0].diff),
    _fin("red_weight", "offline")[1],
  ),
)
DEEP = "lag_study_deep/study.csv"
_dp = lambda: S("lag_study_deep")
claim(
  LAG,
  "**not reproduced** for M2PO ({}/12 runs collapse at sync interval 256, 600 steps); GRPO and "
  "REC-OneSide-NoIS keep learning there but are `{m}` than on-policy GRPO by {}-{}, outside the "
  "0.03 margin",
  DEEP,
  lambda: (
    _dp().collapsed("m2po", "interval256"),
    _dp().mark("grpo", "interval256"),
    -_dp().diff("rec_oneside_nois", "interval256").mean,
    -_dp().diff("grpo", "interval256").mean,
  ),
)

# --- docs/results/lag_study.md, the staleness axis (`deep`) ----------------------------------

section(LAG, "## The staleness axis")

claim(
  LAG,
  "Warm start {} [{}, {}]. On-policy GRPO ends at {} [{}, {}] ({} over its warm start in 600 "
  "steps).",
  DEEP,
  lambda: (
    *ivs(_dp().iv("grpo", "onpolicy", "start_accuracy")),
    *ivs(_dp().iv("grpo", "onpolicy")),
    _dp().gain("grpo", "onpolicy").mean,
  ),
)
for _m in ("grpo", "rec_oneside_nois", "m2po", "reinforce"):
  claim(
    LAG,
    f"| {NAMES[_m]} | {{}} {{m}} | {{}} {{m}} | {{}} [{{}}, {{}}] | {{}}/12 |",
    DEEP,
    lambda m=_m: (
      _dp().mean(m, "onpolicy"),
      _dp().mark(m, "onpolicy"),
      _dp().mean(m, "interval256"),
      _dp().mark(m, "interval256"),
      *ivs(_dp().diff(m, "interval256")),
      _dp().collapsed(m, "interval256"),
    ),
  )
claim(
  LAG,
  "Every difference is a Holm-corrected `{m}` (TOST p {}-{}).",
  DEEP,
  lambda: (
    _dp().mark("grpo", "interval256"),
    min(_dp().tests[m, "interval256"][0].p_equivalent for m in _dp().main),
    max(_dp().tests[m, "interval256"][0].p_equivalent for m in _dp().main),
  ),
)
claim(
  LAG,
  "learning with 256-update-old data ({} -> {}-{}, no run collapsed; they lose {}-{} against "
  "on-policy), while REINFORCE and M2PO collapse ({}/12 and {}/12 runs end more than 0.05 below "
  "their warm start; the staleness KL k3 of their batches is {} and {} against {}-{} for GRPO "
  "and REC).",
  DEEP,
  lambda: (
    _dp().mean("grpo", "onpolicy", "start_accuracy"),
    _dp().mean("grpo", "interval256"),
    _dp().mean("rec_oneside_nois", "interval256"),
    -_dp().diff("rec_oneside_nois", "interval256").mean,
    -_dp().diff("grpo", "interval256").mean,
    _dp().collapsed("reinforce", "interval256"),
    _dp().collapsed("m2po", "interval256"),
    _dp().mean("reinforce", "interval256", "staleness_kl_k3"),
    _dp().mean("m2po", "interval256", "staleness_kl_k3"),
    _dp().mean("grpo", "interval256", "staleness_kl_k3"),
    _dp().mean("rec_oneside_nois", "interval256", "staleness_kl_k3"),
  ),
)
claim(
  LAG,
  "REC-OneSide-NoIS learns a little faster (accuracy AUC {} [{}, {}], Holm `{m}`) and ends level "
  "({} [{}, {}], `{m}`). On-policy, M2PO is the only method shown equivalent to GRPO ({} [{}, "
  "{}], TOST p {});",
  DEEP,
  lambda: (
    *ivs(_dp().same_lag("accuracy_auc")["rec_oneside_nois", "interval256"][0].diff),
    _dp().same_lag("accuracy_auc")["rec_oneside_nois", "interval256"][1],
    *ivs(_dp().same_lag("final_accuracy")["rec_oneside_nois", "interval256"][0].diff),
    _dp().same_lag("final_accuracy")["rec_oneside_nois", "interval256"][1],
    *ivs(_dp().diff("m2po", "onpolicy")),
    _dp().tests["m2po", "onpolicy"][0].p_equivalent,
  ),
)
claim(
  LAG,
  "(equal columns, {} [{}, {}], `{m}`:",
  DEEP,
  lambda: (*ivs(_dp().diff("reinforce", "onpolicy")), _dp().mark("reinforce", "onpolicy")),
)
fact(
  LAG,
  "M2PO is the only method shown equivalent to GRPO",
  DEEP,
  lambda: (
    [k for k, v in _dp().tests.items() if v[2] == "≈"] == [("m2po", "onpolicy")]
    and _dp().same(("reinforce", "onpolicy"), ("rec_oneside_nois", "onpolicy"))
  ),
)

# --- docs/results/lag_study.md, the learning-rate grid (`lr`) ---------------------------------

section(LAG, "## Learning-rate sensitivity")

claim(
  LAG,
  "the distractor warm start of the default grid (warm start {} [{}, {}]).",
  LR,
  lambda: ivs(_lr().iv(*_lr().baseline, "start_accuracy")),
)
for _r in RATES:
  claim(
    LAG,
    f"| {_r} | " + " | ".join(["{} [{}, {}], {}/12"] * 4) + " |",
    LR,
    lambda r=_r: [
      v
      for m, g in (
        (f"narrow_lr{r}", "onpolicy"),
        (f"reinforce_lr{r}", "offline"),
        (f"narrow_lr{r}", "offline"),
        (f"wide_lr{r}", "offline"),
      )
      for v in (*ivs(_lr().iv(m, g)), _lr().collapsed(m, g))
    ],
  )
fact(
  LAG,
  "so their on-policy columns are equal",
  LR,
  lambda: all(
    _lr().same((f"narrow_lr{r}", "onpolicy"), (f"{m}_lr{r}", "onpolicy"))
    for r in RATES
    for m in ("reinforce", "wide")
  ),
)
fact(
  LAG,
  "(and the report marks REINFORCE and the wide mask on-policy at 3e-4, against the narrow "
  "mask there, `=`: a difference of exactly 0 on every seed,",
  LR,
  lambda: all(
    _lr().mark(m, "onpolicy") == "=" and not np.any(_lr().tests[m, "onpolicy"][0].diff.high)
    for m in ("reinforce_lr3e-4", "wide_lr3e-4")
  ),
)
claim(
  LAG,
  "REINFORCE collapses at every rate ({}-{} of 12 runs),",
  LR,
  lambda: (
    min(_lr().collapsed(f"reinforce_lr{r}", "offline") for r in RATES),
    max(_lr().collapsed(f"reinforce_lr{r}", "offline") for r in RATES),
  ),
)
claim(
  LAG,
  "its staleness KL k3 grows with the rate ({} / {} / {}, against {} / {} / {} for the narrow "
  "mask and {} / {} / {} for the wide one, offline at 1e-4 / 3e-4 / 1e-3). Every offline "
  "REINFORCE cell is a Holm `{m}` against the baseline (differences {} to {}).",
  LR,
  lambda: (
    *(
      _lr().mean(f"{m}_lr{r}", "offline", "staleness_kl_k3")
      for m in ("reinforce", "narrow", "wide")
      for r in RATES
    ),
    _lr().mark("reinforce_lr1e-4", "offline"),
    max(_lr().diff(f"reinforce_lr{r}", "offline").mean for r in RATES),
    min(_lr().diff(f"reinforce_lr{r}", "offline").mean for r in RATES),
  ),
)
fact(
  LAG,
  "Every offline REINFORCE cell is a Holm `worse`",
  LR,
  lambda: all(_lr().mark(f"reinforce_lr{r}", "offline") == "worse" for r in RATES),
)
claim(
  LAG,
  "at 1e-3 they do better offline than on-policy ({} / {} against {}, where {}/12 on-policy runs "
  "collapse)",
  LR,
  lambda: (
    _lr().mean("narrow_lr1e-3", "offline"),
    _lr().mean("wide_lr1e-3", "offline"),
    _lr().mean("narrow_lr1e-3", "onpolicy"),
    _lr().collapsed("narrow_lr1e-3", "onpolicy"),
  ),
)
claim(
  LAG,
  "final accuracy {} [{}, {}] at 1e-4, {} [{}, {}] at 3e-4, {} [{}, {}] at 1e-3; accuracy AUC {} "
  "[{}, {}], {} [{}, {}], {} [{}, {}]",
  LR,
  lambda: [
    v
    for metric in ("final_accuracy", "accuracy_auc")
    for iv in _wide_minus_narrow(metric)
    for v in ivs(iv)
  ],
)
fact(
  LAG,
  "(nor in the default grid, where no test calls the wide mask `better` than GRPO at any lag or "
  "metric).",
  DEF,
  lambda: (
    all(_d().mark("rec_oneside_nois_wide", g) != "better" for g in LAGS5)
    and all(
      v not in ("better", "faster")
      for metric in ("final_accuracy", "accuracy_auc", "steps_to_threshold")
      for (m, _), (_, v) in _d().same_lag(metric).items()
      if m == "rec_oneside_nois_wide"
    )
  ),
)

# --- docs/results/lag_study.md, the full grid (`toy_full`) ------------------------------------

section(LAG, "## The full grid")

claim(
  LAG,
  "differs from this run run by run (up to {} in one run's final accuracy; {} on average in the "
  "cell means against the first run).",
  f"{DEF}, {FULL}, {FIRST}",
  lambda: (
    max(np.abs(_d().x(m, g) - _f().x(m, g)).max() for m in _d().main for g in LAGS5),
    np.mean(list(default_vs_first_run().values())),
  ),
)
fact(
  LAG,
  "Every one of the 80 cells' mean final accuracies equals the first (report-only) run's to the "
  "three decimals printed,",
  f"{FULL}, {FIRST}",
  lambda: all(round(_f().mean(m, g), 3) == first_run_mean(m, g) for m in _d().main for g in LAGS5),
)
claim(LAG, "Holm is now over {} comparisons,", FULL, lambda: [len(_f().tests)])
fact(
  LAG,
  "(RED-Drop on-policy, REC-OneSide-NoIS wide offline and OPMD offline).",
  f"{FULL}, {FIRST}",
  lambda: (
    {
      (m, g)
      for m in _d().main
      for g in LAGS5
      if first_run_mark(m, g) in ("worse", "better") and first_run_mark(m, g) != _f().mark(m, g)
    }
    == {("red_drop", "onpolicy"), ("rec_oneside_nois_wide", "offline"), ("opmd", "offline")}
    and all(
      _f().mark(m, g) != "worse" for m in _d().main for g in LAGS5 if first_run_mark(m, g) == "~"
    )
  ),
)
claim(
  LAG,
  "difference to GRPO, {} [{}, {}], is not 0:",
  FULL,
  lambda: ivs(_f().diff("rec_oneside_is", "onpolicy")),
)
fact(
  LAG,
  "Equivalence within 0.03 of GRPO on-policy is shown only on-policy, for AsymRE, "
  "REC-OneSide-IS, CISPO and decoupled PPO (the last three give the same runs on-policy,",
  FULL,
  lambda: (
    {k for k, v in _f().tests.items() if v[2] == "≈"}
    == {(m, "onpolicy") for m in ("asymre", "rec_oneside_is", "cispo", "decoupled_ppo")}
    and _f().same(("rec_oneside_is", "onpolicy"), ("cispo", "onpolicy"))
    and _f().same(("rec_oneside_is", "onpolicy"), ("decoupled_ppo", "onpolicy"))
  ),
)
for _m in ("rec_oneside_is", "rec_twoside_nois", "rec_ring_nois", "cispo", "m2po", "bapo"):
  claim(
    LAG,
    f"| {NAMES[_m]} | " + " | ".join(["{} {m}"] * 5) + " | {} |",
    FULL,
    lambda m=_m: [
      *(v for g in LAGS5 for v in (_f().mean(m, g), _f().mark(m, g))),
      sum(_f().collapsed(m, g) for g in LAGGED),
    ],
  )
for _m in ("topr", "decoupled_ppo"):
  claim(
    LAG,
    f"| {NAMES[_m]} | " + " | ".join(["{} {m}"] * 5) + " | {} |",
    FULL,
    lambda m=_m: [
      *(v for g in LAGS5 for v in (_f().mean(m, g), _f().mark(m, g))),
      sum(_f().collapsed(m, g) for g in LAGGED),
    ],
  )
claim(
  LAG,
  "TOPR the closest to GRPO on-policy ({} to {} up to lag 32).",
  FULL,
  lambda: (
    max(_f().diff("topr", g).mean for g in LAGGED[:3]),
    min(_f().diff("topr", g).mean for g in LAGGED[:3]),
  ),
)

# --- docs/results/lag_study.md, the code task --------------------------------------------------

section(LAG, "## A real task")

CODE = "lag_study_code/study.csv"
_c = lambda: S("lag_study_code")
claim(
  LAG,
  "the idle machine (336 s; below). Warm start {} [{}, {}].",
  CODE,
  lambda: ivs(_c().iv("grpo", "onpolicy", "start_accuracy")),
)
for _m in ("grpo", "rec_oneside_nois", "reinforce"):
  claim(
    LAG,
    f"| {NAMES[_m]} | {{}} [{{}}, {{}}] | {{}} [{{}}, {{}}] | {{}} [{{}}, {{}}] |",
    CODE,
    lambda m=_m: [v for g in _c().lags for v in ivs(_c().iv(m, g))],
  )
claim(
  LAG,
  "(seed 2: 0.297 and 0.184 against {} in the seven other cells),",
  CODE,
  lambda: [_c().x("grpo", "onpolicy", "start_accuracy")[2]],
)
fact(
  LAG,
  "both disturbed cells gave the first run's numbers exactly.",
  CODE,
  lambda: len({tuple(_c().x(m, g, "start_accuracy")) for m in _c().main for g in _c().lags}) == 1,
)
claim(
  LAG, "GRPO on-policy ended at 0.163 instead of {}.", CODE, lambda: [_c().mean("grpo", "onpolicy")]
)
claim(
  LAG,
  "REINFORCE {}/5, {}/5, {}/5; GRPO {}/5, {}/5, {}/5; REC-OneSide-NoIS {}/5, {}/5, {}/5.",
  CODE,
  lambda: [
    _c().collapsed(m, g) for m in ("reinforce", "grpo", "rec_oneside_nois") for g in _c().lags
  ],
)
claim(
  LAG,
  "(mean training reward {} under interval 20 against {}-{} in the other cells)",
  CODE,
  lambda: (
    _c().mean("reinforce", "interval20", "auc"),
    min(
      _c().mean(m, g, "auc")
      for m in _c().main
      for g in _c().lags
      if (m, g) != ("reinforce", "interval20")
    ),
    max(_c().mean(m, g, "auc") for m in _c().main for g in _c().lags),
  ),
)
claim(
  LAG,
  "with 5 seeds no Holm-corrected verdict is attainable (smallest p {}),",
  CODE,
  lambda: [min(c.p for c, _, _ in _c().tests.values())],
)
fact(
  LAG,
  "so the report marks every difference `~`",
  CODE,
  lambda: (
    {v for _, _, v in _c().tests.values()} == {"~"}
    and _c().same(("rec_oneside_nois", "onpolicy"), ("reinforce", "onpolicy"))
  ),
)

# --- docs/results/lag_study.md, spell_backward --------------------------------------------------

section(LAG, "## A second task")

claim(
  LAG,
  "beside the test suite on the same 2 cores). Warm start {} [{}, {}];",
  SP,
  lambda: ivs(_sp().iv("grpo", "onpolicy", "start_accuracy")),
)
for _m in ("grpo", "rec_oneside_nois", "reinforce"):
  claim(
    LAG,
    f"| {NAMES[_m]} | " + " | ".join(["{} [{}, {}] {m}"] * 3) + " |",
    SP,
    lambda m=_m: [v for g in _sp().lags for v in (*ivs(_sp().iv(m, g)), _sp().mark(m, g))],
  )
claim(
  LAG,
  "on-policy GRPO **{} [{}, {}]**; GRPO at interval 20 {}, offline {}; REC-OneSide-NoIS {} at "
  "interval 20, {} offline; REINFORCE {} at interval 20, {} [{}, {}] offline, with {} of 12 runs "
  "collapsed",
  SP,
  lambda: (
    *ivs(_sp().gain("grpo", "onpolicy")),
    _sp().gain("grpo", "interval20").mean,
    _sp().gain("grpo", "offline").mean,
    _sp().gain("rec_oneside_nois", "interval20").mean,
    _sp().gain("rec_oneside_nois", "offline").mean,
    _sp().gain("reinforce", "interval20").mean,
    *ivs(_sp().gain("reinforce", "offline")),
    _sp().collapsed("reinforce", "offline"),
  ),
)
claim(
  LAG,
  "another update with the same mean to three decimals (per-seed difference {} [{}, {}]):",
  SP,
  lambda: ivs(_sp().diff("rec_oneside_nois", "onpolicy")),
)
fact(
  LAG,
  "On-policy REC-OneSide-NoIS and REINFORCE are one update (ratio 1, the mask never binds): the "
  "same runs.",
  SP,
  lambda: (
    _sp().same(("rec_oneside_nois", "onpolicy"), ("reinforce", "onpolicy"))
    and not _sp().same(("rec_oneside_nois", "onpolicy"), ("grpo", "onpolicy"))
    and _sp().mark("reinforce", "onpolicy") == "≈"
  ),
)
fact(
  LAG,
  "which the toy grid shows at no lag;",
  DEF,
  lambda: all(_d().mark(m, g) != "≈" for m in _d().main for g in LAGGED),
)

# --- docs/results/lag_study.md: A/A rates of runs without a CSV (the intervals only) -------------

section(LAG, "## A miniature run")
claim(
  LAG,
  "false-verdict rate of final accuracy {}/{} = {} [{}, {}] against the nominal 0.05, and of the "
  "accuracy AUC {}/{} = {} [{}, {}]",
  "study.stats.clopper_pearson",
  lambda: 2 * (0, 2, 0.0, *study_stats.clopper_pearson(0, 2)),
)
section(LAG, "## The A/A cells at 12 seeds")
claim(
  LAG,
  "final accuracy {}/{} = {} [{}, {}] and accuracy AUC {}/{} = {} [{}, {}] (the 5 "
  "steps-to-threshold pairs left out",
  "study.stats.clopper_pearson",
  lambda: 2 * (0, 5, 0.0, *study_stats.clopper_pearson(0, 5)),
)

# --- docs/lag_and_study.md ---------------------------------------------------------------------

fact(
  REF,
  "the grid makes m comparisons of the final accuracy at once (39 in the default grid, 79 in "
  "`toy_full`);",
  f"{DEF}, {FULL}",
  lambda: (len(_d().tests), len(_f().tests)) == (39, 79),
)
claim(
  REF,
  "79 comparisons need {} seeds",
  "study.stats.needed_seeds",
  lambda: [study_stats.needed_seeds(len(_f().tests), 0.05)],
)
claim(
  REF,
  "(the committed default grid's final accuracy: {} of {}, [{}, {}]; 0 of 5 would be [{}, {}])",
  DEF,
  lambda: (
    *_d().aa_rate("final_accuracy")[:2],
    *_d().aa_rate("final_accuracy")[3:],
    *study_stats.clopper_pearson(0, 5),
  ),
)
fact(
  REF,
  "(on-policy, where the ratio is 1, REINFORCE and the REC masks are; e.g. the `lr` and "
  "`calculator` grids under `experiments/results/`).",
  "lag_study_lr/study.csv, lag_study_calculator/study.csv",
  lambda: (
    not np.any(_lr().tests["reinforce_lr3e-4", "onpolicy"][0].diff.high)
    and S("lag_study_calculator").mark("reinforce", "onpolicy") == "="
    and not np.any(S("lag_study_calculator").diff("reinforce", "onpolicy").high)
  ),
)

# --- configs/lag_study.py ---------------------------------------------------------------------

claim(
  CFG,
  "for on-policy GRPO to gain {} greedy accuracy over 12 seeds, 95% t interval [{}, {}]",
  DEF,
  lambda: ivs(_d().gain("grpo", "onpolicy")),
)
claim(
  CFG,
  "Greedy accuracy starts near {} and on-policy GRPO ends near {} (12 seeds: a gain of {}, 95% t "
  "interval [{}, {}]; 4 seeds: {};",
  f"{DEF}, {DIS}",
  lambda: (
    _d().mean("grpo", "onpolicy", "start_accuracy"),
    _d().mean("grpo", "onpolicy"),
    *ivs(_d().gain("grpo", "onpolicy")),
    _dis().gain("grpo", "onpolicy").mean,
  ),
)

# --- docs/results/multiturn.md: the calculator grid --------------------------------------------

section(MT, "## Tool use in the lag study")

CALC = "lag_study_calculator/study.csv"
_k = lambda: S("lag_study_calculator")
claim(
  MT,
  "seeds 0 / 1 / 2 (warm starts {} / {} / {}; `study.md`'s final accuracy is each run's mean of "
  "its last two evaluations, so it reads {} over the seeds for REC-OneSide-NoIS offline where "
  "these give {}):",
  CALC,
  lambda: (
    *_k().x("rec_oneside_nois", "offline", "start_accuracy"),
    _k().mean("rec_oneside_nois", "offline"),
    _k().at("rec_oneside_nois", "offline", 300).mean(),
  ),
)
for _m in ("rec_oneside_nois", "reinforce"):
  claim(
    MT,
    f"| {NAMES[_m]} | {{}} / {{}} / {{}} | {{}} / {{}} / {{}} |",
    CALC,
    lambda m=_m: [*_k().at(m, "onpolicy", 300), *_k().at(m, "offline", 300)],
  )
claim(
  MT,
  "seed 0 goes {} -> {} at step 50 -> {} at step 100 -> {}, while REINFORCE collapses on it ({} "
  "at step 300).",
  CALC,
  lambda: (
    *(_k().at("rec_oneside_nois", "offline", step)[0] for step in (0, 50, 100, 300)),
    _k().at("reinforce", "offline", 300)[0],
  ),
)
fact(
  MT,
  "Seed 1's warm start solves nothing (0.000 throughout, both methods),",
  CALC,
  lambda: all(
    not any(_k().curves[m, g, "eval_accuracy"][1].values()) for m in _k().main for g in _k().lags
  ),
)
claim(
  MT,
  "on seed 2 the mask loses too ({} -> {}).",
  CALC,
  lambda: (
    _k().at("rec_oneside_nois", "offline", 0)[2],
    _k().at("rec_oneside_nois", "offline", 300)[2],
  ),
)
claim(
  MT,
  "its gain over the warm start is {} [{}, {}] (mean and 95% t interval of final minus step 0, "
  "from `study.csv`), REINFORCE's {} [{}, {}]:",
  CALC,
  lambda: (*ivs(_k().gain("rec_oneside_nois", "offline")), *ivs(_k().gain("reinforce", "offline"))),
)
claim(
  MT,
  "(3 seeds give no verdict, the smallest attainable p being {}, and every interval contains 0).",
  CALC,
  lambda: [study_stats.smallest_p(len(_k().seeds))],
)
fact(
  MT,
  "and every interval contains 0).",
  CALC,
  lambda: (
    all(c.diff.low <= 0 <= c.diff.high for c, _, _ in _k().tests.values())
    and all(_k().gain(m, "offline").low < 0 < _k().gain(m, "offline").high for m in _k().main)
  ),
)
fact(
  MT,
  "On-policy both are at 0.000 from step 50 on, on every seed",
  CALC,
  lambda: all(
    not np.any(_k().at(m, "onpolicy", step)) for m in _k().main for step in range(50, 301, 50)
  ),
)
_tr = lambda: _k().curves["rec_oneside_nois", "onpolicy", "train_reward"][0]
claim(
  MT,
  "(seed 0's training reward {}-{} over steps 1-10, 0 from step 11 on)",
  CALC,
  lambda: (min(_tr()[s] for s in range(1, 11)), max(_tr()[s] for s in range(1, 11))),
)
fact(
  MT,
  "0 from step 11 on)",
  CALC,
  lambda: not any(v for s, v in _tr().items() if s >= 11),
)
claim(
  MT,
  "({}% of seed 0's sampled episodes over steps 1-10)",
  CALC,
  lambda: [100 * np.mean([_tr()[s] for s in range(1, 11)])],
)
fact(
  MT,
  "report marks REINFORCE on-policy `=`: a difference of exactly 0 on every seed,",
  CALC,
  lambda: (
    _k().mark("reinforce", "onpolicy") == "="
    and _k().same(("reinforce", "onpolicy"), ("rec_oneside_nois", "onpolicy"))
  ),
)

# --- docs/what_lag_buys.md: data reuse on the default task --------------------------------------

WLB = "docs/what_lag_buys.md"
RE = "lag_study_reuse/study.csv"
_re = lambda: S("lag_study_reuse")
section(WLB, "## Data reuse on the default task")


def _reuse_row(method: str) -> list[Any]:
  """A reuse table row: accuracy, its paired difference and mark, tokens, reached, their
  paired difference and p (GRPO's row: accuracy, tokens, reached)."""
  r = _re()
  out = [*ivs(r.iv(method, "onpolicy"))]
  if method != "grpo":
    out += [*ivs(r.diff(method, "onpolicy")), r.mark(method, "onpolicy")]
  out += [*ivs(r.iv(method, "onpolicy", "tokens_to_threshold")), r.reached(method, "onpolicy")]
  if method != "grpo":
    c = r.compare(method, "onpolicy", ("grpo", "onpolicy"), "tokens_to_threshold")
    out += [*ivs(c.diff), c.p]
  return out


claim(WLB, "| 1 (GRPO) | {} [{}, {}] | | {} [{}, {}] | {}/8 | |", RE, lambda: _reuse_row("grpo"))
claim(
  WLB,
  "cell alone in 74 s) differed from GRPO by {} [{}, {}] in final\naccuracy (p {}): no false "
  "verdict on any metric, {}/{} each.",
  RE,
  lambda: (
    *ivs(_re().aa("final_accuracy")["onpolicy"][0].diff),
    _re().aa("final_accuracy")["onpolicy"][0].p,
    *max(_re().aa_rate(m)[:2] for m in report_aa.AA_METRICS),
  ),
)

for _n, _m in (("2", "grpo_reuse2"), ("4", "grpo_reuse4")):
  claim(
    WLB,
    f"| {_n} | {{}} [{{}}, {{}}] | {{}} [{{}}, {{}}] `{{m}}` | {{}} [{{}}, {{}}] | {{}}/8 | "
    "{} [{}, {}], p {} |",
    RE,
    lambda m=_m: _reuse_row(m),
  )
claim(
  WLB,
  "fewer runs reached it at all ({}/8 against {}/8;",
  RE,
  lambda: [_re().reached("grpo_reuse2", "onpolicy"), _re().reached("grpo", "onpolicy")],
)
fact(
  WLB,
  "with 4 reuses the time-averaged accuracy was lower (`worse` in the report's",
  RE,
  lambda: _re().same_lag("accuracy_auc")["grpo_reuse4", "onpolicy"][1] == "worse",
)
claim(
  WLB,
  "where a GRPO run samples {} tokens in its 200 steps.",
  RE,
  lambda: [int(round(_re().mean("grpo", "onpolicy", "sampled_tokens")))],
)

# --- docs/results/off_policyness.md: the mismatch study -----------------------------------------

section(OP, "## The mismatch study")

MIS = "mismatch_study/study.csv"
_ms = lambda: S("mismatch_study")
claim(
  OP,
  "distractor warm start, {} [{}, {}], from which the runs learn (GRPO on the exact engine ends "
  "at {}).",
  MIS,
  lambda: (*ivs(_ms().iv("grpo", "exact", "start_accuracy")), _ms().mean("grpo", "exact")),
)
claim(
  OP,
  "| grpo | 0 ({}) | {} [{}, {}] | {} [{}, {}] | {} [{}, {}] |",
  MIS,
  lambda: (
    _ms().mean("grpo", "exact"),
    *(v for g in _ms().lags[1:] for v in ivs(_ms().diff("grpo", g))),
  ),
)
_MIS_ROWS = {
  "tis": ("", "", ""),
  "tis_seq": ("", "", ""),
  "tis_old": ("", "", ""),
  "icepop": ("", "", ""),
  "icepop_old": ("", "", ""),
  "mis_token": ("", "", ""),
  "mis_seq": (" ({}% rows)", "", ""),
  "mis_geo": (" ({}% rows)", " ({}%)", " ({}%)"),
  "tr_mask_k3": (" ({}%)", " ({}%)", ""),
  "tr_mask_k1": (" ({}%)", " ({}%)", " ({}%)"),
  "dppo_tv": ("", "", ""),
  "dppo_kl": ("", "", ""),
  "opsm": (" ({}%)", "", ""),
}


def _mis_row(m: str) -> list[float]:
  out = [_ms().diff(m, "exact").mean]
  for g, suffix in zip(_ms().lags[1:], _MIS_ROWS[m], strict=True):
    out += ivs(_ms().diff(m, g))
    out += [100 * _ms().mean(m, g, "corr_seq_masked_frac")] if suffix else []
  return out


for _m, _suffixes in _MIS_ROWS.items():
  claim(
    OP,
    f"| {_m} | {{}} | " + " | ".join(f"{{}} [{{}}, {{}}]{s}" for s in _suffixes) + " |",
    MIS,
    lambda m=_m: _mis_row(m),
  )
fact(
  OP,
  "and the fraction of rows a correction masked (`corr_seq_masked_frac`) where it is not ~0:",
  MIS,
  lambda: all(
    (_ms().mean(m, g, "corr_seq_masked_frac") >= 0.005) == bool(s)
    for m, suffixes in _MIS_ROWS.items()
    for g, s in zip(_ms().lags[1:], suffixes, strict=True)
    if (m, g, "corr_seq_masked_frac") in _ms().values
  ),
)
_k3 = lambda g, what: _ms().mean("grpo", g, f"{what}_kl_k3")
claim(
  OP,
  "mismatch {} on the exact and stale8 engines, {} at topk5, {} at bf16; staleness {} to {} on the "
  "on-policy settings, {} at stale8.",
  MIS,
  lambda: (
    (_k3("exact", "mismatch"), _k3("stale8", "mismatch")),
    _k3("topk5", "mismatch"),
    _k3("bf16", "mismatch"),
    min(_k3(g, "staleness") for g in ("exact", "topk5", "bf16")),
    max(_k3(g, "staleness") for g in ("exact", "topk5", "bf16")),
    _k3("stale8", "staleness"),
  ),
)
claim(
  OP,
  "GRPO gains {} [{}, {}] over the warm start (mean and 95% t interval of the 3 per-seed gains, "
  "{}, {} and {}: every seed gains,",
  MIS,
  lambda: (*ivs(_ms().gain("grpo", "exact")), *_ms().gains("grpo", "exact")),
)
_corrections = lambda: [m for m in _ms().main if m != "grpo"]
claim(
  OP,
  "(every ratio is 1: the same runs, {} each) and end {} [{}, {}] from GRPO,",
  MIS,
  lambda: (_ms().mean("tis", "exact"), *ivs(_ms().diff("tis", "exact"))),
)
fact(
  OP,
  "The corrections are one update there",
  MIS,
  lambda: all(_ms().same(("tis", "exact"), (m, "exact")) for m in _corrections()),
)
claim(
  OP,
  "`mis_geo` masks {}% of the rows at stale8, all of them at topk5 and {}% at bf16, and loses "
  "{}-{} (one stale8 run collapsed);",
  MIS,
  lambda: (
    100 * _ms().mean("mis_geo", "stale8", "corr_seq_masked_frac"),
    100 * _ms().mean("mis_geo", "bf16", "corr_seq_masked_frac"),
    -max(_ms().diff("mis_geo", g).mean for g in _ms().lags[1:]),
    -min(_ms().diff("mis_geo", g).mean for g in _ms().lags[1:]),
  ),
)
fact(
  OP,
  "(one stale8 run collapsed);",
  MIS,
  lambda: (
    [_ms().collapsed("mis_geo", g) for g in _ms().lags] == [0, 1, 0, 0]
    and _ms().mean("mis_geo", "topk5", "corr_seq_masked_frac") == 1.0
  ),
)
claim(
  OP,
  "(no learning: it ends at the warm start, {}) and {}% at bf16 ({} [{}, {}], the one interval "
  "below 0).",
  MIS,
  lambda: (
    _ms().diff("tr_mask_k1", "topk5").mean,
    100 * _ms().mean("tr_mask_k1", "bf16", "corr_seq_masked_frac"),
    *ivs(_ms().diff("tr_mask_k1", "bf16")),
  ),
)
fact(
  OP,
  "the one interval below 0",
  MIS,
  lambda: (
    [k for k, (c, _, _) in _ms().tests.items() if c.diff.high < 0] == [("tr_mask_k1", "bf16")]
    and np.array_equal(
      _ms().x("tr_mask_k1", "topk5"), _ms().x("tr_mask_k1", "topk5", "start_accuracy")
    )
  ),
)
claim(
  OP,
  "`mis_token`) trail by {}-{} on average, with intervals wide enough to contain 0 ({} [{}, {}] "
  "for `tis`).",
  MIS,
  lambda: (
    -max(_ms().diff(m, "stale8").mean for m in ("tis", "icepop", "mis_token")),
    -min(_ms().diff(m, "stale8").mean for m in ("tis", "icepop", "mis_token")),
    *ivs(_ms().diff("tis", "stale8")),
  ),
)
_held = ("tis_old", "icepop_old", "dppo_tv", "dppo_kl", "mis_seq")
_reach = lambda m: max(-_ms().diff(m, "stale8").low, _ms().diff(m, "stale8").high)
claim(
  OP,
  "`tis_old` / `icepop_old` ({}), of `dppo_tv` / `dppo_kl` ({} / {}) and of `mis_seq` ({}) lie "
  "within 0.03 of GRPO, but their intervals reach {}-{} from 0 (`tis_old`: [{}, {}]; the "
  "tightest, `dppo_kl`: [{}, {}]) and none passes the equivalence test within 0.03 (TOST p {} to "
  "{}):",
  MIS,
  lambda: (
    _ms().diff("tis_old", "stale8").mean,
    _ms().diff("dppo_tv", "stale8").mean,
    _ms().diff("dppo_kl", "stale8").mean,
    _ms().diff("mis_seq", "stale8").mean,
    min(_reach(m) for m in _held),
    max(_reach(m) for m in _held),
    *ivs(_ms().diff("tis_old", "stale8"))[1:],
    *ivs(_ms().diff("dppo_kl", "stale8"))[1:],
    min(_ms().tests[m, "stale8"][0].p_equivalent for m in _held),
    max(_ms().tests[m, "stale8"][0].p_equivalent for m in _held),
  ),
)
fact(
  OP,
  "every mark is `~`, and no equivalence within 0.03 is shown either;",
  MIS,
  lambda: (
    {v for _, _, v in _ms().tests.values()} == {"~"}
    and _ms().same(("tis_old", "stale8"), ("icepop_old", "stale8"))
    and min(_held, key=_reach) == "dppo_kl"
  ),
)
claim(
  OP,
  "GRPO itself ends level under stale8 ({} [{}, {}]):",
  MIS,
  lambda: ivs(_ms().diff("grpo", "stale8")),
)
claim(
  OP,
  "is now {} with no collapsed run.",
  MIS,
  lambda: [_ms().diff("mis_geo", "bf16").mean],
)

# --- docs/results/sweeps.md: the 108-run grid ---------------------------------------------------

section(SW, "## The 108-run grid")


def _sweep_rows() -> list[dict[str, str]]:
  with open(os.path.join(RESULTS, "sweep_grid", "summary.csv"), newline="") as f:
    return list(csv.DictReader(f))


def _sweep_shape() -> tuple[int, int, int]:
  names = [r["run"].rsplit("-", 2) for r in _sweep_rows()]
  return tuple(len({n[i] for n in names}) for i in range(3))  # type: ignore[return-value]


claim(
  SW,
  "**{} of {} runs finished, none failed,",
  "sweep_grid/summary.csv",
  lambda: (
    sum(r["status"] == "ok" and r["steps"] == "200" for r in _sweep_rows()),
    len(_sweep_rows()),
  ),
)
fact(
  SW,
  "(9 methods x 4 lags x 3 seeds of the default task, 200 steps each,",
  "sweep_grid/summary.csv",
  lambda: _sweep_shape() == (9, 4, 3) and all(r["error"] == "" for r in _sweep_rows()),
)

# --- docs/results/routing_replay.md: routing replay on tiny-moe ---------------------------------

RR = "docs/results/routing_replay.md"
MOE = "lag_study_moe/study.csv"
MOE_LAGS = ("onpolicy", "interval20", "interval64", "offline")
MOE_METHODS = ("grpo", "rec_oneside_nois", "m2po")
_moe = lambda: S("lag_study_moe")


@functools.cache
def moe_replay_pairs() -> dict[tuple[str, str], tuple[study_stats.Comparison, float, str]]:
  """{(method, lag): (replay minus record, Holm p, mark)}: final accuracy, Holm over the 12."""
  s = _moe()
  comps = {(m, g): s.compare(f"{m}_r3", g, (m, g)) for m in MOE_METHODS for g in MOE_LAGS}
  return {
    k: (comps[k], p, report_tables.MARK[v])
    for k, (p, v) in study_stats.verdicts(comps, s.alpha).items()
  }


def _moe_row(method: str) -> list[Any]:
  out: list[Any] = []
  for g in MOE_LAGS:
    c, _, mark = moe_replay_pairs()[method, g]
    out += [*ivs(c.diff), mark]
  return out


def _agreement_row(method: str) -> list[Any]:
  return [_moe().mean(method, g, "moe/router_agreement") for g in MOE_LAGS]


section(RR, "")
claim(
  RR,
  "batch from the warm start). A/A: GRPO twice at every lag; {} of {} pairs",
  MOE,
  lambda: list(_moe().aa_rate("final_accuracy")[:2]),
)
claim(
  RR,
  "called different on final accuracy ({} [{}, {}]).",
  MOE,
  lambda: [_moe().aa_rate("final_accuracy")[i] for i in (2, 3, 4)],
)
section(RR, "## Replay minus record")
for _m in MOE_METHODS:
  claim(
    RR,
    f"| {NAMES[_m]} | " + " | ".join(["{} [{}, {}] `{m}`"] * 4) + " |",
    MOE,
    lambda m=_m: _moe_row(m),
  )
section(RR, "## Router agreement")
for _m in MOE_METHODS:
  claim(RR, f"| {NAMES[_m]} | {{}} | {{}} | {{}} | {{}} |", MOE, lambda m=_m: _agreement_row(m))

section(RR, "## What it says")
claim(
  RR,
  "updates old, {}%, {}% and {}% of GRPO's (token, block) pairs go to",
  MOE,
  lambda: [100 * (1 - _moe().mean("grpo", g, "moe/router_agreement")) for g in MOE_LAGS[1:]],
)
fact(
  RR,
  "is the sampler's on every token (agreement exactly 1 on every seed:",
  MOE,
  lambda: all(
    (_moe().x(m, "onpolicy", "moe/router_agreement") == 1.0).all()
    for m in (*MOE_METHODS, *(f"{m}_r3" for m in MOE_METHODS))
  ),
)
claim(RR, "drifts most (agreement {} offline).", MOE, lambda: [_agreement_row("m2po")[3]])
fact(
  RR,
  "wide for M2PO, whose lagged runs collapse in 1-7 of 8 seeds with or without",
  MOE,
  lambda: (
    sorted(_moe().collapsed(m, g) for m in ("m2po", "m2po_r3") for g in MOE_LAGS[1:])[::5] == [1, 7]
  ),
)
claim(
  RR,
  "REC-OneSide-NoIS's runs exactly as they were (`=`); M2PO's differ slightly\n  ({}),",
  MOE,
  lambda: [moe_replay_pairs()["m2po", "onpolicy"][0].diff.mean],
)


claim(
  "docs/models.md",
  "seeds) found agreement falling with lag (GRPO: {}, {}, {}, {}) and",
  MOE,
  lambda: _agreement_row("grpo"),
)


# --- docs/results/critic.md: critics under lag ---------------------------------------------

CR = "docs/results/critic.md"
CRITIC = "lag_study_critic/study.csv"
CRITIC_LAGS = ("onpolicy", "interval20", "interval64", "offline")
CRITIC_NAMES = {
  "grpo": "GRPO",
  "rec_oneside_nois": "REC-OneSide-NoIS",
  "ppo_critic": "ppo_critic",
  "vtrace": "vtrace",
  "vtrace_rec": "vtrace_rec",
  "rec_critic": "rec_critic",
  "remax": "remax",
  "remax_rec": "remax_rec",
}
_cr = lambda: S("lag_study_critic")
_CRITICS = ("ppo_critic", "vtrace", "vtrace_rec", "rec_critic")


def _critic_ev(method: str, lag: str, study: str = "lag_study_critic") -> study_stats.Interval:
  """A critic cell's explained variance per run, 1 - Var(R - V) / Var(R), over seeds."""
  s = S(study)
  ratio = s.x(method, lag, "critic/error_var") / s.x(method, lag, "critic/return_var")
  return study_stats.interval(1.0 - ratio)


section(CR, "## The study")
claim(
  CR,
  "accuracy {}/{} false verdicts, steps to the threshold {}/{}, accuracy AUC {}/{}\n(the offline "
  "pair, {} [{}, {}], p {})",
  CRITIC,
  lambda: (
    *_cr().aa_rate("final_accuracy")[:2],
    *_cr().aa_rate("steps_to_threshold")[:2],
    *_cr().aa_rate("accuracy_auc")[:2],
    *ivs(_cr().aa("accuracy_auc")["offline"][0].diff),
    _cr().aa("accuracy_auc")["offline"][0].p,
  ),
)
fact(
  CR,
  "table's AUC verdicts carry `†` in `study.md`; the final-accuracy verdicts",
  CRITIC,
  lambda: set(report_aa.not_findings(_aa_tests(_cr()), _cr().alpha)) == {"accuracy_auc"},
)
section(CR, "## Final greedy accuracy")
for _m, _name in CRITIC_NAMES.items():
  claim(
    CR,
    f"| {_name} | " + " | ".join(["{} [{}, {}] `{m}`"] * 4) + " |",
    CRITIC,
    lambda m=_m: [x for g in CRITIC_LAGS for x in (*ivs(_cr().iv(m, g)), _cr().mark(m, g))],
  )
for _m, _text in (("vtrace", "V-trace"), ("remax", "ReMax")):
  claim(
    CR,
    _text + " {} of 12 at interval 20 and {} of 12 at interval 64 and offline;",
    CRITIC,
    lambda m=_m: [_cr().collapsed(m, "interval20"), _cr().collapsed(m, "interval64")],
  )
claim(
  CR,
  "ReMax under REC's mask {} of 12 offline; no",
  CRITIC,
  lambda: [_cr().collapsed("remax_rec", "offline")],
)
fact(
  CR,
  "other cell has one.",
  CRITIC,
  lambda: (
    all(_cr().collapsed(m, "offline") == 12 for m in ("vtrace", "remax"))
    and sum(_cr().collapsed(m, g) for m in _cr().main for g in CRITIC_LAGS)
    == sum(_cr().collapsed(m, g) for m in ("vtrace", "remax") for g in CRITIC_LAGS)
    + _cr().collapsed("remax_rec", "offline")
  ),
)
section(CR, "## The critic's explained variance")
for _m in ("ppo_critic", "vtrace", "vtrace_rec", "rec_critic"):
  claim(
    CR,
    f"| {_m} | " + " | ".join(["{} [{}, {}]"] * 4) + " |",
    CRITIC,
    lambda m=_m: [x for g in CRITIC_LAGS for x in ivs(_critic_ev(m, g))],
  )
MAIN_RUNS = os.path.join(REPO, "docs", "results", "critic", "main_job_runs.csv")


@functools.cache
def _main_runs() -> list[dict[str, Any]]:
  """The main job's critic runs (docs/results/critic/main_job_runs.csv), one row per run."""
  with open(MAIN_RUNS, newline="") as f:
    return [{k: (v if k == "loss" else float(v)) for k, v in r.items()} for r in csv.DictReader(f)]


def _main(loss: str, key: str) -> list[float]:
  return [r[key] for r in _main_runs() if r["loss"] == loss]


SPELL_CRITIC = "lag_study_spell_critic/study.csv"
SPELL_CRITIC_LAGS = ("onpolicy", "interval20", "interval64", "offline")
_scr = lambda: S("lag_study_spell_critic")


def _spell_critic_ev(method: str, lag: str) -> study_stats.Interval:
  return _critic_ev(method, lag, "lag_study_spell_critic")


section(CR, "## The second task: spell_backward")
claim(
  CR,
  "final\naccuracy {}/{} false verdicts, accuracy AUC {}/{}, steps to the threshold {}/{}.",
  SPELL_CRITIC,
  lambda: (
    *_scr().aa_rate("final_accuracy")[:2],
    *_scr().aa_rate("accuracy_auc")[:2],
    *_scr().aa_rate("steps_to_threshold")[:2],
  ),
)
for _m in ("grpo", "rec_oneside_nois", "ppo_critic", "rec_critic", "vtrace_rec"):
  claim(
    CR,
    f"| {CRITIC_NAMES[_m]} | " + " | ".join(["{} [{}, {}] `{m}`"] * 4) + " |",
    SPELL_CRITIC,
    lambda m=_m: [x for g in SPELL_CRITIC_LAGS for x in (*ivs(_scr().iv(m, g)), _scr().mark(m, g))],
  )
fact(
  CR,
  "From interval 64 on every method loses to on-policy GRPO, the critic's\nincluded",
  SPELL_CRITIC,
  lambda: all(_scr().mark(m, g) == "worse" for m in _scr().main for g in ("interval64", "offline")),
)
fact(
  CR,
  "No run collapsed.",
  SPELL_CRITIC,
  lambda: sum(_scr().collapsed(m, g) for m in _scr().main for g in SPELL_CRITIC_LAGS) == 0,
)
claim(
  CR,
  "is below zero in every critic cell: from {} [{}, {}]\n(`ppo_critic` on-policy) to {} [{}, {}] "
  "(`vtrace_rec` offline).",
  SPELL_CRITIC,
  lambda: [
    *ivs(_spell_critic_ev("ppo_critic", "onpolicy")),
    *ivs(_spell_critic_ev("vtrace_rec", "offline")),
  ],
)
fact(
  CR,
  "is below zero in every critic cell",
  SPELL_CRITIC,
  lambda: all(
    _spell_critic_ev(m, g).high < 0
    for m in ("ppo_critic", "rec_critic", "vtrace_rec")
    for g in SPELL_CRITIC_LAGS
  ),
)
POOL_RUNS = os.path.join(REPO, "docs", "results", "critic", "prompt_pool_runs.csv")
POOL_SOURCE = "../../docs/results/critic/prompt_pool_runs.csv"


@functools.cache
def _pool_runs() -> dict[tuple[int, int], dict[str, str]]:
  """The prompt-values runs (docs/results/critic/prompt_pool_runs.csv) by (pool, seed)."""
  with open(POOL_RUNS, newline="") as f:
    return {(int(r["prompt_pool"]), int(r["seed"])): r for r in csv.DictReader(f)}


def _pool(pool: int, key: str) -> list[float]:
  return [float(r[key]) for (p, _), r in sorted(_pool_runs().items()) if p == pool]


def _pool_diff(pool: int, key: str) -> study_stats.Interval:
  return study_stats.t_interval(np.subtract(_pool(pool, key), _pool(1, key)))


section(CR, "## Prompt values (V_0)")
for _key, _name in (
  ("all_equal_mean", "groups all equal, run"),
  ("all_equal_last_fifth", "groups all equal, last fifth"),
  ("reward_last_fifth", "training reward, last fifth"),
  ("final_accuracy", "final greedy accuracy"),
):
  claim(
    CR,
    f"| {_name} | " + " | ".join(["{} [{}, {}]"] * 3) + " |",
    POOL_SOURCE,
    lambda k=_key: [x for p in (1, 2, 4) for x in ivs(study_stats.t_interval(_pool(p, k)))],
  )
for _key, _name in (
  ("predicted_all_equal_last_fifth", "predicted, chosen, last fifth"),
  ("predicted_all_equal_pool_last_fifth", "predicted, all candidates, last fifth"),
):
  claim(
    CR,
    f"| {_name} | - | " + " | ".join(["{} [{}, {}]"] * 2) + " |",
    POOL_SOURCE,
    lambda k=_key: [x for p in (2, 4) for x in ivs(study_stats.t_interval(_pool(p, k)))],
  )
claim(
  CR,
  "rewards over the run falls by {} [{}, {}] with 2 candidates and\n  by {} [{}, {}] with 4",
  POOL_SOURCE,
  lambda: [
    x
    for p in (2, 4)
    for x in (lambda i: (-i.mean, -i.high, -i.low))(_pool_diff(p, "all_equal_mean"))
  ],
)
claim(
  CR,
  "({} [{}, {}]\n  and {} [{}, {}]), nor is one in final accuracy ({}\n  [{}, {}] and {} [{}, {}])",
  POOL_SOURCE,
  lambda: [
    *ivs(_pool_diff(2, "all_equal_last_fifth")),
    *ivs(_pool_diff(4, "all_equal_last_fifth")),
    *ivs(_pool_diff(2, "final_accuracy")),
    *ivs(_pool_diff(4, "final_accuracy")),
  ],
)
fact(
  CR,
  "The chosen prompts are harder: the training reward is lower with the pool.",
  POOL_SOURCE,
  lambda: all(_pool_diff(p, "reward_last_fifth").mean < 0 for p in (2, 4)),
)
SEPARATE_SOURCE = "../../docs/results/critic/separate_critic_runs.csv"
_PAIRED_ROWS = (
  ("explained_variance_first_fifth", "explained variance, first fifth"),
  ("explained_variance_last_fifth", "explained variance, last fifth"),
  ("reward_last_fifth", "training reward, last fifth"),
  ("final_accuracy", "final greedy accuracy"),
)


def _runs(name: str, column: str, value: str, key: str) -> list[float]:
  """`key` of the runs in docs/results/critic/`name` whose `column` is `value`, by seed."""
  with open(os.path.join(REPO, "docs", "results", "critic", name), newline="") as f:
    rows = [r for r in csv.DictReader(f) if r[column] == value]
  return [float(r[key]) for r in sorted(rows, key=lambda r: int(r["seed"]))]


def _paired_table(name: str, column: str, base: str, other: str) -> None:
  """The claims of a table: each row's base and other runs and their paired difference."""
  for key, label in _PAIRED_ROWS:
    claim(
      CR,
      f"| {label} | " + " | ".join(["{} [{}, {}]"] * 3) + " |",
      f"../../docs/results/critic/{name}",
      lambda k=key: [
        *ivs(study_stats.t_interval(_runs(name, column, base, k))),
        *ivs(study_stats.t_interval(_runs(name, column, other, k))),
        *ivs(
          study_stats.t_interval(
            np.subtract(_runs(name, column, other, k), _runs(name, column, base, k))
          )
        ),
      ],
    )


_separate = lambda critic, key: _runs("separate_critic_runs.csv", "critic", critic, key)
section(CR, "## A separate critic model")
_paired_table("separate_critic_runs.csv", "critic", "head", "policy")
fact(
  CR,
  "reproducing\nthe prompt-values grid's pool-1 runs of those seeds exactly",
  SEPARATE_SOURCE,
  lambda: (
    _separate("head", "final_accuracy")[3:] == _pool(1, "final_accuracy")[3:]
    and _separate("head", "reward_last_fifth")[3:] == _pool(1, "reward_last_fifth")[3:]
  ),
)
_CONST_METHODS = (
  ("rec_oneside_nois", "REC-OneSide-NoIS"),
  ("ppo_critic", "ppo_critic"),
  ("rec_critic", "rec_critic"),
  ("vtrace_rec", "vtrace_rec"),
)
_CRITIC_METHODS = ("ppo_critic", "rec_critic", "vtrace_rec")


def _const256_table(name: str) -> None:
  """The claims of a critic grid's table at lag 256: each method against GRPO there."""
  study = lambda: S(name)
  source = f"{name}/study.csv"
  claim(
    CR, "| GRPO | {} [{}, {}] | (baseline) |", source, lambda: ivs(study().iv("grpo", "const256"))
  )
  for method, label in _CONST_METHODS:
    claim(
      CR,
      f"| {label} | {{}} [{{}}, {{}}] | {{}} [{{}}, {{}}] `{{m}}` |",
      source,
      lambda m=method: (
        *ivs(study().iv(m, "const256")),
        *ivs(study().diff(m, "const256")),
        study().mark(m, "const256"),
      ),
    )


def _const256_ev(name: str) -> list[float]:
  """The critic methods' explained variance at lag 256, as quoted (mean, low, high each)."""
  return [x for m in _CRITIC_METHODS for x in ivs(_critic_ev(m, "const256", name))]


CRITIC_CONST = "lag_study_critic_const256/study.csv"
_cc256 = lambda: S("lag_study_critic_const256")
section(CR, "## At 256 stale updates")
_const256_table("lag_study_critic_const256")
fact(
  CR,
  "GRPO and REC-OneSide-NoIS\nshare the `const256` grid's warm starts and seeds and repeat its "
  "numbers\nexactly",
  CRITIC_CONST,
  lambda: all(
    _cc256().iv(m, "const256") == _c256().iv(m, "const256") for m in ("grpo", "rec_oneside_nois")
  ),
)
claim(
  CR,
  "**A/A calibration**: final accuracy {}/{} false verdicts; the\naccuracy AUC's {}/{} flags",
  CRITIC_CONST,
  lambda: (*_cc256().aa_rate("final_accuracy")[:2], *_cc256().aa_rate("accuracy_auc")[:2]),
)
claim(
  CR,
  "Against on-policy GRPO ({} in the `deep` grid",
  "lag_study_deep/study.csv",
  lambda: (S("lag_study_deep").mean("grpo", "onpolicy"),),
)
fact(
  CR,
  "every cell here is lower.",
  CRITIC_CONST,
  lambda: all(
    _cc256().mean(m, "const256") < S("lag_study_deep").mean("grpo", "onpolicy")
    for m in ("grpo", "rec_oneside_nois", "ppo_critic", "rec_critic", "vtrace_rec")
  ),
)

claim(
  CR,
  "The critic's\nexplained variance per run is {} [{}, {}] (`ppo_critic`), {}\n[{}, {}] "
  "(`rec_critic`) and {} [{}, {}] (`vtrace_rec`).",
  CRITIC_CONST,
  lambda: _const256_ev("lag_study_critic_const256"),
)
SPELL_CONST = "lag_study_spell_critic_const256/study.csv"
_scc256 = lambda: S("lag_study_spell_critic_const256")
section(CR, "## spell_backward at 256 stale updates")
_const256_table("lag_study_spell_critic_const256")
claim(
  CR,
  "calibration**: final accuracy {}/{}, accuracy AUC {}/{}, steps to the threshold\n{}/{}. "
  "No run collapsed.",
  SPELL_CONST,
  lambda: (
    *_scc256().aa_rate("final_accuracy")[:2],
    *_scc256().aa_rate("accuracy_auc")[:2],
    *_scc256().aa_rate("steps_to_threshold")[:2],
  ),
)
fact(
  CR,
  "No run collapsed.",
  SPELL_CONST,
  lambda: all(
    _scc256().collapsed(m, "const256") == 0
    for m in ("grpo", "rec_oneside_nois", "ppo_critic", "rec_critic", "vtrace_rec")
  ),
)
claim(
  CR,
  "is below zero again: {} [{}, {}] (`ppo_critic`), {}\n[{}, {}] (`rec_critic`), {} [{}, {}] "
  "(`vtrace_rec`).",
  SPELL_CONST,
  lambda: _const256_ev("lag_study_spell_critic_const256"),
)
RECIPE_SOURCE = "../../docs/results/critic/recipe_runs.csv"
_recipe = lambda settings, key: _runs("recipe_runs.csv", "settings", settings, key)
section(CR, "## PPO-max's recipe")
_paired_table("recipe_runs.csv", "settings", "plain", "recipe")
claim(
  CR,
  "over the last fifth is {}\n  [{}, {}] nats per token",
  RECIPE_SOURCE,
  lambda: ivs(study_stats.t_interval(_recipe("recipe", "ref_kl_last_fifth"))),
)
fact(
  CR,
  "the head's runs\nof the section above",
  RECIPE_SOURCE,
  lambda: all(
    _recipe("plain", k) == _separate("head", k) for k in ("final_accuracy", "reward_last_fifth")
  ),
)
section(CR, "## What it says")
claim(
  CR,
  "ReMax collapses under lag too ({} of 12 runs at interval 20, all at 64",
  CRITIC,
  lambda: [_cr().collapsed("remax", "interval20")],
)
fact(
  CR,
  "and offline): its loss is REINFORCE's, with no trust region, and the",
  CRITIC,
  lambda: all(_cr().collapsed("remax", g) == 12 for g in ("interval64", "offline")),
)


claim(
  CR,
  "`remax_rec` ends at\n  {}, {} and {} at interval 20, 64 and offline ({} run of 12\n  collapsed, "
  "offline), against plain ReMax's {}, {} and {}, and is\n  still `{m}` than GRPO under lag "
  "({} [{}, {}] at interval 20).",
  CRITIC,
  lambda: (
    *[_cr().mean("remax_rec", g) for g in CRITIC_LAGS[1:]],
    sum(_cr().collapsed("remax_rec", g) for g in CRITIC_LAGS),
    *[_cr().mean("remax", g) for g in CRITIC_LAGS[1:]],
    _cr().mark("remax_rec", "interval20"),
    *ivs(_cr().diff("remax_rec", "interval20")),
  ),
)


def _critic_group_size() -> int:
  with open(os.path.join(RESULTS, "lag_study_critic", "study_config.json")) as f:
    return json.load(f)["group_size"]


claim(
  CR,
  "On-policy it is {}\n  [{}, {}] against GRPO (`{m}`), with one response of {} per group",
  CRITIC,
  lambda: (
    *ivs(_cr().diff("remax", "onpolicy")),
    _cr().mark("remax", "onpolicy"),
    _critic_group_size(),
  ),
)
claim(
  CR,
  "{} [{}, {}] against GRPO (`{m}`) and REC on the critic\n  {} [{}, {}] (`{m}`); offline they "
  "lose {} and {},\n  more than GRPO's own {} from lag.",
  CRITIC,
  lambda: (
    *ivs(_cr().diff("ppo_critic", "onpolicy")),
    _cr().mark("ppo_critic", "onpolicy"),
    *ivs(_cr().diff("rec_critic", "onpolicy")),
    _cr().mark("rec_critic", "onpolicy"),
    _cr().diff("ppo_critic", "offline").mean,
    _cr().diff("rec_critic", "offline").mean,
    _cr().diff("grpo", "offline").mean,
  ),
)
claim(
  CR,
  "summary's `critic` line) is {}, {} and {} for `ppo_critic` and\n  {}, {} and {} for "
  "`vtrace`, from {} to {} over the first fifth;",
  "../../docs/results/critic/main_job_runs.csv",
  lambda: [
    *_main("ppo_critic", "explained_variance_last_fifth"),
    *_main("vtrace", "explained_variance_last_fifth"),
    min(r["explained_variance_first_fifth"] for r in _main_runs()),
    max(r["explained_variance_first_fifth"] for r in _main_runs()),
  ],
)
claim(
  CR,
  "greedy accuracy\n  {} -> {} on seed 0 for both presets.",
  "../../docs/results/critic/main_job_runs.csv",
  lambda: [*{(r["start_accuracy"], r["final_accuracy"]) for r in _main_runs() if r["seed"] == 0}][
    0
  ],
)
fact(CR, "On-policy it is `~`.", CRITIC, lambda: _cr().mark("vtrace", "onpolicy") == "~")
claim(
  CR,
  "V-trace advantages and critic (`vtrace_rec`) collapse in no run and end at\n  {}, {} and {} at "
  "interval 20, 64 and offline, against plain\n  V-trace's {}, {} and {}.",
  CRITIC,
  lambda: [_cr().mean(m, g) for m in ("vtrace_rec", "vtrace") for g in CRITIC_LAGS[1:]],
)
fact(
  CR,
  "On-policy the mask never binds and the\n  runs are plain V-trace's.",
  CRITIC,
  lambda: (
    _cr().same(("vtrace_rec", "onpolicy"), ("vtrace", "onpolicy"))
    and sum(_cr().collapsed("vtrace_rec", g) for g in CRITIC_LAGS) == 0
  ),
)
claim(
  CR,
  "It still trails GRPO under lag ({} [{}, {}] at interval 20, `{m}`).",
  CRITIC,
  lambda: [*ivs(_cr().diff("vtrace_rec", "interval20")), _cr().mark("vtrace_rec", "interval20")],
)
claim(
  CR,
  "explains little of the return's variance ({} to\n  {})",
  CRITIC,
  lambda: (
    min(_critic_ev(m, g).mean for m in _CRITICS for g in CRITIC_LAGS),
    max(_critic_ev(m, g).mean for m in _CRITICS for g in CRITIC_LAGS),
  ),
)


# --- docs/results/ope.md: off-policy evaluation from the buffer by lag ----------------------

OPD = "docs/results/ope.md"
OPE = "lag_study_ope/study.csv"
_ope = lambda: S("lag_study_ope")

fact(
  OPD,
  "the runs' final accuracies are those of the critic study",
  f"{OPE}, {CRITIC}",
  lambda: all(
    np.array_equal(_ope().x(m, g), _cr().x(m, g))
    for m in ("ppo_critic", "vtrace")
    for g in CRITIC_LAGS
  ),
)
claim(
  OPD,
  "(319 s for the command): {}/{} false verdicts on final accuracy, accuracy AUC\nand steps to "
  "the threshold alike.",
  OPE,
  lambda: (
    *_ope().aa_rate("final_accuracy")[:2],
    # The same count on the other two metrics, or the sentence would not hold.
    *(
      ()
      if _ope().aa_rate("accuracy_auc")[:2]
      == _ope().aa_rate("steps_to_threshold")[:2]
      == _ope().aa_rate("final_accuracy")[:2]
      else (None,)
    ),
  ),
)
section(OPD, "## Mean absolute error and interval coverage")
for _n, _label in (("is", "`is`"), ("dr", "`dr`"), ("behavior", "rows' own reward")):
  claim(
    OPD,
    f"| {_label} | " + " | ".join(["{} [{}, {}]"] * 4) + " |",
    OPE,
    lambda n=_n: [
      x for g in CRITIC_LAGS for x in ivs(_ope().iv("ppo_critic", g, f"ope_{n}_abs_error"))
    ],
  )
claim(
  OPD,
  "`is` coverage: {}%, {}%, {}% and {}%; `dr`: {}%, {}%, {}% and {}%.",
  OPE,
  lambda: [
    round(100 * _ope().mean("ppo_critic", g, f"ope_{n}_coverage"))
    for n in ("is", "dr")
    for g in CRITIC_LAGS
  ],
)
section(OPD, "## What it says")
claim(
  OPD,
  "95% intervals hold the truth in only {}% to {}% of the `ppo_critic`",
  OPE,
  lambda: [
    f(
      round(100 * _ope().mean("ppo_critic", g, f"ope_{n}_coverage"))
      for n in ("is", "wis", "pdwis", "dr", "wdr")
      for g in CRITIC_LAGS
    )
    for f in (min, max)
  ],
)


def _ope_pair(a: str, b: str, lag: str) -> study_stats.Comparison:
  """Paired per-seed comparison of two estimators' mean absolute errors (ppo_critic)."""
  s = _ope()
  x = lambda n: s.x("ppo_critic", lag, f"ope_{n}_abs_error")
  return study_stats.compare(x(a), x(b))


claim(
  OPD,
  "Offline, the uncorrected buffer reward is off by {} and `is` by {}:\n  per seed, the "
  "uncorrected error is larger by {} [{}, {}] (paired t\n  interval; sign-flip p {}, one",
  OPE,
  lambda: [
    *(_ope().mean("ppo_critic", "offline", f"ope_{n}_abs_error") for n in ("behavior", "is")),
    *ivs(_ope_pair("behavior", "is", "offline").diff),
    _ope_pair("behavior", "is", "offline").p,
  ],
)
claim(
  OPD,
  "Doubly robust errs more than plain IS here ({} on-policy; per seed by\n  {} [{}, {}], "
  "sign-flip p {})",
  OPE,
  lambda: [
    _ope().mean("ppo_critic", "onpolicy", "ope_dr_abs_error"),
    *ivs(_ope_pair("dr", "is", "onpolicy").diff),
    _ope_pair("dr", "is", "onpolicy").p,
  ],
)
claim(
  OPD,
  "offline, `wis` is off by {} and `dr` covers the\n  truth in {}% of evaluations.",
  OPE,
  lambda: [
    _ope().mean("vtrace", "offline", "ope_wis_abs_error"),
    round(100 * _ope().mean("vtrace", "offline", "ope_dr_coverage")),
  ],
)


# ------------------------------------------------------------------------------------------
# Tests.


# --- docs/results/m2po.md: M2PO at constant staleness 256 -----------------------------------

M2D = "docs/results/m2po.md"
CONST = "lag_study_const256/study.csv"
_c256 = lambda: S("lag_study_const256")
section(M2D, "## Constant staleness 256")
claim(
  M2D,
  "warm start ({} [{}, {}] here)",
  CONST,
  lambda: ivs(_c256().iv("grpo", "const256", "start_accuracy")),
)
_M2PO_ROWS = (
  ("m2po", "`m2po` (paper's description)"),
  ("m2po_release", "`m2po_release` (released code)"),
  ("rec_oneside_nois", "REC-OneSide-NoIS"),
  ("decoupled_ppo", "decoupled PPO"),
)


def _m2po_table(source: str, study: Callable[[], Study], against: Callable[[str], tuple]) -> None:
  """m2po.md's table at the constant lag 256: GRPO, and each method against GRPO at that lag
  (`against(method)`: the comparison and its mark)."""
  at = "const256"
  claim(
    M2D,
    "| GRPO | {} [{}, {}] | | (baseline) | {}/12 | {} |",
    source,
    lambda: (
      *ivs(study().iv("grpo", at)),
      study().collapsed("grpo", at),
      study().mean("grpo", at, "staleness_kl_k3"),
    ),
  )
  for method, label in _M2PO_ROWS:
    claim(
      M2D,
      f"| {label} | {{}} [{{}}, {{}}] | {{}} [{{}}, {{}}] | {{m}} | {{}}/12 | {{}} |",
      source,
      lambda m=method: (
        *ivs(study().iv(m, at)),
        *ivs(against(m)[0].diff),
        against(m)[1],
        study().collapsed(m, at),
        study().mean(m, at, "staleness_kl_k3"),
      ),
    )


_m2po_table(CONST, _c256, lambda m: (_c256().tests[m, "const256"][0], _c256().mark(m, "const256")))
claim(
  M2D,
  "different from GRPO at that lag (`~`: {} [{}, {}]; nor is it\n  shown equivalent within 0.03, "
  "TOST p {})",
  CONST,
  lambda: (
    *ivs(_c256().diff("m2po_release", "const256")),
    _c256().compare("m2po_release", "const256", ("grpo", "const256")).p_equivalent,
  ),
)
claim(
  M2D,
  'It is not "matching on-policy": on-policy GRPO ends at {} in the',
  "lag_study_deep/study.csv",
  lambda: (S("lag_study_deep").mean("grpo", "onpolicy"),),
)
claim(
  M2D,
  "The A/A pair (GRPO twice) called its accuracy AUC different (p {}), {}\nof {} pair",
  CONST,
  lambda: (_c256().aa("accuracy_auc")["const256"][0].p, *_c256().aa_rate("accuracy_auc")[:2]),
)

BITS = "lag_study_bits/study.csv"
_bits = lambda: S("lag_study_bits")
_BITS_LAGS = ("onpolicy", "interval20", "const256", "offline")
_BITS_TABLE = (
  ("grpo", "GRPO"),
  ("reinforce", "REINFORCE"),
  ("rec_oneside_nois", "REC-OneSide-NoIS"),
  ("m2po", "M2PO"),
  ("decoupled_ppo", "decoupled PPO"),
  ("m2po_release", "`m2po_release`"),
)


_BITS_METHODS_M2 = ("m2po", "m2po_release", "rec_oneside_nois", "decoupled_ppo")


def _bits_same_lag(method: str, lag: str) -> study_stats.Comparison:
  return _bits().same_lag("final_accuracy")[method, lag][0]


section(M2D, "## A second task: count_bits")
claim(
  M2D,
  "its own warm starts on true answers only, {} [{}, {}]",
  BITS,
  lambda: ivs(_bits().iv("grpo", "onpolicy", "start_accuracy")),
)
_m2po_table(BITS, _bits, lambda m: _bits().same_lag("final_accuracy")[m, "const256"])
claim(
  M2D,
  "Against GRPO at the same lag (Holm over the grid's {} same-lag comparisons)",
  BITS,
  lambda: (len(_bits().same_lag("final_accuracy")),),
)
claim(
  M2D,
  "The four end above GRPO at this lag ({} to {}), but none is\n  shown different (`m2po` p {}, "
  "Holm `{m}`) or equivalent.",
  BITS,
  lambda: (
    min(_bits_same_lag(m, "const256").diff.mean for m in _BITS_METHODS_M2),
    max(_bits_same_lag(m, "const256").diff.mean for m in _BITS_METHODS_M2),
    _bits_same_lag("m2po", "const256").p,
    _bits().same_lag("final_accuracy")["m2po", "const256"][1],
  ),
)
fact(
  M2D,
  "or equivalent.",
  BITS,
  lambda: all(
    _bits().same_lag("final_accuracy")[m, "const256"][1] == "~" for m in _BITS_METHODS_M2
  ),
)
fact(
  M2D,
  "None of these five methods collapses on this task, M2PO as described\n  included.",
  BITS,
  lambda: all(
    _bits().collapsed(m, g) == 0 for m in ("grpo", *_BITS_METHODS_M2) for g in _BITS_LAGS
  ),
)
fact(
  M2D,
  "times GRPO's (10 to 11 times on the toy), without a collapse here.",
  BITS,
  lambda: all(
    lo
    <= round(st().mean(m, "const256", "staleness_kl_k3") / st().mean("grpo", "const256", k))
    <= hi
    for st, lo, hi in ((_bits, 6, 8), (_c256, 10, 11))
    for m in ("m2po", "decoupled_ppo")
    for k in ("staleness_kl_k3",)
  ),
)
fact(
  M2D,
  "no\n  M2PO cell is shown different from on-policy GRPO, nor shown equivalent",
  BITS,
  lambda: all(_bits().mark(m, g) == "~" for m in ("m2po", "m2po_release") for g in _BITS_LAGS),
)

section(LAG, "## A task that is not string reversal: count_bits")
claim(
  LAG,
  "Warm start {} [{}, {}]. On-policy GRPO ends at {} [{},\n{}], a gain of **{} [{}, {}]** over "
  "its warm start.",
  BITS,
  lambda: (
    *ivs(_bits().iv("grpo", "onpolicy", "start_accuracy")),
    *ivs(_bits().iv("grpo", "onpolicy")),
    *ivs(_bits().gain("grpo", "onpolicy")),
  ),
)
claim(
  LAG,
  "Holm verdict against on-policy GRPO ({}\ncomparisons)",
  BITS,
  lambda: (len(_bits().tests),),
)
for _m, _label in _BITS_TABLE:
  claim(
    LAG,
    f"| {_label} | " + " | ".join("{} `{m}`" for _ in _BITS_LAGS) + " |"
    if _m != "grpo"
    else "| GRPO | {} (baseline) | {} `{m}` | {} `{m}` | {} `{m}` |",
    BITS,
    lambda m=_m: [
      x for g in _BITS_LAGS for x in (_bits().mean(m, g), _bits().mark(m, g)) if x != "(baseline)"
    ],
  )
claim(
  LAG,
  "**A/A calibration**: {}/{} false verdicts on final accuracy, accuracy AUC and\nsteps to the "
  "threshold alike (95% upper bound {}:",
  BITS,
  lambda: (*_bits().aa_rate("final_accuracy")[:2], _bits().aa_rate("final_accuracy")[4]),
)
fact(
  LAG,
  "steps to the threshold alike (95% upper bound",
  BITS,
  lambda: (
    len({_bits().aa_rate(k)[:2] for k in ("final_accuracy", "accuracy_auc", "steps_to_threshold")})
    == 1
  ),
)
claim(
  LAG,
  "It collapses in {}, {} and {}\n  of 12 runs at interval 20, the constant lag 256 and offline, "
  "and differs\n  by {}, {} and {} from GRPO at the same lag (Holm `{m}`\n  there too)",
  BITS,
  lambda: (
    *(_bits().collapsed("reinforce", g) for g in _BITS_LAGS[1:]),
    *(_bits_same_lag("reinforce", g).diff.mean for g in _BITS_LAGS[1:]),
    _bits().same_lag("final_accuracy")["reinforce", "interval20"][1],
  ),
)
fact(
  LAG,
  "on-policy it is the same runs as REC-OneSide-NoIS.",
  BITS,
  lambda: (
    _bits().same(("reinforce", "onpolicy"), ("rec_oneside_nois", "onpolicy"))
    and all(
      _bits().same_lag("final_accuracy")["reinforce", g][1] == "worse" for g in _BITS_LAGS[1:]
    )
  ),
)
claim(
  LAG,
  "Its differences to on-policy GRPO are {}, {} and {} at\n  interval 20, the constant lag and "
  "offline, all `~`, and none passes the\n  equivalence test within 0.03 (TOST p {} to {}).",
  BITS,
  lambda: (
    *(_bits().diff("rec_oneside_nois", g).mean for g in _BITS_LAGS[1:]),
    min(_bits().tests["rec_oneside_nois", g][0].p_equivalent for g in _BITS_LAGS[1:]),
    max(_bits().tests["rec_oneside_nois", g][0].p_equivalent for g in _BITS_LAGS[1:]),
  ),
)
fact(
  LAG,
  "It collapses in no\n  run.",
  BITS,
  lambda: (
    all(_bits().collapsed("rec_oneside_nois", g) == 0 for g in _BITS_LAGS)
    and all(_bits().mark("rec_oneside_nois", g) == "~" for g in _BITS_LAGS[1:])
  ),
)
claim(
  LAG,
  "The constant lag 256 costs GRPO the most: {} [{}, {}] against\n  on-policy (p {}, Holm p {}: "
  "`{m}`), where REC-OneSide-NoIS ends {}\n  [{}, {}] above GRPO at the same lag (p {}, `{m}`).",
  BITS,
  lambda: (
    *ivs(_bits().diff("grpo", "const256")),
    _bits().tests["grpo", "const256"][0].p,
    _bits().tests["grpo", "const256"][1],
    _bits().mark("grpo", "const256"),
    *ivs(_bits_same_lag("rec_oneside_nois", "const256").diff),
    _bits_same_lag("rec_oneside_nois", "const256").p,
    _bits().same_lag("final_accuracy")["rec_oneside_nois", "const256"][1],
  ),
)
fact(
  LAG,
  "costs GRPO the most",
  BITS,
  lambda: min(_BITS_LAGS[1:], key=lambda g: _bits().mean("grpo", g)) == "const256",
)
claim(
  LAG,
  "collapses in none of its {}\n  runs here",
  BITS,
  lambda: (12 * len(_BITS_LAGS),),
)
fact(
  LAG,
  "collapses in none of its",
  BITS,
  lambda: all(_bits().collapsed("m2po", g) == 0 for g in _BITS_LAGS),
)

section(LAG, "## The default grid")
claim(
  LAG,
  "it collapses in\n  {} to {} of 12 runs at interval 20, the constant lag 256 and offline, Holm\n"
  "  `{m}` at each of them.",
  BITS,
  lambda: (
    min(_bits().collapsed("reinforce", g) for g in _BITS_LAGS[1:]),
    max(_bits().collapsed("reinforce", g) for g in _BITS_LAGS[1:]),
    _bits().mark("reinforce", "interval20"),
  ),
)
fact(
  LAG,
  "`worse` at each of them.",
  BITS,
  lambda: all(_bits().mark("reinforce", g) == "worse" for g in _BITS_LAGS[1:]),
)
fact(
  LAG,
  "On count_bits it is `~` on-policy GRPO at every lag, equivalence shown at\n  none.",
  BITS,
  lambda: all(_bits().mark("rec_oneside_nois", g) == "~" for g in _BITS_LAGS),
)
fact(
  LAG,
  "On count_bits neither M2PO collapses in any run, at any lag, and no M2PO\n  cell is shown "
  "different from on-policy GRPO",
  BITS,
  lambda: (
    all(
      _bits().collapsed(m, g) == 0 and _bits().mark(m, g) == "~"
      for m in ("m2po", "m2po_release")
      for g in _BITS_LAGS
    )
    and _bits().collapsed("grpo", "const256") == 0
  ),
)

LR_AA = "lag_study_lr_aa/study.csv"
_lr_aa = lambda: S("lag_study_lr_aa")


def _lr_cells() -> list[tuple[str, str]]:
  return [(m, g) for m in _lr().main for g in _lr().lags]


def _lr_marks_changed() -> list[tuple[str, str]]:
  return [c for c in _lr_cells() if _lr().mark(*c) != _lr_aa().mark(*c)]


section(LAG, "## Learning-rate sensitivity")
claim(
  LAG,
  "The A/A pairs give {}/{} false verdicts on final accuracy, accuracy AUC and\nsteps to the "
  "threshold alike (95% upper bound {}).",
  LR_AA,
  lambda: (*_lr_aa().aa_rate("final_accuracy")[:2], _lr_aa().aa_rate("final_accuracy")[4]),
)
fact(
  LAG,
  "steps to the threshold alike (95% upper bound 0.84). The rerun",
  LR_AA,
  lambda: (
    len({_lr_aa().aa_rate(k)[:2] for k in ("final_accuracy", "accuracy_auc", "steps_to_threshold")})
    == 1
  ),
)
claim(
  LAG,
  "recorded): warm start {} [{}, {}] against\n{}, every cell's final "
  "accuracy within {} of the first run's, collapse\ncounts within one run, and {} marks against "
  "the baseline change from `{m}`\nto `{m}`",
  LR_AA,
  lambda: (
    *ivs(_lr_aa().iv("narrow_lr3e-4", "onpolicy", "start_accuracy")),
    _lr().mean("narrow_lr3e-4", "onpolicy", "start_accuracy"),
    max(abs(_lr_aa().mean(*c) - _lr().mean(*c)) for c in _lr_cells()),
    len(_lr_marks_changed()),
    *{_lr().mark(*c) for c in _lr_marks_changed()},
    *{_lr_aa().mark(*c) for c in _lr_marks_changed()},
  ),
)
fact(
  LAG,
  "(REINFORCE, narrow and wide at 1e-4 on-policy, which are the same\nruns; narrow offline at "
  "1e-4 and 3e-4)",
  LR_AA,
  lambda: (
    sorted(_lr_marks_changed())
    == sorted(
      [
        ("reinforce_lr1e-4", "onpolicy"),
        ("narrow_lr1e-4", "onpolicy"),
        ("wide_lr1e-4", "onpolicy"),
        ("narrow_lr1e-4", "offline"),
        ("narrow_lr3e-4", "offline"),
      ]
    )
    and max(abs(_lr_aa().collapsed(*c) - _lr().collapsed(*c)) for c in _lr_cells()) == 1
    and _lr_aa().same(("narrow_lr1e-4", "onpolicy"), ("wide_lr1e-4", "onpolicy"))
  ),
)


@pytest.mark.parametrize("c", CLAIMS, ids=[_id(c) for c in CLAIMS])
def test_each_quoted_number_is_the_committed_data(c):
  errors = mismatches(read(c.doc), c)
  assert not errors, "\n".join(errors)


@pytest.mark.parametrize("f", FACTS, ids=[_id(f) for f in FACTS])
def test_each_stated_fact_holds_in_the_committed_data(f):
  where = f"{f.doc} ({f.section or 'anywhere'})"
  assert pattern(f.text).search(scope(read(f.doc), f.section)), f"{where}: not found: {f.text!r}"
  assert f.check(), f"{f.doc}: {f.text!r} does not hold in {f.source}"


def test_a_changed_number_or_mark_fails():
  c = Claim("doc.md", "", "gains {} [{}, {}], {m}", "x", lambda: (0.181, 0.082, 0.28, "worse"))
  assert not mismatches("On-policy GRPO gains +0.181 [+0.082, +0.280], worse.", c)
  assert not mismatches("gains 0.18\n[0.08, 0.3], worse", c)  # lower precision, a line break
  assert mismatches("gains +0.182 [+0.082, +0.280], worse", c)
  assert mismatches("gains +0.181 [+0.082, +0.280], better", c)
  assert mismatches("gains -0.181 [+0.082, +0.280], worse", c)
  assert mismatches("gains about +0.18, worse", c)  # the text itself changed
  assert agrees("4e-4", 4.3e-4) and not agrees("4e-4", 4.6e-4)
  assert agrees("3", 3) and not agrees("3", 4) and not agrees("3.0", 3)


def test_every_committed_study_is_checked_by_some_claim():
  cited = {s.split("/")[0] for c in CLAIMS for s in c.source.split(", ")}
  studies = {d for d in os.listdir(RESULTS) if os.path.isdir(os.path.join(RESULTS, d))}
  assert studies <= cited, f"no claim checks {sorted(studies - cited)}"
