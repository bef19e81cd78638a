"""support/calculator.py, the calculator tool: exact answers as the model reads them, errors with
their messages, and the bounds (length, nesting, digits), each hit quickly. No model, no files.
"""

import sys
import time

import pytest

from support import calculator as calc
from support.calculator import MAX_DEPTH, MAX_DIGITS, MAX_LENGTH, calculator

# The bounded cases run in microseconds; a case must still finish within HANG_GUARD_S seconds of
# wall time. This is a guard against hangs (an unbounded power or string conversion takes minutes
# or forever), not a benchmark: 1 s leaves room for a noisy, shared 2-core machine.
HANG_GUARD_S = 1.0


def raises_quickly(expression, message):
    """calculator(expression) raises ValueError whose message contains `message`, within
    HANG_GUARD_S seconds."""
    start = time.perf_counter()
    with pytest.raises(ValueError) as caught:
        calculator(expression)
    elapsed = time.perf_counter() - start
    assert message in str(caught.value)
    assert elapsed < HANG_GUARD_S, f"{expression[:40]!r} took {elapsed:.3f} s"


@pytest.mark.parametrize(
    "expression, expected",
    [
        # integers, in full
        ("123*45", "5535"),
        ("123 x 45", "5535"),
        ("123x45", "5535"),
        ("123 × 45", "5535"),
        ("(2+3)*4", "20"),
        ("2+3*4", "14"),
        ("10-2-3", "5"),
        ("100/10/5", "2"),
        ("3-15", "-12"),
        ("0", "0"),
        ("-0", "0"),
        ("007", "7"),
        # powers: right-associative, tighter than a unary minus on their left only
        ("-2**2", "-4"),
        ("(-2)**2", "4"),
        ("2**-2", "0.25"),
        ("2**-2**2", "0.0625"),
        ("2^10", "1024"),
        ("2**3**2", "512"),
        ("2^3^2", "512"),
        ("(2**3)**2", "64"),
        ("0**0", "1"),
        ("(1/2)**-3", "8"),
        ("(-1)**(10**300 + 1)", "-1"),
        ("1**(10**999)", "1"),
        ("4.0**2", "16"),
        # floor division and remainder, as in Python
        ("7//2", "3"),
        ("-7//2", "-4"),
        ("7%3", "1"),
        ("-7%3", "2"),
        ("7%-3", "-2"),
        ("7.5%2", "1.5"),
        ("7.5//2", "3"),
        # unary signs
        ("--1", "1"),
        ("+-+1", "-1"),
        ("-(-(3))", "3"),
        # exact decimals and fractions
        ("1/3", "0.3333333333"),
        ("2/3", "0.6666666667"),
        ("-1/3", "-0.3333333333"),
        ("0.1+0.2", "0.3"),
        ("10/4", "2.5"),
        ("7/2", "3.5"),
        ("6÷4", "1.5"),
        (".5", "0.5"),
        ("1.", "1"),
        ("1.50", "1.5"),
        ("3*(1/3)", "1"),
        ("0.1*3", "0.3"),
        ("1/7", "0.1428571429"),
        ("22/7", "3.142857143"),
        # rounding to 10 significant digits, halves away from zero, with a carry
        ("1.0000000005", "1.000000001"),
        ("1.00000000005", "1"),
        ("-1.0000000005", "-1.000000001"),
        ("9.99999999996", "10"),
        ("0.99999999999", "1"),
        # positional from 1e-6 to below 1e15, scientific outside
        ("10**-6", "0.000001"),
        ("1/3*10**-5", "0.000003333333333"),
        ("1/3*10**-6", "3.333333333e-7"),
        ("10**-7", "1e-7"),
        ("1.5*10**-7", "1.5e-7"),
        ("10**-999", "1e-999"),
        ("10**14+0.5", "100000000000000"),
        ("10**15+0.5", "1e+15"),
        ("10**20/3", "3.333333333e+19"),
        ("-(10**20/3)", "-3.333333333e+19"),
        ("123456789015/10", "12345678900"),
        # whitespace anywhere between tokens
        ("  1 +\t2\n* 3  ", "7"),
        (" ( 2 ) ** ( 3 ) ", "8"),
    ],
)
def test_values(expression, expected):
    assert calculator(expression) == expected


def test_deep_but_legal_nesting():
    assert calculator("(" * MAX_DEPTH + "1" + ")" * MAX_DEPTH) == "1"
    assert calculator("-" * MAX_DEPTH + "1") == "1"
    assert calculator("-" * (MAX_DEPTH - 1) + "1") == "-1"
    assert calculator("-(" * 25 + "2" + ")" * 25) == "-2"  # 50 levels: 25 signs, 25 parentheses
    assert calculator("**".join(["1"] * (MAX_DEPTH + 1))) == "1"


def test_the_deepest_legal_nesting_stays_far_from_the_recursion_limit():
    # The worst legal case, a level for each parenthesis (the exponent and its sign are the last
    # two), under a recursion limit only 400 frames above this one: no RecursionError (the
    # default limit is 1000).
    frames = 0
    frame = sys._getframe()
    while frame is not None:
        frames, frame = frames + 1, frame.f_back
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(frames + 400)
    try:
        assert calculator("(" * (MAX_DEPTH - 2) + "2**-1" + ")" * (MAX_DEPTH - 2)) == "0.5"
    finally:
        sys.setrecursionlimit(limit)


def test_boundaries_of_length_and_digits():
    # A 1000-digit result is allowed, 1001 digits are not; the same for a denominator.
    assert calculator("10**999") == "1" + "0" * 999
    assert len(calculator("10**999")) == MAX_DIGITS
    assert len(calculator("-(10**999)")) == MAX_DIGITS + 1
    assert calculator("10**999 - 1") == "9" * 999
    raises_quickly("10**1000", "result too large (more than 1000 digits)")
    raises_quickly("10**999 * 10", "result too large (more than 1000 digits)")
    raises_quickly("10**999 * 9 + 10**999", "result too large (more than 1000 digits)")
    raises_quickly("10**-1000", "result too precise")
    raises_quickly("10**-999 / 10", "result too precise")
    # A MAX_LENGTH-character expression is read, one more character is not.
    assert calculator("1" * MAX_LENGTH) == "1" * MAX_LENGTH
    raises_quickly("1" * (MAX_LENGTH + 1), "expression too long (more than 500 characters)")


@pytest.mark.parametrize(
    "expression, message",
    [
        ("", "empty expression"),
        ("   \t\n", "empty expression"),
        ("import os", "unexpected 'import' at position 0"),
        ("__import__('os')", "unexpected '__import__' at position 0"),
        ("1+a", "unexpected 'a' at position 2"),
        ("sqrt(4)", "unexpected 'sqrt' at position 0"),
        ("2xx3", "unexpected 'xx' at position 1"),
        ("x", "unexpected 'x' at position 0"),
        ("1e5", "unexpected 'e' at position 1"),
        ("x=1", "unexpected '=' at position 1"),
        ("1=1", "unexpected '=' at position 1"),
        ("1,234", "unexpected ',' at position 1"),
        ("2²", "unexpected '²' at position 1"),
        ("٣+1", "unexpected '٣' at position 0"),
        ("1/0", "division by zero"),
        ("1//0", "division by zero"),
        ("1%0", "division by zero"),
        ("1/(2-2)", "division by zero"),
        ("0**-1", "division by zero"),
        ("(1+2", "missing ')' for the '(' at position 0"),
        ("((1)", "missing ')' for the '(' at position 0"),
        ("1+2)", "unmatched ')' at position 3"),
        (")", "unmatched ')' at position 0"),
        ("()", "unmatched ')' at position 1"),
        ("1+", "unexpected end of expression"),
        ("-", "unexpected end of expression"),
        ("2**", "unexpected end of expression"),
        ("*2", "unexpected '*' at position 0"),
        ("1 2", "unexpected '2' at position 2"),
        ("2(3)", "unexpected '(' at position 1"),
        ("2 * * 3", "unexpected '*' at position 4"),
        ("1.2.3", "unexpected '.3' at position 3"),
        (".", "unexpected '.' at position 0"),
        ("2**0.5", "only whole-number exponents"),
        ("4**(1/2)", "only whole-number exponents"),
    ],
)
def test_errors(expression, message):
    raises_quickly(expression, message)


def test_a_non_string_is_an_error():
    with pytest.raises(ValueError, match="expected the expression as a string"):
        calculator(None)


@pytest.mark.parametrize(
    "expression, message",
    [
        ("9**9**9", "result too large (more than 1000 digits)"),
        ("2**100000", "result too large (more than 1000 digits)"),
        ("10**1001", "result too large (more than 1000 digits)"),
        ("2**3**3**3", "result too large (more than 1000 digits)"),
        ("(10**999)**(10**999)", "result too large (more than 1000 digits)"),
        ("(-3)**100000", "result too large (more than 1000 digits)"),
        ("0.5**100000", "result too precise"),
        ("2**-100000", "result too precise"),
        ("(2/3)**5000", "result too large"),
        ("10**400 * 10**400 * 10**300", "result too large (more than 1000 digits)"),
        ("9" * 10000, "expression too long (more than 500 characters)"),
        ("1+" * 5000 + "1", "expression too long (more than 500 characters)"),
        ("9" * 600 + "*" + "9" * 600, "expression too long (more than 500 characters)"),
        ("(" * 60 + "1" + ")" * 60, "expression nested too deeply (more than 50 levels)"),
        ("(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1), "nested too deeply"),
        ("-" * 60 + "1", "expression nested too deeply (more than 50 levels)"),
        ("-" * (MAX_DEPTH + 1) + "1", "nested too deeply"),
        ("**".join(["1"] * (MAX_DEPTH + 2)), "nested too deeply"),
        ("(" * 400 + "1", "nested too deeply"),
    ],
)
def test_bounded_errors_are_quick(expression, message):
    raises_quickly(expression, message)


def test_a_600_digit_literal_squared_is_too_large(monkeypatch):
    # Within MAX_LENGTH such a literal cannot be written (above); with a longer limit it is read,
    # and its square (1200 digits) is refused by the digit limit.
    monkeypatch.setattr(calc, "MAX_LENGTH", 5000)
    nines = "9" * 600
    assert calculator(nines) == nines
    raises_quickly(f"{nines}*{nines}", "result too large (more than 1000 digits)")
    raises_quickly(f"{nines}**2", "result too large (more than 1000 digits)")
    raises_quickly(f"(1/{nines})**2", "result too precise")
