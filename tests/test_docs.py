"""No dangling references: every repository file the text files name exists.

Scans the repository's text files (`git ls-files`, untracked ones not ignored
included; .py, .md, .ipynb, .toml, .cfg, .txt; binary files skipped) for the
paths `docs/<name>.md`, `configs/<name>.py`, `experiments/<name>.py`,
`benchmarks/<name>.py`, `colab/<name>.ipynb`, the bare top-level notes
(`<NAME>.md` for DESIGN, SCIENCE and STYLE) and, in markdown, relative link
targets, and fails naming the file and line of each one that is not a file of
the repository.
"""

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT_SUFFIXES = (".py", ".md", ".ipynb", ".toml", ".cfg", ".txt")

# A path starts a word: "/tmp/run/configs/x.py" or "a_docs/x.md" is no repository path.
REFERENCE = re.compile(
  r"(?<![\w/.-])("
  r"docs/[\w.-]+\.md|configs/[\w.-]+\.py|experiments/[\w.-]+\.py|benchmarks/[\w.-]+\.py"
  r"|colab/[\w.-]+\.ipynb|(?:DESIGN|SCIENCE|STYLE)\.md"
  r")(?![\w/-])"
)
# A markdown link target that is neither a URL nor an anchor of the same page.
MARKDOWN_LINK = re.compile(r"\]\((?![a-z][a-z0-9+.-]*:|#)([^)\s#]+)")

# (file, reference) pairs that name a missing file on purpose.
ALLOWED = {
  # The scan's own test: one missing path of each kind, which it must find.
  ("tests/test_docs.py", "docs/nope.md"),
  ("tests/test_docs.py", "configs/nope.py"),
  ("tests/test_docs.py", "colab/nope.ipynb"),
  ("tests/test_docs.py", "STYLE.md"),
  # A user's mistake the binaries must refuse in one line: a config file that does not exist.
  ("tests/test_cli.py", "configs/nope.py"),
}


def _repository_files() -> set[str]:
  """The repository's files: tracked, and untracked ones that are not ignored, that exist."""
  try:
    out = subprocess.run(
      ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
      cwd=ROOT,
      capture_output=True,
      check=True,
    ).stdout
  except (OSError, subprocess.CalledProcessError):
    pytest.skip("not a git checkout")
  names = {n.decode() for n in out.split(b"\0") if n}
  return {n for n in names if os.path.isfile(os.path.join(ROOT, n))}


def _text(path: str) -> str | None:
  """The file's text, or None for a binary one."""
  with open(os.path.join(ROOT, path), "rb") as f:
    data = f.read()
  if b"\0" in data:
    return None
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError:
    return None


def _references(path: str, line: str) -> list[tuple[str, str]]:
  """`(as written, repository path)` of each reference in one line of the file `path`."""
  refs = [(m.group(1), m.group(1)) for m in REFERENCE.finditer(line)]
  if path.endswith(".md"):
    for m in MARKDOWN_LINK.finditer(line):
      target = os.path.normpath(os.path.join(os.path.dirname(path), m.group(1)))
      refs.append((m.group(1), target.replace(os.sep, "/")))
  return refs


def test_the_scan_finds_each_kind_of_reference():
  line = "see docs/nope.md, configs/nope.py and colab/nope.ipynb (STYLE.md 7), [a](x.md)"
  assert [r for r, _ in _references("docs/losses.md", line)] == [
    "docs/nope.md",
    "configs/nope.py",
    "colab/nope.ipynb",
    "STYLE.md",
    "x.md",
  ]
  assert _references("docs/losses.md", "[b](../README.md#top) [c](https://x.org/y.md)") == [
    ("../README.md", "README.md")
  ]
  assert _references("x.py", "/tmp/run/configs/x.py, a_docs/x.md, docs/x.mdx") == []


def test_no_reference_names_a_missing_file():
  files = _repository_files()
  dangling = []
  for path in sorted(files):
    if not path.endswith(TEXT_SUFFIXES):
      continue
    text = _text(path)
    if text is None:
      continue
    for number, line in enumerate(text.splitlines(), 1):
      for written, target in _references(path, line):
        found = target in files or os.path.isdir(os.path.join(ROOT, target))
        if not found and (path, written) not in ALLOWED:
          dangling.append(f"{path}:{number}: {written}")
  assert not dangling, "references to files not in the repository:\n" + "\n".join(dangling)
