"""Reasoning-gym verifiers that evaluate the model's answer: the audit and the gate.

Some `score_answer` methods of reasoning-gym call `eval` or `sympy.parse_expr`
on the answer. `tasks.rgym.EVALUATING_DATASETS` lists them, and their answers
pass `answer_gate.gate` first; every reward also runs in a sandboxed worker.

1. The audit walks the AST of every reasoning-gym module, finds every call that
   can evaluate text (Python's `eval`/`exec`/`compile`/`__import__`, dynamic
   `getattr`, any call into sympy or a deserialiser, ...), and compares the call
   sites with `_REVIEWED`, a table reviewed by hand. A new release that adds an
   unreviewed call fails here; so does a dataset whose `score_answer` reaches a
   call that evaluates the answer but is missing from `EVALUATING_DATASETS`.
2. True answers of every gated dataset still score as the raw verifier scores them.
3. Injections score 0 and leave the file system untouched, in process and in
   the sandboxed workers; `expression` gates refuse Python code hidden in a
   string (sympy functions sympify, i.e. eval, string arguments).
"""

import ast
import collections
import functools
import importlib
import importlib.metadata
import inspect
import pathlib
from typing import NamedTuple

import pytest

from offpolicy_jax.rewards import answer_gate, tasks
from offpolicy_jax.rewards import scoring as rewards
from offpolicy_jax.rewards.tasks import rgym

reasoning_gym = pytest.importorskip("reasoning_gym")

# ----------------------------------------------------------------- the audit

# Callees that evaluate text whatever their receiver (matched on the last name).
_EVALUATING_NAMES = frozenset(
  "eval exec compile __import__ literal_eval breakpoint globals locals vars import_module "
  "load loads unsafe_load full_load FunctionType CodeType parse_expr sympify S parse_latex "
  "latex2sympy parse_mathematica simplify nsimplify lambdify eval_expr stringify_expr "
  "Function".split()
)
# Any call into these modules (sympy functions sympify string arguments).
_EVALUATING_MODULES = frozenset(
  "sympy latex2sympy2 math_verify pickle marshal shelve dill cloudpickle yaml subprocess runpy "
  "ctypes code codeop numexpr builtins".split()
)
_OS_EXEC = frozenset(
  "system popen execv execve execl execlp execvp spawnl spawnv posix_spawn".split()
)
# Names also flagged when referenced without a call (`map(eval, xs)`, `f.__globals__`).
_REFERENCED = frozenset(
  "eval exec compile __import__ literal_eval sympify parse_expr __builtins__ __globals__ "
  "__subclasses__ __code__".split()
)
# Same names, but these modules' functions only parse data.
_NOT_EVALUATING = frozenset({"re.compile", "json.load", "json.loads", "yaml.safe_load"})
_DYNAMIC_ATTRIBUTES = frozenset({"getattr", "setattr", "delattr"})


class Site(NamedTuple):
  """One evaluating call: `module` (relative to the package), `function`, `call`."""

  module: str
  function: str  # qualified name of the enclosing function ("<module>" at top level)
  call: str  # "callee(first argument)" ("sympy.parse_expr(answer)"), or "name (referenced)"

  @property
  def key(self) -> str:
    return f"{self.function}: {self.call}"


def _dotted(node: ast.AST) -> list[str] | None:
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if isinstance(node, ast.Name):
    return [node.id, *reversed(parts)]
  return None


def _imports(tree: ast.Module) -> dict[str, str]:
  """Local name -> imported dotted name (`sp` -> `sympy`, `Eq` -> `sympy.Eq`)."""
  names = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for a in node.names:
        names[a.asname or a.name] = f"{node.module}.{a.name}"
  return names


class _SiteFinder(ast.NodeVisitor):
  def __init__(self, module: str, imports: dict[str, str]):
    self.module, self.imports = module, imports
    self.scope: list[str] = []
    self.sites: list[Site] = []
    self.functions: dict[str, ast.AST] = {}
    self._callees: set[int] = set()

  def _enter(self, node) -> None:
    self.scope.append(getattr(node, "name", "<lambda>"))
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      self.functions[".".join(self.scope)] = node
    self.generic_visit(node)
    self.scope.pop()

  visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = _enter

  def _add(self, call: str) -> None:
    self.sites.append(Site(self.module, ".".join(self.scope) or "<module>", call))

  def visit_Call(self, node: ast.Call) -> None:
    self._callees.add(id(node.func))
    parts = _dotted(node.func)
    name = parts[-1] if parts else getattr(node.func, "attr", None)
    qualified = None
    if parts and parts[0] in self.imports:
      qualified = ".".join([self.imports[parts[0]], *parts[1:]])
    root = qualified.split(".")[0] if qualified else None
    dynamic = name in _DYNAMIC_ATTRIBUTES and not (
      len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
    )
    if qualified not in _NOT_EVALUATING and (
      name in _EVALUATING_NAMES
      or dynamic
      or root in _EVALUATING_MODULES
      or (root == "os" and name in _OS_EXEC)
    ):
      callee = ".".join(parts) if parts else f"(...).{name}"
      self._add(f"{callee}({ast.unparse(node.args[0]) if node.args else ''})")
    self.generic_visit(node)

  def visit_Name(self, node: ast.Name) -> None:
    if node.id in _REFERENCED and id(node) not in self._callees:
      self._add(f"{node.id} (referenced)")

  def visit_Attribute(self, node: ast.Attribute) -> None:
    if node.attr in _REFERENCED and id(node) not in self._callees:
      self._add(".".join(_dotted(node) or ["(...)", node.attr]) + " (referenced)")
    self.generic_visit(node)


class _Package(NamedTuple):
  root: pathlib.Path
  sites: list[Site]
  functions: dict[tuple[str, str], ast.AST]  # (module, qualname) -> def
  modules: dict[str, str]  # module path -> import name


@functools.cache
def _package() -> _Package:
  root = pathlib.Path(reasoning_gym.__file__).resolve().parent
  sites, functions, modules = [], {}, {}
  for path in sorted(root.rglob("*.py")):
    rel = path.relative_to(root).as_posix()
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    finder = _SiteFinder(rel, _imports(tree))
    finder.visit(tree)
    sites += finder.sites
    functions.update({(rel, q): f for q, f in finder.functions.items()})
    modules[rel] = "reasoning_gym." + rel[: -len(".py")].replace("/", ".").removesuffix(".__init__")
  return _Package(root, sorted(set(sites)), functions, modules)


# The reviewed call sites: module -> {"function: callee(first argument)": verdict}.
# ("gated", dataset): the call evaluates the model answer; the dataset must be in
#   rgym.EVALUATING_DATASETS, with the gate kind `_GATE_KINDS` gives its callee.
# ("trusted", reason): it never sees the model answer.
_GEN = ("trusted", "generation time: evaluates strings the generator built from the RNG")
_GEN_SYMPY = ("trusted", "generation time: sympy calls on objects built from the RNG")
_GOLD = ("trusted", "scoring time, but on the dataset's own gold answer/metadata")
_SYMBOL = ("trusted", "Symbol(name) only names a symbol (no parsing); the name is gold metadata")
_SIMPLIFY = ("trusted", "on derivative - integrand: sympy objects, never a string")
_REGISTRY = ("trusted", "getattr with names from dir() of the package's generator module")
_REARC_DSL = ("trusted", "re-arc DSL reads co_argcount of its own functions (generation time)")
_BFIT = ("trusted", "BF-it, the package's compiler of its own bfit programs to Brainfuck")
_PROPOSITIONAL = ("trusted", "the package's own formula parser and simplifier: no eval")
_REVIEWED: dict[str, dict[str, tuple[str, str]]] = {
  "algebra/intermediate_integration.py": {
    "IntermediateIntegrationDataset.__getitem__: sympy.Symbol(rng.choice(self.config.symbols))": (
      _GEN_SYMPY
    ),
    "IntermediateIntegrationDataset.__getitem__: sympy.integrate(integrand)": _GEN_SYMPY,
    "IntermediateIntegrationDataset._generate_cyclic_integral: sympy.cos(x)": _GEN_SYMPY,
    "IntermediateIntegrationDataset._generate_cyclic_integral: sympy.exp(x)": _GEN_SYMPY,
    "IntermediateIntegrationDataset._generate_cyclic_integral: sympy.sin(x)": _GEN_SYMPY,
    "IntermediateIntegrationDataset._generate_exponential_substitution: sympy.exp(u)": _GEN_SYMPY,
    "IntermediateIntegrationDataset._generate_log_inverse_trig: sympy.asin(inner_coef * x)": (
      _GEN_SYMPY
    ),
    "IntermediateIntegrationDataset._generate_log_inverse_trig: sympy.atan(inner_coef * x)": (
      _GEN_SYMPY
    ),
    "IntermediateIntegrationDataset._generate_log_inverse_trig: sympy.ln(log_arg)": _GEN_SYMPY,
    # Function("sin"|"cos") names an undefined function; it parses nothing.
    "IntermediateIntegrationDataset._generate_polynomial_exp_trig: sympy.Function(func_type)": (
      _GEN_SYMPY
    ),
    "IntermediateIntegrationDataset._generate_polynomial_exp_trig: sympy.exp(x)": _GEN_SYMPY,
    "IntermediateIntegrationDataset._generate_radical_substitution: sympy.sqrt(u)": _GEN_SYMPY,
    "IntermediateIntegrationDataset._generate_repeated_parts: sympy.cos(x)": _GEN_SYMPY,
    "IntermediateIntegrationDataset._generate_repeated_parts: sympy.exp(x)": _GEN_SYMPY,
    "IntermediateIntegrationDataset._generate_repeated_parts: sympy.sin(x)": _GEN_SYMPY,
    "IntermediateIntegrationDataset._generate_trigonometric_substitution: sympy.cos(inner)": (
      _GEN_SYMPY
    ),
    "IntermediateIntegrationDataset._generate_trigonometric_substitution: sympy.sin(inner)": (
      _GEN_SYMPY
    ),
    "IntermediateIntegrationDataset.score_answer: sympy.Symbol('C')": _SYMBOL,
    "IntermediateIntegrationDataset.score_answer: sympy.Symbol(var)": _SYMBOL,
    # diff sympifies user_expr, which is whatever parse_expr(answer) returned (a str too).
    "IntermediateIntegrationDataset.score_answer: sympy.diff(user_expr)": (
      "gated",
      "intermediate_integration",
    ),
    "IntermediateIntegrationDataset.score_answer: sympy.parse_expr(answer)": (
      "gated",
      "intermediate_integration",
    ),
    "IntermediateIntegrationDataset.score_answer: sympy.parse_expr(metadata['integrand'])": _GOLD,
    "IntermediateIntegrationDataset.score_answer: sympy.simplify(derivative - integrand)": (
      _SIMPLIFY
    ),
  },
  "algebra/polynomial_equations.py": {
    "PolynomialEquationsDataset.__getitem__: Eq(polynomial_expanded)": _GEN_SYMPY,
    "PolynomialEquationsDataset.__getitem__: expand(polynomial_expr)": _GEN_SYMPY,
    "PolynomialEquationsDataset.__getitem__: solve(Eq(polynomial_expanded, 0))": _GEN_SYMPY,
    "PolynomialEquationsDataset._generate_polynomial_expr: Symbol(variable)": _GEN_SYMPY,
  },
  "algebra/polynomial_multiplication.py": {
    "PolynomialMultiplicationDataset.__getitem__: sp.expand(polynomial_expr)": _GEN_SYMPY,
    "PolynomialMultiplicationDataset.__getitem__: sp.prod(polynomial_terms)": _GEN_SYMPY,
    "PolynomialMultiplicationDataset._get_monomials: itermonomials(sym)": _GEN_SYMPY,
    "PolynomialMultiplicationDataset._get_monomials: "
    "sp.symbols(rng.choice(self.config.variables))": _GEN_SYMPY,
    "PolynomialMultiplicationDataset._get_monomials: sp.symbols(self.config.variables)": (
      _GEN_SYMPY
    ),
    "PolynomialMultiplicationDataset.score_answer: sp.parse_expr(answer)": (
      "gated",
      "polynomial_multiplication",
    ),
    "PolynomialMultiplicationDataset.score_answer: sp.parse_expr(entry['answer'])": _GOLD,
  },
  "algebra/simple_equations.py": {
    "SimpleEquationsDataset._generate_equation: Symbol(variable)": _GEN_SYMPY,
  },
  "algebra/simple_integration.py": {
    "SimpleIntegrationDataset.__getitem__: sympy.diff(polynomial)": _GEN_SYMPY,
    "SimpleIntegrationDataset._generate_polynomial: "
    "sympy.Symbol(rng.choice(self.config.symbols))": _GEN_SYMPY,
    "SimpleIntegrationDataset.score_answer: sympy.Symbol('C')": _SYMBOL,
    "SimpleIntegrationDataset.score_answer: sympy.Symbol(var)": _SYMBOL,
    # diff sympifies user_expr, which is whatever parse_expr(answer) returned (a str too).
    "SimpleIntegrationDataset.score_answer: sympy.diff(user_expr)": ("gated", "simple_integration"),
    "SimpleIntegrationDataset.score_answer: sympy.parse_expr(answer)": (
      "gated",
      "simple_integration",
    ),
    "SimpleIntegrationDataset.score_answer: sympy.parse_expr(metadata['integrand'])": _GOLD,
    "SimpleIntegrationDataset.score_answer: sympy.simplify(derivative - integrand)": _SIMPLIFY,
  },
  "algorithmic/binary_matrix.py": {
    "BinaryMatrixDataset.score_answer: eval(answer)": ("gated", "binary_matrix"),
  },
  "algorithmic/number_sorting.py": {
    # Only when the gold answer is not JSON; the model answer goes through json.loads.
    "NumberSortingDataset.score_answer: eval(entry['answer'])": _GOLD,
  },
  "algorithmic/spiral_matrix.py": {
    "SpiralMatrixDataset.score_answer: eval(answer)": ("gated", "spiral_matrix"),
  },
  "algorithmic/string_insertion.py": {
    "StringInsertionDataset.score_answer: eval(answer)": ("gated", "string_insertion"),
  },
  "arc/rearc_utils/utils.py": {
    "get_generators: getattr(generators)": _REGISTRY,
    "get_verifiers: getattr(verifiers)": _REGISTRY,
  },
  "arc/rearc_utils/dsl.py": {
    "lbind: function.__code__ (referenced)": _REARC_DSL,
    "rbind: function.__code__ (referenced)": _REARC_DSL,
  },
  "arithmetic/basic_arithmetic.py": {
    "eval_floordiv: eval(exp.replace('/', '//'))": _GEN,
  },
  "arithmetic/bitwise_arithmetic.py": {
    "generate_problem: eval(problem_str)": _GEN,
    # verify_solution(entry["metadata"]["problem"], answer): the answer goes to int(answer, 0).
    "verify_solution: eval(problem)": _GOLD,
  },
  "arithmetic/dice.py": {
    "compute_probability: simplify(ways)": ("trusted", "a local gcd helper named simplify"),
  },
  "arithmetic/gsm_symbolic/generators_00_49.py": {
    "generate_32.generate_example: eval(rng.choice(fractions))": _GEN,
  },
  "arithmetic/gsm_symbolic/generators_50_99.py": {
    "generate_69.generate_from_variables: eval(fraction)": _GEN,
  },
  "arithmetic/gsm_symbolic/gsm_symbolic.py": {
    "GSMSymbolicDataset._load_generators: getattr(generators_00_49)": _REGISTRY,
    "GSMSymbolicDataset._load_generators: getattr(generators_50_99)": _REGISTRY,
  },
  "code/bf.py": {
    "BFDataset.compile_bfit_code_to_bf: Compiler.compile(bfit)": _BFIT,
  },
  "code/codeio.py": {
    "CodeIODataset._generate_io_pair: exec(full_code)": (
      "trusted",
      "generation time: runs the snippets shipped in codeio.jsonl.gz (package data, unsandboxed)",
    ),
  },
  "code/contrib/bfit/BF-it.py": {
    "compile_file: Compiler.compile(code)": _BFIT,
  },
  "code/contrib/bfit/Compiler/Compiler.py": {
    "compile: compiler.compile()": _BFIT,
  },
  "games/countdown.py": {
    "CountdownDataset._generate_candidate_expression: symbols(f'x_{0}:{num_terms}')": _GEN_SYMPY,
    "CountdownDataset.score_answer: parse_expr(answer)": ("gated", "countdown"),
  },
  "games/n_queens.py": {
    "NQueensDataset.score_answer: eval(answer)": ("gated", "n_queens"),
  },
  "games/puzzle24.py": {
    "Puzzle24Dataset._generate_candidate_expression: symbols(f'x:{num_terms}')": _GEN_SYMPY,
    "Puzzle24Dataset.score_answer: parse_expr(answer)": ("gated", "puzzle24"),
  },
  "geometry/advanced_geometry.py": {
    "AdvancedGeometryDataset._build_angle_measure_task: Point(0)": _GEN_SYMPY,
    "AdvancedGeometryDataset._build_angle_measure_task: sympy.acos(cos_theta)": _GEN_SYMPY,
    "AdvancedGeometryDataset._build_incircle_radius_task: "
    "sympy.sqrt(s * (s - a) * (s - b) * (s - c))": _GEN_SYMPY,
    "AdvancedGeometryDataset._build_orthocenter_task: sympy.Line(B)": _GEN_SYMPY,
    "AdvancedGeometryDataset._build_orthocenter_task: sympy.Line(C)": _GEN_SYMPY,
    "AdvancedGeometryDataset._generate_non_degenerate_triangle: Point(x)": _GEN_SYMPY,
  },
  "induction/list_functions/list_functions.py": {
    "ListFunctionsDataset._load_generators: getattr(generators)": _REGISTRY,
  },
  "logic/propositional_logic.py": {
    "Expression.from_string: parse_expr(expr)": _PROPOSITIONAL,
    "Expression.simplify: (...).simplify()": _PROPOSITIONAL,
    "Expression.simplify: self.left.simplify()": _PROPOSITIONAL,
    "Expression.simplify: self.right.simplify()": _PROPOSITIONAL,
    "PropositionalLogicDataset._find_valid_conclusion: (...).simplify()": _PROPOSITIONAL,
    "parse_expr: parse_expr(expr[1:-1])": _PROPOSITIONAL,
    "parse_expr: parse_expr(left_expr)": _PROPOSITIONAL,
    "parse_expr: parse_expr(right_expr)": _PROPOSITIONAL,
    "parse_expr: parse_expr(sub_expr)": _PROPOSITIONAL,
  },
}


def _verdict(site: Site) -> tuple[str, str] | None:
  return _REVIEWED.get(site.module, {}).get(site.key)


def _format(sites) -> str:
  return "\n".join(f"  {s.module}: {s.key!r}" for s in sorted(sites))


def test_every_evaluating_call_site_is_reviewed():
  found = set(_package().sites)
  unreviewed = sorted(s for s in found if _verdict(s) is None)
  reviewed = {Site(m, *k.split(": ", 1)) for m, keys in _REVIEWED.items() for k in keys}
  stale = sorted(reviewed - found)
  version = importlib.metadata.version("reasoning-gym")
  message = []
  if unreviewed:
    message.append(
      f"reasoning-gym {version} has evaluating call sites that nobody reviewed:\n"
      f"{_format(unreviewed)}\nRead each one. If it can see the model answer, add its dataset "
      "to offpolicy_jax.tasks.rgym.EVALUATING_DATASETS and mark it ('gated', dataset) in "
      "_REVIEWED; otherwise mark it ('trusted', reason)."
    )
  if stale:
    message.append(f"_REVIEWED lists call sites that no longer exist:\n{_format(stale)}")
  assert not message, "\n".join(message)


# Gate kind a gated call needs: eval sees Python literals, sympy sees expressions.
_GATE_KINDS = {"eval": "literal", "parse_expr": "expression", "sympify": "expression"}


def test_gated_call_sites_are_gated_with_their_kind():
  problems = []
  for module, keys in _REVIEWED.items():
    for key, (verdict, dataset) in keys.items():
      if verdict != "gated":
        continue
      callee = key.split(": ", 1)[1].split("(", 1)[0].split(".")[-1]
      want = _GATE_KINDS.get(callee, "expression")
      got = rgym.EVALUATING_DATASETS.get(dataset)
      if got != want:
        problems.append(f"  {module}: {key!r} needs EVALUATING_DATASETS[{dataset!r}] = {want!r}")
  assert not problems, "gated call sites without the right gate:\n" + "\n".join(problems)


# ------------------------------------------------------- what score_answer reaches


def _function_id(obj) -> tuple[str, str] | None:
  """(module path, qualname) of a package function, else None."""
  obj = getattr(obj, "__func__", obj)
  obj = getattr(obj, "fget", obj)
  if not inspect.isfunction(obj):
    return None
  try:
    rel = pathlib.Path(inspect.getsourcefile(obj)).resolve().relative_to(_package().root)
  except (TypeError, ValueError):
    return None
  return rel.as_posix(), obj.__qualname__.replace(".<locals>", "")


def _neighbours(module) -> set[str]:
  """Package module paths that `module` imports names from (and itself)."""
  out = set()
  for value in [module, *vars(module).values()]:
    src = getattr(value, "__file__", None) or getattr(inspect.getmodule(value), "__file__", None)
    if src:
      try:
        out.add(pathlib.Path(src).resolve().relative_to(_package().root).as_posix())
      except ValueError:
        pass
  return out


def _is_super(node: ast.AST) -> bool:
  return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "super"


def _callees(fid: tuple[str, str], cls: type) -> set[tuple[str, str]]:
  """Package functions that function `fid` of dataset `cls` may call.

  `self.f`/`cls.f`/`super().f` resolve on `cls`, names and dotted names on the
  module's namespace; a method of an unknown receiver (`board.move(...)`) stands
  for every function of that name in the module and the package modules it
  imports from (an over-approximation).
  """
  pkg = _package()
  module = importlib.import_module(pkg.modules[fid[0]])
  near = _neighbours(module)
  out = set()
  for call in ast.walk(pkg.functions[fid]):
    if not isinstance(call, ast.Call):
      continue
    parts = _dotted(call.func) or []
    name = parts[-1] if parts else getattr(call.func, "attr", None)
    targets = []
    if parts[:1] in (["self"], ["cls"]) and len(parts) == 2:
      targets = [inspect.getattr_static(cls, name, None)]
    elif isinstance(call.func, ast.Attribute) and _is_super(call.func.value):
      targets = [k.__dict__.get(name) for k in cls.__mro__]
    elif parts and parts[0] in vars(module):
      obj = vars(module)[parts[0]]
      for attr in parts[1:]:
        obj = inspect.getattr_static(obj, attr, None)
      targets = [obj]
    targets = [t.__dict__.get("__init__") if inspect.isclass(t) else t for t in targets]
    ids = {i for i in map(_function_id, targets) if i in pkg.functions}
    if not ids and name and not any(inspect.isclass(t) for t in targets):
      ids = {k for k in pkg.functions if k[0] in near and k[1].rsplit(".", 1)[-1] == name}
    out |= ids
  return out


def _reached_sites(cls: type) -> set[Site]:
  """Evaluating call sites in `cls.score_answer` and the package functions it may call."""
  start = _function_id(cls.score_answer)
  seen, todo = {start}, [start]
  while todo:
    for fid in _callees(todo.pop(), cls) - seen:
      seen.add(fid)
      todo.append(fid)
  return {
    s
    for s in _package().sites
    if any(s.module == m and (s.function == q or s.function.startswith(q + ".")) for m, q in seen)
  }


# Datasets whose score_answer calls another dataset's score_answer at run time.
_DELEGATING = {
  "composite": "scores with entry['metadata']['source_dataset'], which rgym.score gates"
}


def test_datasets_whose_verifier_reaches_a_gated_call_are_gated():
  from reasoning_gym.factory import DATASETS

  problems, gated_by = [], collections.defaultdict(set)
  for name, (cls, _) in sorted(DATASETS.items()):
    if name in _DELEGATING:
      continue
    for site in sorted(_reached_sites(cls)):
      verdict = _verdict(site)
      if verdict is not None and verdict[0] == "gated":
        gated_by[name].add(site)
        if name not in rgym.EVALUATING_DATASETS:
          problems.append(f"  {name} reaches {site.module}: {site.key!r} but is not gated")
  for name in sorted(set(rgym.EVALUATING_DATASETS) - set(gated_by)):
    problems.append(f"  {name} is in EVALUATING_DATASETS but reaches no gated call site")
  for module, keys in _REVIEWED.items():
    for key, (verdict, dataset) in keys.items():
      if verdict == "gated" and Site(module, *key.split(": ", 1)) not in gated_by[dataset]:
        problems.append(f"  {dataset}'s score_answer does not reach {module}: {key!r}")
  assert not problems, "EVALUATING_DATASETS disagrees with the call graph:\n" + "\n".join(problems)


def test_delegating_datasets_are_gated_by_source_dataset():
  from reasoning_gym.factory import DATASETS

  assert set(_DELEGATING) <= set(DATASETS)
  example = {"question": "", "answer": "", "metadata": {"source_dataset": "n_queens"}}
  text = "<answer>__import__('os').getpid()</answer>"
  # The gate refuses before the (unconfigured) composite dataset is ever built.
  assert rgym.score(example, text, dataset_name="composite", seed=0, size=1, kwargs_json="{}") == 0


# ----------------------------------------------------------------- behaviour

_TRAIN_SIZE = 20
_NUM_TRUE = 10
_DATASETS = sorted(rgym.EVALUATING_DATASETS)


@functools.cache
def _task(name: str):
  return tasks.get_task(f"reasoning_gym:{name}", seed=0, train_size=_TRAIN_SIZE, eval_size=2)


def _score_in_process(name: str, example, text: str) -> float:
  return rgym.score(example, text, dataset_name=name, seed=0, size=_TRAIN_SIZE, kwargs_json="{}")


def _raw_scores(name: str, examples) -> list[float]:
  dataset = reasoning_gym.create_dataset(name, seed=0, size=_TRAIN_SIZE)
  return [float(dataset.score_answer(ex["answer"], entry=ex)) for ex in examples]


@pytest.mark.parametrize("name", _DATASETS)
def test_true_answers_score_through_the_gate(name):
  task = _task(name)
  examples = [task.train_source[i] for i in range(_NUM_TRUE)]
  texts = [f"<answer>{ex['answer']}</answer>" for ex in examples]
  # rgym.score picks the gate by this name: it must be the dataset's own.
  assert {ex["metadata"]["source_dataset"] for ex in examples} == {name}
  raw = _raw_scores(name, examples)
  kind = rgym.EVALUATING_DATASETS[name]
  refused = [ex["answer"] for ex in examples if answer_gate.gate(ex["answer"], kind) is None]
  assert not refused, f"{name}: the {kind!r} gate refuses true answers {refused}"
  assert [_score_in_process(name, ex, t) for ex, t in zip(examples, texts, strict=True)] == raw
  direct = [task.reward(ex, t) for ex, t in zip(examples[:2], texts[:2], strict=True)]
  assert direct == pytest.approx(raw[:2])
  res = rewards.score_batch(task.reward, examples, texts, timeout_s=5)
  assert not res.failed.any(), res.errors
  assert res.scores.tolist() == pytest.approx(raw)


def _injections(pwned: pathlib.Path, keep: pathlib.Path) -> list[str]:
  touch = f"__import__('os').system('touch {pwned}')"
  return [
    touch,
    f"__import__('os').remove('{keep}')",
    f"[{touch}]",
    f"(lambda: __import__('os'))().system('touch {pwned}')",
    "().__class__.__base__.__subclasses__()",
  ]


_POWER_TOWER = "2**2**2**2**2**2"


def _string_injections(pwned: pathlib.Path, keep: pathlib.Path) -> list[str]:
  """Python code in a string: sympy functions (and diff of a parsed str) sympify, i.e. eval, it."""
  return [
    f"\"__import__('os').system('touch {pwned}')\"",
    f"sin(\"__import__('os').system('touch {pwned}')\")",
    f"Abs(\"__import__('os').remove('{keep}')\")",
  ]


@pytest.fixture
def files(tmp_path, name):
  """(file an injection would create, file an injection would remove) for dataset `name`."""
  keep = tmp_path / "keep"
  keep.write_text("keep")
  return tmp_path / f"pwned_{name}", keep


def _untouched(pwned: pathlib.Path, keep: pathlib.Path) -> None:
  assert not pwned.exists(), f"an injection created {pwned}"
  assert keep.exists(), f"an injection removed {keep}"


@pytest.mark.parametrize("name", _DATASETS)
def test_injections_do_nothing_in_the_sandbox(name, files):
  pwned, keep = files
  task = _task(name)
  example = task.train_source[0]
  refused = [f"<answer>{a}</answer>" for a in [*_injections(pwned, keep), _POWER_TOWER]]
  texts = refused + [f"<answer>{a}</answer>" for a in _string_injections(pwned, keep)]
  for text in refused:
    assert task.reward(example, text) == 0.0, text
  res = rewards.score_batch(task.reward, [example] * len(texts), texts, timeout_s=5)
  assert not res.failed.any(), res.errors
  assert res.scores[: len(refused)].tolist() == [0.0] * len(refused)
  # countdown and puzzle24 give 0.01 to any answer their verifier cannot parse.
  assert res.scores[len(refused) :].max() <= 0.01
  _untouched(pwned, keep)


@pytest.mark.parametrize("name", _DATASETS)
def test_injections_are_refused_in_process(name, files):
  pwned, keep = files
  example = _task(name).train_source[0]
  kind = rgym.EVALUATING_DATASETS[name]
  for answer in _injections(pwned, keep):
    assert answer_gate.gate(answer, kind) is None, answer
    assert _score_in_process(name, example, f"<answer>{answer}</answer>") == 0.0, answer
  assert answer_gate.gate(_POWER_TOWER, kind) is None
  _untouched(pwned, keep)


@pytest.mark.parametrize(
  "name", [n for n in _DATASETS if rgym.EVALUATING_DATASETS[n] == "expression"]
)
def test_expression_gate_refuses_code_in_strings(name, files):
  # Only the gate is called: an accepted string would run its code in this process.
  kind = rgym.EVALUATING_DATASETS[name]
  passed = [a for a in _string_injections(*files) if answer_gate.gate(a, kind) is not None]
  assert not passed, f"the {kind!r} gate lets through {passed}; parse_expr would run the string"
