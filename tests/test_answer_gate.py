"""Tests for offpolicy_jax.answer_gate: what may reach a verifier's eval."""

import pytest

from offpolicy_jax.rewards.answer_gate import gate

ACCEPTED = [
  ("literal", "[1, 2,3]", "[1, 2, 3]"),
  ("literal", "[['Q', '_'], ['_', 'Q']]", "[['Q', '_'], ['_', 'Q']]"),
  ("literal", "ABCDE", "ABCDE"),  # a bare name cannot run code
  ("literal", "-3.5", "-3.5"),
  ("literal", "{'a': (1, 2)}", "{'a': (1, 2)}"),
  ("expression", "x**3/3 + C", "x ** 3 / 3 + C"),
  ("expression", "-2*X**2 + sin(X)*exp(2*X)", "-2 * X ** 2 + sin(X) * exp(2 * X)"),
  ("expression", "(8 - 3) * (2 + 2) + 4", "(8 - 3) * (2 + 2) + 4"),
  ("expression", "sqrt(2)/2", "sqrt(2) / 2"),
  ("expression", "x**-2", "x ** (-2)"),
  ("expression", "-4*(-2*x - 8)**(3/2)/3 + C", "-4 * (-2 * x - 8) ** (3 / 2) / 3 + C"),
  ("expression", "3*Integral(x**3*cos(3*x), x) + C", "3 * Integral(x ** 3 * cos(3 * x), x) + C"),
  ("expression", "2**(n + 1)", "2 ** (n + 1)"),  # symbolic exponents stay symbolic in sympy
  ("literal", "[1, 2] * 3", "[1, 2] * 3"),
  ("literal", "[[0] * 100] * 100", "[[0] * 100] * 100"),
  ("expression", "exp(2*x)*sin(x)", "exp(2 * x) * sin(x)"),
  ("expression", "E**2 + x**y", "E ** 2 + x ** y"),
]
# Not Python at all: eval would raise SyntaxError before running anything.
PASSED_THROUGH = ["1 2 3\n4 5 6", "_ Q _\nQ _ _", "the answer is 4"]
REFUSED = [
  ("literal", "__import__('os').system('touch pwned') or []"),
  ("literal", "[__import__('os').remove('x')]"),
  ("literal", "().__class__.__base__.__subclasses__()"),
  ("literal", "(lambda: 1)()"),
  ("literal", "[x for x in range(10**9)]"),
  ("literal", "f'{1}'"),
  ("literal", "__builtins__"),
  ("literal", "sin(1)"),  # calls only in expression gates
  ("literal", "9" * 101),
  ("literal", "a" * 10_001),
  ("expression", "2**2**2**2**2**2"),
  ("expression", "(2**2**2**2**2**2)"),
  ("expression", "10**1000"),
  ("expression", "open('x')"),
  ("expression", "exp(x).evalf()"),
  ("expression", "sin(x, evaluate=False)"),
  ("expression", "x!"),  # sympy-only syntax: refused, not passed through
  ("expression", "1 2 3"),
  ("expression", "(x := 1)"),
  ("expression", "[1, 2][0]"),
  # sympy functions sympify (evaluate) string arguments; parse_expr returns a bare string as is.
  ("expression", "sin(\"__import__('os').system('touch pwned')\")"),
  ("expression", "\"__import__('os').system('touch pwned')\""),
  # Work bombs for whoever evaluates the answer.
  ("expression", "(((((9**64)**64)**64)**64)**64)**64"),
  ("expression", "factorial(factorial(20))"),
  ("expression", "1e308 * 10"),
  ("literal", "[1] * 10**9"),
  ("literal", "'a' * n"),
  ("literal", "2**x"),  # in Python eval a name may be any global of the verifier's module
  # Shifts, chained repeats, growth functions and symbol-free exponents are bounded too.
  ("expression", "9 ** (1 << 40)"),
  ("expression", "x ** (1 << 1000000)"),
  ("expression", "(1 << 100000) ** 64"),
  ("literal", "[1] * (1 << 40)"),
  ("literal", "'a' * (1 << 40)"),
  ("literal", "[0] * 9999 * 9999"),
  ("expression", "exp(exp(exp(100)))"),
  ("expression", "exp(10**64)"),
  ("expression", "2**exp(100)"),
  ("expression", "E**(E**(E**E))"),
]


@pytest.mark.parametrize("kind,answer,expected", ACCEPTED)
def test_safe_answers_are_reserialised(kind, answer, expected):
  assert gate(answer, kind) == expected
  assert gate(expected, kind) == expected  # idempotent


@pytest.mark.parametrize("answer", PASSED_THROUGH)
def test_non_python_text_passes_literal_gates_unchanged(answer):
  assert gate(answer, "literal") == answer
  with pytest.raises(SyntaxError):
    compile(answer, "<answer>", "eval")


@pytest.mark.parametrize("kind,answer", REFUSED)
def test_unsafe_answers_are_refused(kind, answer):
  assert gate(answer, kind) is None


def test_deep_nesting_and_bad_kind():
  assert gate("(" * 10_000 + "1" + ")" * 10_000, "expression") is None
  assert gate("[" * 500 + "]" * 500, "literal") in (None, "[" * 500 + "]" * 500)
  with pytest.raises(ValueError, match="kind"):
    gate("1", "python")
