"""The text language's syntax: tokens and a parse tree with source positions.

Statements are separated by newlines (outside brackets) or ``;``; ``#``
starts a comment.  Two statement forms::

    A = tensor([1, 3, 224, 224])            # declaration, optional dtype
    D[n, k, p, q] = ReduceAdd({r, s}, B[n, c, p*2+r*2, q*2+s*2] * C[k, c, r, s])

``Out[...] += body`` is ``Out[...] = ReduceAdd({<free variables>}, body)``.
Operators, loosest first: ``||``, ``&&``, ``== !=``, ``< <= > >=``, ``+ -``,
``* / // %``, unary ``- !``.  A reduction's axis set may end with a
condition, set-builder style: ``ReduceAdd({r, s | (z - r)%2 == 0}, ...)``.
This module only checks syntax;
``neoflow.ir.build`` gives the tree its meaning.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from neoflow.errors import ParseError

Pos = tuple[int, int]

_TOKEN = re.compile(
    r"(?P<space>[ \t\r]+)|(?P<comment>#[^\n]*)|(?P<newline>\n)"
    r"|(?P<float>(\d+\.\d*|\.\d+)([eE][+-]?\d+)?|\d+[eE][+-]?\d+)|(?P<int>\d+)"
    r"|(?P<name>[A-Za-z_][A-Za-z_0-9]*)"
    r"|(?P<op>\+=|//|<=|>=|==|!=|&&|\|\||[-+*/%<>!=\[\](){},;:|])"
)
_CLOSING = {"(": ")", "[": "]", "{": "}"}


@dataclass(frozen=True)
class Token:
    kind: str  # name, int, float, op, newline, end
    text: str
    pos: Pos


def tokenize(text: str) -> list[Token]:
    """Split ``text`` into tokens; newlines inside brackets are dropped.
    Raises ``ParseError`` on unknown characters and unbalanced brackets."""
    tokens: list[Token] = []
    open_brackets: list[Token] = []
    line, line_start, i = 1, 0, 0
    while i < len(text):
        match = _TOKEN.match(text, i)
        pos = (line, i - line_start + 1)
        if match is None:
            raise ParseError(f"unexpected character {text[i]!r}", line=pos[0], column=pos[1])
        kind = match.lastgroup
        value = match.group()
        if kind == "newline":
            if not open_brackets:
                tokens.append(Token("newline", value, pos))
            line, line_start = line + 1, match.end()
        elif kind in ("name", "int", "float", "op"):
            token = Token(kind, value, pos)
            if value in _CLOSING:
                open_brackets.append(token)
            elif value in _CLOSING.values():
                if not open_brackets or _CLOSING[open_brackets[-1].text] != value:
                    expected = (
                        f"; '{open_brackets[-1].text}' at line {open_brackets[-1].pos[0]}, column "
                        f"{open_brackets[-1].pos[1]} is still open"
                        if open_brackets
                        else ""
                    )
                    raise ParseError(f"unbalanced bracket: unexpected '{value}'{expected}", line=pos[0], column=pos[1])
                open_brackets.pop()
            tokens.append(token)
        i = match.end()
    if open_brackets:
        first = open_brackets[-1]
        raise ParseError(f"unbalanced bracket: '{first.text}' is never closed", line=first.pos[0], column=first.pos[1])
    tokens.append(Token("end", "", (line, i - line_start + 1)))
    return tokens


# -- parse tree ---------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    pos: Pos


@dataclass(frozen=True)
class Number(Node):
    value: int | float


@dataclass(frozen=True)
class Name(Node):
    name: str


@dataclass(frozen=True)
class Subscript(Node):
    name: str
    args: tuple[Node, ...]


@dataclass(frozen=True)
class Call(Node):
    func: str
    args: tuple[Node, ...]


@dataclass(frozen=True)
class AxisSet(Node):
    """``{r, s: 3 | cond}`` — reduction axes with optional extents and condition."""

    axes: tuple[tuple[str, int | None, Pos], ...]
    where: Node | None = None


@dataclass(frozen=True)
class BinOp(Node):
    op: str
    a: Node
    b: Node


@dataclass(frozen=True)
class UnOp(Node):
    op: str
    x: Node


@dataclass(frozen=True)
class Assign(Node):
    target: Subscript
    accumulate: bool  # True for +=
    value: Node
    source: str = field(default="", compare=False)


@dataclass(frozen=True)
class Declare(Node):
    name: str
    shape: tuple[int, ...]
    dtype: str | None


Statement = Assign | Declare

_BINARY_LEVELS: tuple[tuple[str, ...], ...] = (
    ("||",),
    ("&&",),
    ("==", "!="),
    ("<", "<=", ">", ">="),
    ("+", "-"),
    ("*", "/", "//", "%"),
)


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = tokenize(text)
        self.i = 0

    # token helpers
    @property
    def token(self) -> Token:
        return self.tokens[self.i]

    def error(self, message: str, token: Token | None = None) -> ParseError:
        token = token or self.token
        return ParseError(message, line=token.pos[0], column=token.pos[1])

    def describe(self, token: Token) -> str:
        return {"end": "end of input", "newline": "end of line"}.get(token.kind, f"'{token.text}'")

    def accept(self, text: str) -> Token | None:
        if self.token.kind == "op" and self.token.text == text:
            self.i += 1
            return self.tokens[self.i - 1]
        return None

    def expect(self, text: str, what: str = "") -> Token:
        token = self.accept(text)
        if token is None:
            raise self.error(f"expected '{text}'{what}, found {self.describe(self.token)}")
        return token

    def expect_kind(self, kind: str, what: str) -> Token:
        if self.token.kind != kind:
            raise self.error(f"expected {what}, found {self.describe(self.token)}")
        self.i += 1
        return self.tokens[self.i - 1]

    # grammar
    def statements(self) -> list[Statement]:
        out: list[Statement] = []
        while True:
            while self.token.kind == "newline" or self.accept(";"):
                if self.token.kind == "newline":
                    self.i += 1
            if self.token.kind == "end":
                return out
            out.append(self.statement())
            if self.token.kind not in ("newline", "end") and not (self.token.kind == "op" and self.token.text == ";"):
                raise self.error(f"expected end of statement, found {self.describe(self.token)}")

    def statement(self) -> Statement:
        start = self.token
        name = self.expect_kind("name", "a tensor name at the start of a statement")
        if self.accept("="):
            return self.declaration(name)
        if not (self.token.kind == "op" and self.token.text == "["):
            raise self.error(f"expected '[' or '=' after '{name.text}', found {self.describe(self.token)}")
        target = self.subscript(name)
        accumulate = self.accept("+=") is not None
        if not accumulate:
            self.expect("=", f" after {name.text}[...]")
        value = self.expression()
        end = self.token
        source = self._source_between(start, end)
        return Assign(start.pos, target, accumulate, value, source)

    def _source_between(self, start: Token, end: Token) -> str:
        lines = self.text.split("\n")
        (l1, c1), (l2, c2) = start.pos, end.pos
        if l1 == l2:
            return lines[l1 - 1][c1 - 1 : c2 - 1].strip()
        parts = [lines[l1 - 1][c1 - 1 :], *lines[l1 : l2 - 1], lines[l2 - 1][: c2 - 1]]
        return " ".join(p.strip() for p in parts).strip()

    def declaration(self, name: Token) -> Declare:
        keyword = self.expect_kind("name", "'tensor(' in a declaration")
        if keyword.text != "tensor":
            raise self.error(f"expected 'tensor(' in a declaration, found '{keyword.text}'", keyword)
        self.expect("(")
        self.expect("[", " (the shape)")
        shape: list[int] = []
        while not self.accept("]"):
            shape.append(int(self.expect_kind("int", "an integer dimension").text))
            if not self.accept(","):
                self.expect("]", " after the shape")
                break
        dtype = None
        if self.accept(","):
            dtype = self.expect_kind("name", "a dtype").text
        self.expect(")")
        return Declare(name.pos, name.text, tuple(shape), dtype)

    def subscript(self, name: Token) -> Subscript:
        self.expect("[")
        args: list[Node] = []
        if not self.accept("]"):
            args.append(self.expression())
            while self.accept(","):
                args.append(self.expression())
            self.expect("]", " or ','")
        return Subscript(name.pos, name.text, tuple(args))

    def expression(self, level: int = 0) -> Node:
        if level == len(_BINARY_LEVELS):
            return self.unary()
        left = self.expression(level + 1)
        while self.token.kind == "op" and self.token.text in _BINARY_LEVELS[level]:
            op = self.token
            self.i += 1
            left = BinOp(op.pos, op.text, left, self.expression(level + 1))
        return left

    def unary(self) -> Node:
        token = self.token
        if self.accept("-") or self.accept("!") or self.accept("+"):
            operand = self.unary()
            return operand if token.text == "+" else UnOp(token.pos, token.text, operand)
        return self.primary()

    def primary(self) -> Node:
        token = self.token
        if token.kind == "int":
            self.i += 1
            return Number(token.pos, int(token.text))
        if token.kind == "float":
            self.i += 1
            return Number(token.pos, float(token.text))
        if token.kind == "name":
            self.i += 1
            if self.token.kind == "op" and self.token.text == "[":
                return self.subscript(token)
            if self.accept("("):
                args: list[Node] = []
                if not self.accept(")"):
                    args.append(self.argument())
                    while self.accept(","):
                        args.append(self.argument())
                    self.expect(")", " or ','")
                return Call(token.pos, token.text, tuple(args))
            return Name(token.pos, token.text)
        if self.accept("("):
            inner = self.expression()
            self.expect(")")
            return inner
        raise self.error(f"expected an expression, found {self.describe(token)}")

    def argument(self) -> Node:
        start = self.token
        if not self.accept("{"):
            return self.expression()
        axes: list[tuple[str, int | None, Pos]] = []
        where = None
        while not self.accept("}"):
            name = self.expect_kind("name", "a reduction axis name")
            extent = None
            if self.accept(":"):
                extent = int(self.expect_kind("int", "an integer extent").text)
            axes.append((name.text, extent, name.pos))
            if self.accept("|"):
                where = self.expression()
                self.expect("}", " after the condition")
                break
            if not self.accept(","):
                self.expect("}", " or ','")
                break
        return AxisSet(start.pos, tuple(axes), where)


def parse(text: str) -> list[Statement]:
    """Parse ``text`` into statements.  Raises ``ParseError`` with line and column."""
    if not isinstance(text, str):
        raise ParseError(f"a program is text (a str of statements), got {type(text).__name__}")
    return _Parser(text).statements()
