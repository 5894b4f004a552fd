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


def _log10(node: ast.AST) -> float | None:
  """log10 of |value| of a purely numeric subtree (no names, no calls), else None."""
  if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
    v = abs(node.value)
    return math.log10(v) if v else -math.inf
  if isinstance(node, ast.UnaryOp):
    return _log10(node.operand)
  if not isinstance(node, ast.BinOp):
    return None
  a, b = _log10(node.left), _log10(node.right)
  if a is None or b is None:
    return None
  if isinstance(node.op, (ast.Add, ast.Sub)):
    return max(a, b) + 0.302  # log10(2): |x +- y| <= 2 max(|x|, |y|)
  if isinstance(node.op, ast.Mult):
    return a + b
  if isinstance(node.op, ast.Pow):
    return a * _value(node.right)
  return a  # /, //, %: no larger than the dividend for |divisor| >= 1 (else refused below)


def _value(node: ast.AST) -> float:
  """|value| bound of a small numeric exponent (already checked to be <= 64 in magnitude)."""
  lg = _log10(node)
  return 0.0 if lg is None or lg == -math.inf else 10.0**lg


def _check_pow(node: ast.BinOp, symbolic_exponents: bool) -> None:
  e = _log10(node.right)
  if e is None:
    if symbolic_exponents:
      return
    raise _Refused("exponent must be a number")
  if e > math.log10(_MAX_EXPONENT):
    raise _Refused(f"exponent magnitude above {_MAX_EXPONENT}")
  lg = _log10(node)
  if lg is not None and lg > _MAX_LOG10:
    raise _Refused("number too large")


def _check_repeat(node: ast.BinOp) -> None:
  for seq, count in ((node.left, node.right), (node.right, node.left)):
    if isinstance(seq, (ast.List, ast.Tuple, ast.Constant)) and not isinstance(
      getattr(seq, "value", None), (int, float)
    ):
      lg = _log10(count)
      if lg is None or lg > math.log10(_MAX_REPEAT):
        raise _Refused("sequence repeated too often")


def _check_divisor(node: ast.BinOp) -> None:
  lg = _log10(node.right)
  if lg is not None and lg < 0 and (_log10(node.left) or 0) - lg > _MAX_LOG10:
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
      if isinstance(node.op, ast.Pow):
        _check_pow(node, symbolic_exponents=expression)
      elif isinstance(node.op, ast.Mult):
        _check_repeat(node)
      elif isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
        _check_divisor(node)
      if (lg := _log10(node)) is not None and lg > _MAX_LOG10:
        raise _Refused("number too large")
    elif isinstance(node, ast.Call):
      ok = expression and isinstance(node.func, ast.Name) and node.func.id in MATH_FUNCTIONS
      if not ok or node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
        raise _Refused("call not allowed")
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
