"""Read a verl launch script without running it: its variables, arrays, branches and the trainer's arguments.

verl's example scripts set shell variables (``lr=${LR:-1e-6}``), build bash arrays of overrides
(``ACTOR=( actor_rollout_ref.actor.optim.lr=$lr ... )``), pick values in ``if``/``case`` blocks by device or
backend, compute sizes with ``$(( ))`` and end in ``python3 -m verl.trainer.main_ppo "${ACTOR[@]}" k=v "$@"``.
This module follows that subset of bash statically — nothing is executed: assignments (``export``/``local``
too), arrays and ``"${NAME[@]}"``, the ``${VAR:-default}`` family, ``$(( ))`` integer arithmetic, quoting, word
splitting of unquoted expansions, line continuations, redirections, and ``if``/``elif``/``else`` and ``case``
branches whose tests are ``[ ]``/``[[ ]]`` string and integer comparisons, ``-n``/``-z``, ``(( ))``, ``!``,
``&&``/``||`` and ``{ }``. Variables come from ``env`` (the caller's choices, e.g. ``DEVICE=gpu``), else they are
unset, as in a clean shell; a file test (``-f``) is false; ``$(command)`` is never run: it stays in the value as
written and is reported. Loop bodies and functions are skipped.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

TRAINERS = re.compile(r"^verl\.(trainer\.(main_ppo(_sync)?|sft_trainer|fsdp_sft_trainer)|"
                      r"experimental\.fully_async_policy\.fully_async_main)$")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]")
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?)=(.*)$", re.S)
_ARITH = re.compile(r"^[\d\s+\-*/%()<>=!&|]*$")
_OPS = ("&&", "||", "|")
_KEPT = "\x01"           # a space inside an unrun $(command): not a word break


class ShellError(ValueError):
    """The script's trainer call could not be found or read."""


@dataclass
class Script:
    """What a launch script resolves to: the trainer module, its arguments, and what could not be resolved."""

    module: str
    args: list[str]
    unresolved: list[str] = field(default_factory=list)   # variables used but never set (left as ${NAME})
    commands: list[str] = field(default_factory=list)     # $(...) substitutions left unrun in the arguments
    line: int = 0                                            # the trainer call's first line
    launcher: list[str] = field(default_factory=list)       # the words before the module (torchrun and its flags)


@dataclass
class _Word:
    parts: list[tuple[str, str]]         # (quote, text): quote is "'", '"' or "" (bare)
    array: list[_Word] | None = None     # NAME=( ... ): the elements
    op: str = ""                         # "&&", "||" or "|" between commands of one list

    @property
    def bare(self) -> str | None:
        """The word's text when it is one unquoted piece (a keyword, an operator, a pattern)."""
        return self.parts[0][1] if len(self.parts) == 1 and self.parts[0][0] == "" else None


# ---------------------------------------------------------------------------------------------- lexing


def _lex(text: str) -> list[tuple[int, list[_Word]]]:
    """Split the script into commands (line, words). Commands end at a newline or ';' (not inside an array,
    quotes or a { } group); '&&', '||' and '|' stay in the command as operator words; redirections are dropped."""
    commands: list[tuple[int, list[_Word]]] = []
    words: list[_Word] = []
    parts: list[tuple[str, str]] = []
    buf, i, line, start, braces, skip_next = "", 0, 1, 1, 0, False
    arrays: list[tuple[list[_Word], list[tuple[str, str]]]] = []

    def end_word() -> None:
        nonlocal buf, parts, braces, skip_next
        if buf:
            parts.append(("", buf))
            buf = ""
        if parts:
            if skip_next:
                skip_next = False
            else:
                word = _Word(parts)
                braces += {"{": 1, "}": -1}.get(word.bare or "", 0)
                words.append(word)
            parts = []

    def end_command() -> None:
        nonlocal words, start
        end_word()
        if words and not arrays and braces <= 0:
            commands.append((start, words))
            words = []
        if not words:
            start = line

    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            line += text[i + 1] == "\n"
            buf += "" if text[i + 1] == "\n" else text[i + 1]
            i += 2
        elif c in "'\"":
            close = text.find("'", i + 1) if c == "'" else _closing_quote(text, i + 1)
            if close < 0:
                raise ShellError(f"line {line}: unterminated {c} quote")
            if buf:
                parts.append(("", buf))
                buf = ""
            parts.append((c, text[i + 1:close]))
            line += text.count("\n", i, close)
            i = close + 1
        elif text.startswith("$(", i) or text.startswith("${", i):
            close = _closing(text, i + 1)
            buf += text[i:close + 1]
            line += text.count("\n", i, close)
            i = close + 1
        elif c == "#" and not buf and not parts:
            while i < len(text) and text[i] != "\n":
                i += 1
        elif c == "(" and not parts and _ASSIGN.match(buf) and buf.endswith("="):
            parts.append(("", buf))
            buf = ""
            arrays.append((words, parts))
            words, parts = [], []
            i += 1
        elif c == ")" and arrays:
            end_word()
            elements = words
            words, parts = arrays.pop()
            words.append(_Word(parts, array=elements))
            parts = []
            i += 1
        elif c in "<>" and not arrays:
            if buf.isdigit():
                buf = ""
            end_word()
            i += 1
            while i < len(text) and text[i] in "<>&":
                i += 1
            j = i
            while j < len(text) and (text[j].isdigit() or text[j] == "-"):
                j += 1
            if j > i and text[i - 1] == "&":
                i = j                      # 2>&1: the target is a descriptor
            else:
                skip_next = True           # > file: drop the file word
        elif c == "\n":
            line += 1
            end_word() if arrays else end_command()
            i += 1
        elif c in " \t":
            end_word()
            i += 1
        elif c == ";" and not arrays:
            end_command()
            i += 2 if text.startswith(";;", i) else 1
        elif c in "&|" and not arrays:
            end_word()
            op = text[i:i + 2] if text[i:i + 2] in ("&&", "||") else c
            i += len(op)
            if op in _OPS:
                words.append(_Word([("", op)], op=op))
        else:
            buf += c
            i += 1
    end_command()
    return commands


def _closing_quote(text: str, i: int) -> int:
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i
        elif text.startswith("$(", i) or text.startswith("${", i):
            i = _closing(text, i + 1) + 1
        else:
            i += 1
    return -1


def _closing(text: str, i: int) -> int:
    """Index of the ')' or '}' that closes the '(' or '{' at ``i`` (nested ones counted)."""
    opener = text[i]
    closer = ")" if opener == "(" else "}"
    depth = 0
    while i < len(text):
        if text[i] == opener:
            depth += 1
        elif text[i] == closer:
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ShellError(f"unterminated ${opener} ... {closer}")


# ---------------------------------------------------------------------------------------------- expansion


class _Shell:
    def __init__(self, env: Mapping[str, str]):
        self.vars: dict[str, str | list[str]] = dict(env)
        self.unresolved: list[str] = []

    def get(self, name: str) -> str | list[str] | None:
        return self.vars.get(name)

    def scalar(self, name: str) -> str | None:
        value = self.get(name)
        return (value[0] if value else "") if isinstance(value, list) else value

    def missing(self, name: str) -> str:
        if not name.isdigit() and name not in self.unresolved:
            self.unresolved.append(name)
        return "" if name.isdigit() else "${" + name + "}"

    def expand(self, text: str, quoted: bool = False) -> str:
        out, i = [], 0
        while i < len(text):
            c = text[i]
            if c == "\\" and quoted and i + 1 < len(text) and text[i + 1] in '$`"\\\n':
                out.append("" if text[i + 1] == "\n" else text[i + 1])
                i += 2
            elif c != "$":
                out.append(c)
                i += 1
            elif text.startswith("$((", i):
                close = _closing(text, i + 1)
                out.append(self.arith(text[i + 3:close - 1]))
                i = close + 1
            elif text.startswith("$(", i):
                close = _closing(text, i + 1)
                out.append(text[i:close + 1].replace(" ", _KEPT))   # never run; one word even unquoted
                i = close + 1
            elif text.startswith("${", i):
                close = _closing(text, i + 1)
                out.append(self.braced(text[i + 2:close]))
                i = close + 1
            elif text.startswith(("$@", "$*", "$#"), i):
                out.append("0" if text[i + 1] == "#" else "")
                i += 2
            elif match := _NAME.match(text, i + 1):
                value = self.scalar(match.group())
                out.append(value if value is not None else self.missing(match.group()))
                i = match.end()
            else:
                out.append("$")
                i += 1
        return "".join(out)

    def braced(self, body: str) -> str:
        match = re.match(r"^(#?)([A-Za-z_][A-Za-z0-9_]*|[0-9]+)(\[[^]]+\])?(:?[-=+?])?(.*)$", body, re.S)
        if not match:
            return "${" + body + "}"
        length, name, index, op, rest = match.groups()
        value = self.get(name)
        if isinstance(value, list):
            if length:
                return str(len(value))
            if index in ("[@]", "[*]"):
                value = " ".join(value)
            else:
                k = int(self.arith(index[1:-1])) if index else 0
                value = value[k] if k < len(value) else None
        if length:
            return str(len(value or ""))
        empty = value is None or (bool(op) and op.startswith(":") and value == "")
        if op in (":-", "-", ":=", "="):
            if not empty:
                return value  # type: ignore[return-value]
            default = self.unquote(rest)
            if "=" in op:
                self.vars[name] = default
            return default
        if op in (":+", "+"):
            return "" if empty else self.unquote(rest)
        return value if value is not None else self.missing(name)  # type: ignore[return-value]

    def unquote(self, text: str) -> str:
        """A default inside ${NAME:-...}: quotes removed, "..." and bare parts expanded, '...' kept as written."""
        out = []
        for match in re.finditer(r"'([^']*)'|\"((?:\\.|[^\"\\])*)\"|([^'\"]+)", text):
            single, double, bare = match.groups()
            out.append(single if single is not None else self.expand(double if double is not None else bare,
                                                                     quoted=double is not None))
        return "".join(out)

    def arith(self, expr: str) -> str:
        """Integer arithmetic (bash's $(( )) and (( )) over + - * / % and comparisons); unevaluable: as written."""
        names = re.sub(r"\$?\b([A-Za-z_][A-Za-z0-9_]*)\b", lambda m: self.scalar(m.group(1)) or "0",
                       self.expand(expr))
        if not _ARITH.match(names):
            return f"$(({expr}))"
        python = names.replace("/", "//").replace("&&", " and ").replace("||", " or ")
        python = re.sub(r"!(?!=)", " not ", python)
        try:
            return str(int(eval(python, {"__builtins__": {}})))  # digits, operators and parentheses only
        except (SyntaxError, ZeroDivisionError, TypeError):
            return f"$(({expr}))"

    def words(self, word: _Word) -> list[str]:
        """A word after expansion and word splitting: several for "${ARRAY[@]}" or an unquoted $VAR holding
        spaces, none for "$@"."""
        if word.op:
            return [word.op]
        if len(word.parts) == 1 and word.parts[0][0] != "'":
            text = word.parts[0][1]
            whole = re.fullmatch(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\[[@*]\]\}", text)
            if whole:
                value = self.get(whole.group(1))
                return list(value) if isinstance(value, list) else ([value] if value else [])
            if text in ("$@", "$*"):
                return []
        fields, current, touched = [], "", False
        for quote, text in word.parts:
            if quote == "'":
                current, touched = current + text, True
            elif quote == '"':
                current, touched = current + self.expand(text, quoted=True), True
            else:
                pieces = re.split(r"([ \t\n]+)", self.expand(text))
                for k, piece in enumerate(pieces):
                    if k % 2:                               # whitespace from an expansion: a field break
                        if current or touched:
                            fields.append(current)
                        current, touched = "", False
                    else:
                        current += piece
                        touched = touched or bool(piece)
        if current or touched:
            fields.append(current)
        return fields

    # ------------------------------------------------------------------ tests

    def test(self, words: list[str]) -> bool:
        """A condition list: tests joined by && and || (left to right, as bash), with ! and { } groups."""
        result, op, i = True, "&&", 0
        while i < len(words):
            j = i
            depth = 0
            while j < len(words) and not (depth == 0 and words[j] in ("&&", "||")):
                depth += {"{": 1, "}": -1}.get(words[j], 0)
                j += 1
            if (op == "&&" and result) or (op == "||" and not result):
                result = self.simple_test(words[i:j])
            if j < len(words):
                op = words[j]
            i = j + 1
        return result

    def simple_test(self, words: list[str]) -> bool:
        if words[:1] == ["!"]:
            return not self.simple_test(words[1:])
        if words[:1] == ["{"] and words[-1:] == ["}"]:
            return self.test(words[1:-1])
        if words and words[0] in ("[", "[[") and words[-1] in ("]", "]]"):
            return _compare(words[1:-1])
        if words and words[0].startswith("((") and words[-1].endswith("))"):
            value = self.arith(" ".join(words)[2:-2])
            return value.lstrip("-").isdigit() and int(value) != 0
        return words[:1] == ["true"]


def _compare(args: list[str]) -> bool:
    if len(args) == 1:
        return args[0] != ""
    if len(args) == 2:
        flag, value = args
        return {"-n": value != "", "-z": value == ""}.get(flag, False)   # file tests: no files here
    if len(args) == 3:
        a, op, b = args
        if op in ("=", "=="):
            return fnmatch.fnmatchcase(a, b)
        if op == "!=":
            return not fnmatch.fnmatchcase(a, b)
        ints = {"-eq": int.__eq__, "-ne": int.__ne__, "-gt": int.__gt__, "-ge": int.__ge__,
                "-lt": int.__lt__, "-le": int.__le__}
        if op in ints and a.lstrip("-").isdigit() and b.lstrip("-").isdigit():
            return ints[op](int(a), int(b))
    return False


# ---------------------------------------------------------------------------------------------- reading


@dataclass
class _Block:
    kind: str             # "if", "case" or "loop"
    live: bool            # the enclosing code runs
    taken: bool = False   # a branch of this block already ran
    on: bool = False      # the current branch runs
    subject: str = ""     # case: the word matched against the patterns


def read_script(text: str, env: Mapping[str, str] | None = None) -> Script:
    """The trainer call of a verl launch script, with its arguments resolved (see the module's docstring)."""
    shell = _Shell(env or {})
    blocks: list[_Block] = []

    def live() -> bool:
        return not blocks or (blocks[-1].live and blocks[-1].on)

    for line, words in _lex(text):
        while words:
            head = words[0].bare
            rest = words[1:]
            if head in ("then", "do"):
                words = rest
                continue
            if head == "if" or head == "elif":
                cond, body = _split_at(rest, "then")
                if head == "if":
                    blocks.append(_Block("if", live()))
                block = blocks[-1]
                block.on = block.live and not block.taken and shell.test(_flat(shell, cond))
                block.taken = block.taken or block.on
                words = body
            elif head == "else" and blocks:
                block = blocks[-1]
                block.on = block.live and not block.taken
                words = rest
            elif head in ("fi", "esac", "done") and blocks:
                blocks.pop()
                words = rest
            elif head == "case":
                subject = shell.words(rest[0])[0] if rest else ""
                blocks.append(_Block("case", live(), subject=subject))
                words = []
            elif blocks and blocks[-1].kind == "case" and (k := _pattern_end(words)) is not None:
                block = blocks[-1]
                rest = words[k + 1:]
                patterns = "".join(w.bare or "" for w in words[:k + 1])[:-1].lstrip("(").split("|")
                block.on = block.live and not block.taken and any(
                    fnmatch.fnmatchcase(block.subject, p.strip()) for p in patterns if p.strip())
                block.taken = block.taken or block.on
                words = rest
            elif blocks and blocks[-1].kind == "case" and len(words) > 1 and words[1].bare == ")":
                words = [_Word([("", (head or "") + ")")])] + words[2:]
            elif head in ("for", "while", "until"):
                blocks.append(_Block("loop", live(), on=False))
                words = []
            elif head == "function" or (head or "").endswith("()") or (len(words) > 1 and words[1].bare == "()"):
                words = []                       # a function definition (its { } body is part of this command)
            else:
                found = _command(shell, words) if live() else None
                if found is not None:
                    module, args, launcher = found
                    commands = sorted({m for a in args for m in re.findall(r"\$\([^)]*\)", a)})
                    return Script(module, args, shell.unresolved, commands, line, launcher)
                words = []
    raise ShellError("no trainer call found: the script must run `python3 -m verl.trainer.main_ppo` (or "
                     "main_ppo_sync, or verl.experimental.fully_async_policy.fully_async_main), or verl's SFT "
                     "trainer (`torchrun ... -m verl.trainer.sft_trainer` or fsdp_sft_trainer)")


def _pattern_end(words: list[_Word]) -> int | None:
    """In a case block: the index of the word that closes a pattern list (``gpu)``, ``npu | ascend)``)."""
    for k, word in enumerate(words):
        text = word.bare
        if text is None or "=" in text:
            return None
        if text.endswith(")"):
            return k
        if not (word.op == "|" or k % 2 == 0):
            return None
    return None


def _split_at(words: list[_Word], keyword: str) -> tuple[list[_Word], list[_Word]]:
    for i, word in enumerate(words):
        if word.bare == keyword:
            return words[:i], words[i + 1:]
    return words, []


def _flat(shell: _Shell, words: list[_Word]) -> list[str]:
    return [value for word in words for value in (shell.words(word) or [""])]


def _command(shell: _Shell, words: list[_Word]) -> tuple[str, list[str], list[str]] | None:
    """Run one command list (simple commands joined by && and ||, as bash: left to right); return (module, args,
    the words before the module) when a command that runs is the trainer call. A test's status is its result; any
    other command succeeds."""
    status, op, i = True, "&&", 0
    while i < len(words):
        j = next((k for k in range(i, len(words)) if words[k].op), len(words))
        if (op == "&&" and status) or (op == "||" and not status) or op == "|":
            segment = words[i:j]
            if segment and segment[0].bare in ("[", "[[", "!", "true", "false") or \
                    (segment[0].bare or "").startswith("(("):
                status = shell.test(_flat(shell, segment))
            else:
                found = _simple(shell, segment)
                if found is not None:
                    return found
                status = True
        if j < len(words):
            op = words[j].op
        i = j + 1
    return None


def _simple(shell: _Shell, words: list[_Word]) -> tuple[str, list[str], list[str]] | None:
    """One simple command: its assignments take effect; (module, args, launcher) when it runs the trainer."""
    if words and words[0].bare in ("export", "local", "declare", "readonly"):
        words = [w for w in words[1:] if not (w.bare or "").startswith("-")]
    assignments = 0
    for word in words:
        first = word.parts[0]
        match = _ASSIGN.match(first[1]) if first[0] == "" else None
        if not match:
            break
        assignments += 1
        name, append, rest = match.groups()
        if word.array is not None:
            value: str | list[str] = [v for element in word.array for v in shell.words(element)]
        else:
            value = " ".join(shell.words(_Word([("'" if not rest else "", rest)] + word.parts[1:])))
        if append:
            old = shell.get(name)
            if isinstance(value, list):
                value = (old if isinstance(old, list) else [old] if old else []) + value
            else:
                value = (shell.scalar(name) or "") + value
        shell.vars[name] = value
    command = [v for word in words[assignments:] for v in shell.words(word)]
    for k, value in enumerate(command):
        if TRAINERS.match(value):
            return value, [a.replace(_KEPT, " ") for a in command[k + 1:]], command[:k]
    return None
