"""The built-in calculator tool: calculator("123*45") returns "5535". A model calls it in the middle
of a completion during training, so it must be safe (no eval, ast or compile: a hand-written
recursive-descent parser that knows arithmetic and nothing else) and cheap on any input (every
size is bounded, and checked before the work that could exceed it).

Grammar (Python's precedence and associativity):

    expression := term (("+" | "-") term)*
    term       := unary (("*" | "/" | "//" | "%") unary)*
    unary      := ("+" | "-") unary | power
    power      := atom (("**" | "^") unary)?
    atom       := number | "(" expression ")"
    number     := digits ["." [digits]] | "." digits          (123, 1.5, 1., .5)

- "**" and "^" are both the power, right-associative (2**3**2 is 2**9) and binding tighter than a
  unary minus on their left (-2**2 is -4) but not on their right (2**-2 is 0.25).
- "x" and "×" are also multiplication, "÷" also division (small models write them).
- "//" is floor division and "%" the remainder, as in Python (-7//2 is -4, -7%2 is 1, 7.5%2 is
  1.5).
- Whitespace may appear anywhere between tokens. Anything else is an error: letters and names
  (other than "x"), calls, "=", commas (no thousands separators: write 1234, not 1,234), non-ASCII
  digits, implicit multiplication ("2(3)").
- Exponents must be whole numbers (2**0.5 is an error); a negative one gives a fraction (2**-2 is
  0.25), and 0 to a negative power is a division by zero.

Arithmetic is exact, on fractions.Fraction: decimals are read exactly, so 0.1+0.2 is 0.3.

Output:

- An integer result: its digits in full, with a "-" when negative ("5535", "-12"), up to
  MAX_DIGITS digits.
- Any other result: rounded to 10 significant digits (halves away from zero), trailing zeros
  dropped. When its rounded magnitude is at least 1e-6 and below 1e15 it is written positionally
  ("0.3333333333", "3.5", "0.000001", "12345678900"); otherwise in scientific notation, a mantissa
  of 1 to 10 significant digits, "e", then the exponent with its sign ("3.333333333e+19",
  "1.5e-7"). So a non-integer of 1e10 or more shows no decimals, its digits past the tenth zeros
  (12345678901.5 is "12345678900"), and one very near an integer may read as that integer.

Errors raise ValueError with a short message the model reads, e.g. "division by zero",
"unexpected 'a' at position 3" (positions count characters from 0), "empty expression",
"result too large (more than 1000 digits)".

Bounds:

- MAX_LENGTH: the longest expression, in characters (checked first, before anything is read).
- MAX_DEPTH: the deepest nesting; each open parenthesis, unary sign and exponent goes one level
  deeper. Each level is at most 5 Python frames, far below the recursion limit.
- MAX_DIGITS: the most decimal digits of any number, literal, intermediate or result, in its
  numerator and in its denominator. Every operation first bounds the size of what it is about to
  compute from its operands' bit lengths (int.bit_length, instant) and refuses what is too big;
  only then does it compute, and the exact result is checked against the limit. For + - * / // %
  the operands are within the limit, so the work is at most a few thousand bits (microseconds); a
  power is refused from a lower bound on its size (9**9**9, 2**100000, 10**1001), so it only ever
  computes results of at most about twice the limit. Numbers never reach Python's int-to-str limit
  (4300 digits).
"""

from fractions import Fraction
from typing import NamedTuple

MAX_DIGITS = 1000  # the most decimal digits of a numerator or denominator, anywhere
MAX_LENGTH = 500  # the longest expression, in characters
MAX_DEPTH = 50  # the deepest nesting of parentheses, unary signs and exponents

# A number of at most MAX_DIGITS digits is below _LIMIT, which has _LIMIT_BITS bits (3322 for
# 1000 digits): 2**(_LIMIT_BITS - 1) <= _LIMIT < 2**_LIMIT_BITS.
_LIMIT = 10**MAX_DIGITS
_LIMIT_BITS = _LIMIT.bit_length()
# The largest intermediate an operation may compute before its result is reduced and checked:
# room for the product of two numbers within the limit, plus a margin.
_WORK_BITS = 2 * _LIMIT_BITS + 64

_TOO_LARGE = f"result too large (more than {MAX_DIGITS} digits)"
_TOO_PRECISE = f"result too precise (denominator of more than {MAX_DIGITS} digits)"

_DIGITS = "0123456789"  # ASCII only: str.isdigit would accept "²" and other scripts' digits
# Each operator as written, and the operator it means; the two-character ones are tried first.
_OPERATORS = {
    "**": "**",
    "//": "//",
    "+": "+",
    "-": "-",
    "*": "*",
    "/": "/",
    "%": "%",
    "^": "**",
    "×": "*",
    "÷": "/",
    "(": "(",
    ")": ")",
}
_SIGNIFICANT = 10  # significant digits of a non-integer result
_PLAIN_FROM, _PLAIN_BELOW = -6, 15  # powers of ten written positionally: 1e-6 <= |x| < 1e15


def calculator(arguments: str) -> str:
    """The value of the arithmetic expression `arguments`, as a string (see the module docstring
    for the grammar and the output format). Raises ValueError with a short message on any error."""
    if not isinstance(arguments, str):
        raise ValueError("expected the expression as a string")
    # Checked before reading anything, so the work below is bounded by the length too.
    if len(arguments) > MAX_LENGTH:
        raise ValueError(f"expression too long (more than {MAX_LENGTH} characters)")
    tokens = _tokenize(arguments)
    if len(tokens) == 1:  # only the end marker
        raise ValueError("empty expression")
    return _format(_Parser(tokens).parse())


# Tokens


class _Token(NamedTuple):
    """One token: kind "number", "op" or "end" (the end of the text, always last); op, the
    operator it means ("^" reads as "**", "x" and "×" as "*", "÷" as "/"; "" for a number or the
    end); text, as written (for messages); position, of its first character, from 0; value, a
    number's exact value."""

    kind: str
    op: str
    text: str
    position: int
    value: Fraction | None = None


def _tokenize(text: str) -> list[_Token]:
    """The tokens of `text`, ending with an "end" token; ValueError on any character or word
    that is not part of the grammar."""
    tokens = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch.isspace():
            i += 1
        elif ch in _DIGITS or ch == ".":
            end, value = _number(text, i)
            tokens.append(_Token("number", "", text[i:end], i, value))
            i = end
        elif text[i : i + 2] in _OPERATORS:
            tokens.append(_Token("op", _OPERATORS[text[i : i + 2]], text[i : i + 2], i))
            i += 2
        elif ch in _OPERATORS:
            tokens.append(_Token("op", _OPERATORS[ch], ch, i))
            i += 1
        elif ch.isalpha() or ch == "_":
            # A whole word at once, so that the message names it ("unexpected 'sqrt'"); "x" alone
            # is multiplication (2x3, 2 x 3).
            end = i
            while end < len(text) and (text[end].isalpha() or text[end] == "_"):
                end += 1
            if text[i:end] == "x":
                tokens.append(_Token("op", "*", "x", i))
            else:
                word = text[i:end] if end - i <= 20 else text[i : i + 20] + "..."
                raise ValueError(
                    f"unexpected {word!r} at position {i} (names and functions are not supported)"
                )
            i = end
        else:
            raise ValueError(f"unexpected {ch!r} at position {i}")
    tokens.append(_Token("end", "", "", len(text)))
    return tokens


def _number(text: str, start: int) -> tuple[int, Fraction]:
    """The number that starts at text[start] (a digit or "."): where it ends, and its exact value
    (1.5 is 3/2, not a float)."""
    end = start
    while end < len(text) and text[end] in _DIGITS:
        end += 1
    whole = text[start:end]
    fraction = ""
    if end < len(text) and text[end] == ".":
        end += 1
        after = end
        while end < len(text) and text[end] in _DIGITS:
            end += 1
        fraction = text[after:end]
    if not whole and not fraction:
        raise ValueError(f"unexpected '.' at position {start}")
    digits = whole + fraction
    # Cannot happen within MAX_LENGTH, but keeps int() below Python's int-from-str limit whatever
    # the constants.
    if len(digits) > MAX_DIGITS:
        raise ValueError(f"number too long (more than {MAX_DIGITS} digits)")
    value = Fraction(int(digits), 10 ** len(fraction))
    _check(value)
    return end, value


# Parsing and evaluating


class _Parser:
    """Evaluates a token list as it parses it, one method per rule of the grammar (see the module
    docstring); `depth` counts the levels of nesting open, each at most a few Python frames."""

    def __init__(self, tokens: list[_Token]):
        """Starts at the first token, with no nesting open."""
        self.tokens = tokens
        self.at = 0
        self.depth = 0

    def peek(self) -> _Token:
        """The current token, not consumed."""
        return self.tokens[self.at]

    def take(self) -> _Token:
        """The current token, consumed."""
        token = self.tokens[self.at]
        self.at += 1
        return token

    def is_op(self, *ops: str) -> bool:
        """Whether the current token is one of the operators `ops`."""
        token = self.peek()
        return token.kind == "op" and token.op in ops

    def unexpected(self, token: _Token) -> ValueError:
        """The error for a token that cannot come where it is."""
        if token.kind == "end":
            return ValueError("unexpected end of expression")
        if token.op == ")":
            return ValueError(f"unmatched ')' at position {token.position}")
        return ValueError(f"unexpected {token.text!r} at position {token.position}")

    def deeper(self) -> None:
        """Opens one more level of nesting, refused past MAX_DEPTH (long before Python's recursion
        limit)."""
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ValueError(f"expression nested too deeply (more than {MAX_DEPTH} levels)")

    def parse(self) -> Fraction:
        """The value of the whole token list; anything left after the expression is an error."""
        value = self.expression()
        if self.peek().kind != "end":
            raise self.unexpected(self.peek())
        return value

    def expression(self) -> Fraction:
        """expression := term (("+" | "-") term)*, left to right."""
        value = self.term()
        while self.is_op("+", "-"):
            op = self.take().op
            value = _apply(op, value, self.term())
        return value

    def term(self) -> Fraction:
        """term := unary (("*" | "/" | "//" | "%") unary)*, left to right."""
        value = self.unary()
        while self.is_op("*", "/", "//", "%"):
            op = self.take().op
            value = _apply(op, value, self.unary())
        return value

    def unary(self) -> Fraction:
        """unary := ("+" | "-") unary | power: a sign applies to the whole power after it
        (-2**2 is -4)."""
        if self.is_op("+", "-"):
            op = self.take().op
            self.deeper()
            value = self.unary()
            self.depth -= 1
            return -value if op == "-" else value
        return self.power()

    def power(self) -> Fraction:
        """power := atom (("**" | "^") unary)?: right-associative, as the exponent is itself a
        unary, which may hold another power (2**3**2 is 2**9, 2**-2 is 1/4)."""
        base = self.atom()
        if not self.is_op("**"):
            return base
        self.take()
        self.deeper()
        exponent = self.unary()
        self.depth -= 1
        return _power(base, exponent)

    def atom(self) -> Fraction:
        """atom := number | "(" expression ")"."""
        token = self.take()
        if token.kind == "number":
            return token.value
        if token.op == "(":
            self.deeper()
            value = self.expression()
            self.depth -= 1
            if not self.is_op(")"):
                if self.peek().kind == "end":
                    raise ValueError(f"missing ')' for the '(' at position {token.position}")
                raise self.unexpected(self.peek())
            self.take()
            return value
        raise self.unexpected(token)


# Arithmetic, bounded


def _bits(n: int) -> int:
    """The number of bits of |n| (0 for 0)."""
    return abs(n).bit_length()


def _check(value: Fraction) -> Fraction:
    """`value`, if its numerator and denominator have at most MAX_DIGITS digits each (compared
    with 10**MAX_DIGITS, never converted to a string); else ValueError."""
    if abs(value.numerator) >= _LIMIT:
        raise ValueError(_TOO_LARGE)
    if value.denominator >= _LIMIT:
        raise ValueError(_TOO_PRECISE)
    return value


def _guard(bits: int) -> None:
    """Refuses, before computing it, an intermediate of more than _WORK_BITS bits. Operands within
    MAX_DIGITS keep + - * / // % below it; this keeps them cheap whatever the limits."""
    if bits > _WORK_BITS:
        raise ValueError(_TOO_LARGE)


def _apply(op: str, a: Fraction, b: Fraction) -> Fraction:
    """a op b for a binary operator other than the power, exactly, with its size bounded first
    (from the bit lengths of the numerators and denominators) and checked after."""
    an, ad, bn, bd = (
        _bits(a.numerator),
        _bits(a.denominator),
        _bits(b.numerator),
        _bits(b.denominator),
    )
    if op == "*":
        _guard(max(an + bn, ad + bd))
        return _check(a * b)
    if op == "/":
        if b == 0:
            raise ValueError("division by zero")
        _guard(max(an + bd, ad + bn))
        return _check(a / b)
    # + - // % cross-multiply: a's numerator by b's denominator and b's numerator by a's
    # denominator (plus a carry bit), over the product of the denominators.
    _guard(max(an + bd + 1, bn + ad + 1, ad + bd))
    if op == "+":
        return _check(a + b)
    if op == "-":
        return _check(a - b)
    if b == 0:
        raise ValueError("division by zero")
    if op == "//":
        return _check(Fraction(a // b))
    return _check(a % b)


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    """base**exponent for a whole exponent, refused before computing when the result is sure to
    exceed MAX_DIGITS: for a part p of the base (numerator or denominator) with |p| >= 2,
    |p**n| >= 2**(n * (bits(p) - 1)). Whatever passes has at most about 2 * _LIMIT_BITS bits."""
    if exponent.denominator != 1:
        raise ValueError("only whole-number exponents are allowed")
    n = exponent.numerator
    if base == 0:
        if n < 0:
            raise ValueError("division by zero")
        return Fraction(1 if n == 0 else 0)
    # For a negative exponent the numerator and denominator swap places: (p/q)**-n is q**n/p**n.
    top, bottom = (
        (base.numerator, base.denominator) if n >= 0 else (base.denominator, base.numerator)
    )
    if abs(n) * (_bits(top) - 1) >= _LIMIT_BITS:
        raise ValueError(_TOO_LARGE)
    if abs(n) * (_bits(bottom) - 1) >= _LIMIT_BITS:
        raise ValueError(_TOO_PRECISE)
    # A part of 1 (bits 1) costs nothing to raise whatever n is (it stays 1 or -1); any other part
    # now has n * bits(p) < _LIMIT_BITS + n <= 2 * _LIMIT_BITS.
    return _check(base**n)


# Output


def _format(value: Fraction) -> str:
    """`value` as the tool's answer: an integer in full; anything else to 10 significant digits,
    positionally when 1e-6 <= |value| < 1e15 once rounded, else in scientific notation."""
    if value.denominator == 1:
        return str(value.numerator)  # at most MAX_DIGITS digits: below the int-to-str limit
    sign = "-" if value < 0 else ""
    value = abs(value)
    # The power of ten of the leading digit: e with 10**e <= value < 10**(e+1), from the digit
    # counts (off by at most one) and corrected exactly.
    e = len(str(value.numerator)) - len(str(value.denominator))
    if value < Fraction(10) ** e:
        e -= 1
    # The 10 significant digits as an integer, rounded half away from zero; a carry to 11 digits
    # (9.9999999999 -> 10.00000000) moves the leading digit up one power of ten.
    scaled = value * Fraction(10) ** (_SIGNIFICANT - 1 - e)
    digits, remainder = divmod(scaled.numerator, scaled.denominator)
    if 2 * remainder >= scaled.denominator:
        digits += 1
    if digits == 10**_SIGNIFICANT:
        digits //= 10
        e += 1
    text = str(digits)  # exactly _SIGNIFICANT digits: d.ddddddddd times 10**e
    if _PLAIN_FROM <= e < _PLAIN_BELOW:
        if e < 0:
            plain = "0." + "0" * (-e - 1) + text
        elif e < _SIGNIFICANT - 1:
            plain = text[: e + 1] + "." + text[e + 1 :]
        else:
            plain = text + "0" * (e - _SIGNIFICANT + 1)
        if "." in plain:
            plain = plain.rstrip("0").rstrip(".")
        return sign + plain
    mantissa = (text[0] + "." + text[1:]).rstrip("0").rstrip(".")
    return f"{sign}{mantissa}e{e:+d}"
