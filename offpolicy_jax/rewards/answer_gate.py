"""A safe-grammar gate for answers that a verifier would evaluate.

Some verifiers call `eval`, `sympy.parse_expr` or `sympify` on the model's
answer (see `tasks.rgym.EVALUATING_DATASETS`). Before such a verifier sees an
answer, the answer must parse (`ast.parse(..., mode="eval")`) into a tree made
only of:

- literals: numbers (at most 100 digits), `True`/`False`/`None`, and, for
  `literal` gates only, strings and bytes (at most 10,000 characters; sympy
  functions would sympify, i.e. evaluate, a string argument);
- containers: tuples, lists, sets and dicts of allowed nodes;
- names that are not dunders (`x`, `C`, `ABCD`; a bare name cannot run code);
- arithmetic, comparison and boolean operators, with bounds on what could
  blow up: a `**` exponent is a number of magnitude <= 64 (`x**(3/2)` is fine)
  or, for `expression` gates, a symbolic expression; a number raised to a
  number stays below 1e300 (`2**2**2**2**2**2` and `(9**64)**64` are refused);
  a sequence is repeated at most 10,000 times;
- calls, only for `expression` gates, only of a bare name from `MATH_FUNCTIONS`
  with allowed positional arguments (`sin(x)`, `sqrt(2)`; never
  `__import__(...)`, never an attribute).

The accepted tree is re-serialised with `ast.unparse`, and that text is what
the verifier evaluates: nothing outside the grammar can reach `eval`. Anything
else is refused (`gate` returns None; the reward scores 0), with one exception
for `literal` gates: text that is not Python at all passes unchanged, because
`eval` compiles before it runs anything and such text can only raise
SyntaxError (this keeps exact-match answers like `"1 2\\n3 4"` scoring).
"""

import ast
import math

# Functions an `expression` answer may call (sympy names used by the datasets' answers).
# No factorial/gamma: `factorial(factorial(20))` would hang whoever evaluates it.
MATH_FUNCTIONS = frozenset(
  "sin cos tan cot sec csc asin acos atan acot sinh cosh tanh asinh acosh atanh exp log ln "
  "sqrt cbrt Abs abs floor ceiling sign erf Rational Integral".split()
)
_MAX_CHARS = 10_000
_MAX_NODES = 2_000
_MAX_DIGITS = 100
_MAX_EXPONENT = 64
_MAX_LOG10 = 300.0
_MAX_REPEAT = 10_000
_OPERATOR_NODES = (
  ast.operator, ast.unaryop, ast.boolop, ast.cmpop, ast.expr_context, ast.Expression
)  # fmt: skip
_VALUE_NODES = (
  ast.Constant, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.Name, ast.UnaryOp, ast.BinOp,
  ast.BoolOp, ast.Compare,
)  # fmt: skip
KINDS = ("literal", "expression")


class _Refused(ValueError):
  pass


def _check_constant(node: ast.Constant, strings: bool) -> None:
  v = node.value
  if isinstance(v, bool) or v is None:
    return
  if isinstance(v, int) and len(str(abs(v))) > _MAX_DIGITS:
    raise _Refused("integer literal too long")
  if isinstance(v, (str, bytes)) and strings and len(v) <= _MAX_CHARS:
    return
  if not isinstance(v, (int, float)):
    raise _Refused(f"constant {type(v).__name__} not allowed")


# sympy names that stand for numbers (other names become free symbols).
_NUMERIC_NAMES = frozenset("E pi I EulerGamma GoldenRatio Catalan".split())
# Functions that outgrow their argument: a numeric argument is bounded, and they do not nest.
_GROWTH = frozenset({"exp", "sinh", "cosh"})
_MAX_GROWTH_ARG = 1000.0
_LOG10_2, _LOG10_E = math.log10(2), math.log10(math.e)


def _log10(node: ast.AST) -> float | None:
  """Upper bound of log10 |value| of a subtree without free symbols, else None."""
  if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
    v = abs(node.value)
    return math.log10(v) if v else -math.inf
  if isinstance(node, ast.Name):
    return 0.5 if node.id in _NUMERIC_NAMES else None
  if isinstance(node, ast.UnaryOp):
    return _log10(node.operand)
  if isinstance(node, ast.Call):
    args = [_log10(a) for a in node.args]
    known = [a for a in args if a is not None]
    if not args or len(known) < len(args):
      return None
    top = max(known)
    if isinstance(node.func, ast.Name) and node.func.id in _GROWTH:
      return _LOG10_E * 10.0**top
    return max(top, 0.0) + _LOG10_2  # the math functions allowed stay within ~|x| + 1
  if not isinstance(node, ast.BinOp):
    return None
  a, b = _log10(node.left), _log10(node.right)
  if a is None or b is None:
    return None
  op = node.op
  if isinstance(op, (ast.Add, ast.Sub, ast.BitOr, ast.BitXor)):
    return max(a, b) + _LOG10_2  # |x +- y| <= 2 max(|x|, |y|)
  if isinstance(op, ast.Mult):
    return a + b
  if isinstance(op, ast.Pow):
    return a * 10.0**b
  if isinstance(op, ast.LShift):
    return max(a, 0.0) + _LOG10_2 * 10.0**b
  return a  # /, //, %, >>, &: no larger than the left side (divisors checked below)


def _seq_log10(node: ast.AST) -> float | None:
  """log10 of the length of a sequence-valued subtree (list, tuple, string), else None."""
  if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
    return math.log10(max(len(node.elts), 1))
  if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
    return math.log10(max(len(node.value), 1))
  if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add)):
    a, b = _seq_log10(node.left), _seq_log10(node.right)
    if isinstance(node.op, ast.Add) and a is not None and b is not None:
      return max(a, b) + _LOG10_2
    if isinstance(node.op, ast.Mult) and (a is None) != (b is None):
      count = _log10(node.right if b is None else node.left)
      return math.inf if count is None else (a if b is None else b) + max(count, 0.0)  # type: ignore[operator]
  return None


def _free_symbols(node: ast.AST) -> bool:
  return any(isinstance(n, ast.Name) and n.id not in _NUMERIC_NAMES for n in ast.walk(node))


def _check_pow(node: ast.BinOp, symbolic_exponents: bool) -> None:
  e = _log10(node.right)
  if e is None:
    # sympy keeps x**y symbolic; a symbol-free exponent would be evaluated.
    if symbolic_exponents and _free_symbols(node.right):
      return
    raise _Refused("exponent must be a bounded number or contain a symbol")
  if e > math.log10(_MAX_EXPONENT):
    raise _Refused(f"exponent magnitude above {_MAX_EXPONENT}")


def _check_call(node: ast.Call, expression: bool) -> None:
  name = node.func.id if isinstance(node.func, ast.Name) else None
  if not (expression and name in MATH_FUNCTIONS) or node.keywords:
    raise _Refused("call not allowed")
  if any(isinstance(a, ast.Starred) for a in node.args):
    raise _Refused("call not allowed")
  if name in _GROWTH:
    for arg in node.args:
      if any(
        isinstance(n, ast.Call) and getattr(n.func, "id", "") in _GROWTH for n in ast.walk(arg)
      ):
        raise _Refused(f"nested {name}")
      lg = _log10(arg)
      if lg is not None and lg > math.log10(_MAX_GROWTH_ARG):
        raise _Refused(f"{name} argument too large")


def _check_binop(node: ast.BinOp, expression: bool) -> None:
  if isinstance(node.op, ast.Pow):
    _check_pow(node, symbolic_exponents=expression)
  elif isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
    lg = _log10(node.right)
    if lg is not None and lg < 0 and (_log10(node.left) or 0) - lg > _MAX_LOG10:
      raise _Refused("number too large")
  elif isinstance(node.op, (ast.Mult, ast.Add)):
    seq = _seq_log10(node)
    if seq is not None and seq > math.log10(_MAX_REPEAT):
      raise _Refused("sequence repeated too often")
  lg = _log10(node)
  if lg is not None and lg > _MAX_LOG10:
    raise _Refused("number too large")


def _check(tree: ast.AST, kind: str) -> None:
  nodes = list(ast.walk(tree))
  if len(nodes) > _MAX_NODES:
    raise _Refused("expression too large")
  expression = kind == "expression"
  for node in nodes:
    if isinstance(node, ast.Constant):
      _check_constant(node, strings=not expression)
    elif isinstance(node, ast.Name):
      if node.id.startswith("__") or not isinstance(node.ctx, ast.Load):
        raise _Refused(f"name {node.id!r} not allowed")
    elif isinstance(node, ast.BinOp):
      _check_binop(node, expression)
    elif isinstance(node, ast.Call):
      _check_call(node, expression)
    elif not isinstance(node, (*_VALUE_NODES, *_OPERATOR_NODES)):
      raise _Refused(f"{type(node).__name__} not allowed")


def gate(answer: str, kind: str) -> str | None:
  """The re-serialised `answer` if it is in the safe grammar of `kind`, else None.

  Args:
    answer: model answer text (already extracted from the response).
    kind: "literal" (Python literals, names and arithmetic: what `eval` sees in
      list/matrix answers) or "expression" (also calls of `MATH_FUNCTIONS`:
      what sympy's `parse_expr` sees).

  Returns:
    The text the verifier may evaluate, or None to score the answer 0.
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
  if len(answer) > _MAX_CHARS:
    return None
  try:
    tree = ast.parse(answer.strip(), mode="eval")
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    # Not Python: eval would raise SyntaxError before running anything. sympy's
    # parse_expr rewrites tokens before its eval, so expression gates refuse.
    return answer if kind == "literal" and "\x00" not in answer else None
  try:
    _check(tree, kind)
    return ast.unparse(tree)
  except (_Refused, RecursionError, OverflowError, ValueError):
    return None
