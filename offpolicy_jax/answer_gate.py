"""A safe-grammar gate for answers that a verifier would evaluate.

Some verifiers call `eval`, `sympy.parse_expr` or `sympify` on the model's
answer (see `tasks.rgym.EVALUATING_DATASETS`). Before such a verifier sees an
answer, the answer must parse (`ast.parse(..., mode="eval")`) into a tree made
only of:

- literals: numbers (at most 100 digits), strings and bytes (at most 10,000
  characters), `True`/`False`/`None`;
- containers: tuples, lists, sets and dicts of allowed nodes;
- names that are not dunders (`x`, `C`, `ABCD`; a bare name cannot run code);
- arithmetic, comparison and boolean operators, with `**` exponents limited to
  numeric constants of magnitude <= 64 or names (`2**2**2**2**2**2` is refused);
- calls, only for `expression` gates, only of a bare name from `MATH_FUNCTIONS`
  with allowed arguments (`sin(x)`, `sqrt(2)`; never `__import__(...)`, never an
  attribute).

The accepted tree is re-serialised with `ast.unparse`, and that text is what
the verifier evaluates: nothing outside the grammar can reach `eval`. Anything
else is refused (`gate` returns None; the reward scores 0), with one exception
for `literal` gates: text that is not Python at all passes unchanged, because
`eval` compiles before it runs anything and such text can only raise
SyntaxError (this keeps exact-match answers like `"1 2\\n3 4"` scoring).
"""

import ast

# Functions an `expression` answer may call (sympy names used by the datasets' answers).
MATH_FUNCTIONS = frozenset(
  "sin cos tan cot sec csc asin acos atan acot sinh cosh tanh asinh acosh atanh exp log ln "
  "sqrt cbrt Abs abs factorial binomial floor ceiling sign erf gamma Rational Integer".split()
)
_MAX_CHARS = 10_000
_MAX_NODES = 2_000
_MAX_DIGITS = 100
_MAX_EXPONENT = 64
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


def _check_constant(node: ast.Constant) -> None:
  v = node.value
  if isinstance(v, bool) or v is None:
    return
  if isinstance(v, int) and len(str(abs(v))) > _MAX_DIGITS:
    raise _Refused("integer literal too long")
  if isinstance(v, complex) or (isinstance(v, (str, bytes)) and len(v) > _MAX_CHARS):
    raise _Refused("literal not allowed")
  if not isinstance(v, (int, float, str, bytes)):
    raise _Refused(f"constant {type(v).__name__} not allowed")


def _check_pow(node: ast.BinOp) -> None:
  e = node.right
  if isinstance(e, ast.UnaryOp) and isinstance(e.op, (ast.USub, ast.UAdd)):
    e = e.operand
  if isinstance(e, ast.Name):
    return
  if (
    isinstance(e, ast.Constant)
    and isinstance(e.value, (int, float))
    and not isinstance(e.value, bool)
  ):
    if abs(e.value) <= _MAX_EXPONENT:
      return
  raise _Refused("exponent must be a name or a number of magnitude <= 64")


def _check(tree: ast.AST, calls: frozenset[str]) -> None:
  nodes = list(ast.walk(tree))
  if len(nodes) > _MAX_NODES:
    raise _Refused("expression too large")
  for node in nodes:
    if isinstance(node, ast.Constant):
      _check_constant(node)
    elif isinstance(node, ast.Name):
      if node.id.startswith("__") or not isinstance(node.ctx, ast.Load):
        raise _Refused(f"name {node.id!r} not allowed")
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
      _check_pow(node)
    elif isinstance(node, ast.Call):
      if not (isinstance(node.func, ast.Name) and node.func.id in calls) or node.keywords:
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
    _check(tree, MATH_FUNCTIONS if kind == "expression" else frozenset())
    return ast.unparse(tree)
  except (_Refused, RecursionError):
    return None
