"""Lark grammar text -> the EBNF the grammar backends compile (vLLM accepts both in `grammar`).

Covered: rules and terminals (`name: ...`, `?name`, `!name`, `NAME.2: ...`), alternatives over
several lines, "literals" and 'literals', "a".."z" ranges, ( ) groups, [ ] optionals, ? * +,
`~ n` and `~ n..m` repetitions, // comments; `start` becomes `root`. Regular-expression
terminals (/.../), case-insensitive literals and %directives are refused with their line.
"""

from __future__ import annotations

import ast
import json
import re

_RULE_START = re.compile(r"^\s*[?!]?([A-Za-z_]\w*)(\.\d+)?\s*:(?!:)")
_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<comment>//[^\n]*)
  | (?P<string>"(?:\\.|[^"\\])*"i?|'(?:\\.|[^'\\])*'i?)
  | (?P<regex>/(?:\\.|[^/\\\n])+/[imslux]*)
  | (?P<name>[?!]?[A-Za-z_]\w*)
  | (?P<range>\.\.)
  | (?P<num>\d+)
  | (?P<op>[|()\[\]?*+~])
""", re.VERBOSE)


def is_lark(text: str) -> bool:
    """Lark rules use `name:`, EBNF rules `name ::=`."""
    lines = [line for line in text.splitlines() if line.strip() and not line.strip().startswith("//")]
    return "::=" not in text and any(_RULE_START.match(line) for line in lines)


def lark_to_ebnf(text: str) -> str:
    """The same grammar as EBNF; a ValueError naming the line for what is not covered."""
    rules: list[tuple[str, list[str]]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("//"):
            continue
        if stripped.startswith("%"):
            _fail(lineno, f"the directive {stripped.split()[0]!r} is not supported")
        m = _RULE_START.match(line)
        if m:
            name = "root" if m.group(1) == "start" else m.group(1)
            rules.append((name, _body(line[m.end():], lineno)))
        elif stripped.startswith("|") and rules:
            rules[-1][1].extend(["|"] + _body(stripped[1:], lineno))
        else:
            _fail(lineno, f"expected a rule `name: ...` or a `| ...` continuation, got {stripped!r}")
    if not any(name == "root" for name, _ in rules):
        raise ValueError("SamplingParams.structured_outputs.grammar (Lark) has no `start` rule")
    return "\n".join(f"{name} ::= {' '.join(body)}" for name, body in rules)


def _body(text: str, lineno: int) -> list[str]:
    """One line of a rule's expansion as EBNF tokens."""
    out: list[str] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            _fail(lineno, f"unexpected {text[pos:pos + 10]!r}")
        pos = m.end()
        kind, tok = m.lastgroup, m.group()
        if kind in ("ws", "comment"):
            continue
        if kind == "regex":
            _fail(lineno, f"regular-expression terminals such as {tok} are not supported: use literals and ranges")
        if kind == "string":
            out.append(_literal(tok, lineno))
        elif kind == "name":
            out.append("root" if tok.lstrip("?!") == "start" else tok.lstrip("?!"))
        else:
            out.append(tok)
    return _rewrite_ops(out, lineno)


def _literal(tok: str, lineno: int) -> str:
    if tok.endswith("i"):
        _fail(lineno, f"case-insensitive literals such as {tok} are not supported")
    try:
        value = ast.literal_eval(tok)  # Lark's literals take Python's escapes
    except (SyntaxError, ValueError):
        _fail(lineno, f"bad literal {tok}")
    return ebnf_string(value)


def ebnf_string(value: str) -> str:
    """A string literal of the EBNF grammars (JSON's escapes; other characters as they are)."""
    return json.dumps(value, ensure_ascii=False)


def _rewrite_ops(toks: list[str], lineno: int) -> list[str]:
    """[x] -> (x)?, "a".."z" -> [a-z], x ~ n -> x{n}, x ~ n..m -> x{n,m}."""
    out: list[str] = []
    i = 0
    while i < len(toks):
        t = toks[i]
        if t == "[":
            out.append("(")
        elif t == "]":
            out.append(")?")
        elif t == ".." and out and i + 1 < len(toks):
            lo, hi = json.loads(out.pop()), json.loads(toks[i + 1])
            if len(lo) != 1 or len(hi) != 1:
                _fail(lineno, "a range needs one character on each side of ..")
            out.append(f"[{_class_char(lo)}-{_class_char(hi)}]")
            i += 1
        elif t == "~" and i + 1 < len(toks) and toks[i + 1].isdigit():
            lo = toks[i + 1]
            if i + 3 < len(toks) and toks[i + 2] == ".." and toks[i + 3].isdigit():
                out[-1] += f"{{{lo},{toks[i + 3]}}}"
                i += 2
            else:
                out[-1] += f"{{{lo}}}"
            i += 1
        elif t in ("~", "..") or t.isdigit():
            _fail(lineno, f"unexpected {t!r}")
        else:
            out.append(t)
        i += 1
    return out


def _class_char(c: str) -> str:
    return "\\" + c if c in "\\]-^" else c


def _fail(lineno: int, msg: str) -> None:
    raise ValueError(f"SamplingParams.structured_outputs.grammar (Lark) at line {lineno}: {msg}")
