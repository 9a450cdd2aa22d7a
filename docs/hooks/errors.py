"""The error catalogue: every user-facing error and warning line the code can print.

Collected from the source with ``ast`` (nothing is imported), so the troubleshooting page
cannot fall behind the code: a new ``raise ClusterConfigError(...)`` is on the page at the
next build. What counts as user-facing:

- ``raise C(...)`` for the project's error classes and for ValueError/TypeError in the
  public modules (the message is what the user reads: the CLI prints it as one line);
- the agent's ``fail(reason, code)`` (printed as ``error: REASON; stopping the job.``),
  every ``warnings.warn`` / ``logger.warning`` / ``logger.error``, and ``say(...)`` /
  ``print(...)`` lines that say ``error``, ``warning`` or ``cannot``;
- a handler ``except C as exc: say(..., f"error: {exc}. HINT: ...")`` wraps every C.

An error's cause is its message; its fix is the text after ``HINT:``. An error without a
HINT needs an entry in ``FIXES`` (docs/hooks/fixes.yml), else ``tests/unit/test_docs_site.py``
fails and names it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("cluster_parsers", "keras_distrib")
FIXES_FILE = Path(__file__).with_name("fixes.yml")

#: Exceptions whose message reaches the user as is.
ERROR_CLASSES = {
    "ClusterConfigError", "TrainerError", "CheckpointError", "IntervalError", "NotInJobError",
    "StrategyOrderError", "ControlError", "InputError", "ValueError", "TypeError",
}
#: Raises that never reach the user, with the reason.
INTERNAL = {
    "keras_distrib/trainers/_private_apis.py": "caught by the ps trainer and re-raised as a TrainerError with a HINT",
    "keras_distrib/trainers/placement.py": "the trainer always passes at least one ps",
    "keras_distrib/plan.py:KeyError": "lookups by the launcher's own names",
}
#: Function names whose first argument is a line shown to the user.
SAY_FUNCS = {"say", "print", "warn", "warning", "error", "log"}
#: Always an error or a warning (warnings.warn, logger.warning, logger.error, and the control
#: channel's ``log``, which reports strangers and dropped connections).
ALARM_FUNCS = {"warn", "warning", "error", "log"}
#: Words that make a ``say``/``print`` line an error or a warning (others are progress reports).
ALARM = re.compile(r"\b(error|warning|cannot)\b", re.I)

#: Where each file's errors show up, for the page's sections (first match wins).
AREAS = (
    ("keras_distrib/launcher/options.py", "Options and config files"),
    ("keras_distrib/checkpoint_interval.py", "Options and config files"),
    ("keras_distrib/launcher/", "The launcher at start-up and at run time"),
    ("keras_distrib/plan.py", "The launcher at start-up and at run time"),
    ("keras_distrib/network.py", "The launcher at start-up and at run time"),
    ("cluster_parsers/", "The scheduler's environment"),
    ("keras_distrib/checkpoints.py", "Checkpoints and resuming"),
    ("keras_distrib/data/", "Data"),
    ("keras_distrib/jax", "The jax layouts"),
    ("keras_distrib/trainers/", "Training: fit, evaluate, predict"),
    ("keras_distrib/", "Inside SCRIPT: cluster(), strategy()"),
)


@dataclass
class Entry:
    """One line the code can print: ``cause`` and ``fix`` are templates with ``{...}`` holes."""

    kind: str  # "error" or "warning"
    cause: str
    fix: str
    where: str  # path:line (function)
    path: str
    fixed_by: str = "HINT"  # "HINT" (in the code) or "fixes.yml"
    sources: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        """A stable name for fixes.yml: the file and the message's first literal words."""
        words = re.sub(r"\{[^}]*\}", "_", self.cause).split()[:8]
        return f"{self.path}: {' '.join(words)}"

    @property
    def area(self) -> str:
        return next(title for prefix, title in AREAS if self.path.startswith(prefix))

    def pattern(self) -> re.Pattern[str]:
        """A regex that matches the printed line (holes match anything)."""
        text = self.cause + (f" HINT: {self.fix}" if self.fixed_by == "HINT" and self.fix else "")
        parts = re.split(r"\{[^}]*\}", text)
        hint = "" if self.fixed_by == "HINT" and self.fix else "( HINT: .*)?"  # a HINT made elsewhere
        return re.compile(".*?".join(re.escape(p) for p in parts) + hint, re.S)


def _label(expr: ast.expr) -> str:
    """A short name for the value in a hole: ``{', '.join(LAYOUTS)}`` -> ``LAYOUTS``."""
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "join" and expr.args:
        return _label(expr.args[0])
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr in ("replace", "strip", "lower"):
        return _label(expr.func.value)
    if isinstance(expr, (ast.GeneratorExp, ast.ListComp)):
        return _label(expr.generators[0].iter)
    text = ast.unparse(expr).replace("self._", "").replace("self.", "").lstrip("_")
    return text if len(text) <= 30 else "..."


def _hole(expr: ast.expr) -> str:
    return "{" + _label(expr) + "}"


class _Module:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.rel = path.relative_to(REPO).as_posix()
        self.tree = ast.parse(path.read_text(), str(path))
        self.constants: dict[str, ast.expr] = {}
        for node in self.tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name) and node.value is not None:
                        self.constants[t.id] = node.value
                    elif isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):  # A, B = 1, 2
                        for name, value in zip(t.elts, node.value.elts):
                            if isinstance(name, ast.Name):
                                self.constants[name.id] = value

    def constant(self, expr: ast.expr) -> str | int | float | None:
        """The value of an UPPER_CASE constant of this module or the package (``X`` or ``mod.X``)."""
        name = expr.id if isinstance(expr, ast.Name) else expr.attr if isinstance(expr, ast.Attribute) else ""
        if not name.isupper():
            return None
        for module in [self, *_modules()]:
            value = module.constants.get(name)
            if isinstance(value, ast.Constant) and isinstance(value.value, (str, int, float)) and not isinstance(value.value, bool):
                return value.value
            if value is not None and isinstance(value, ast.JoinedStr | ast.BinOp):
                return module.render(value, {})
        return None

    def render(self, expr: ast.expr, local: dict[str, ast.expr], depth: int = 0) -> str | None:
        """The template of a string expression; None when it is not made of text."""
        if depth > 5:
            return None
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return expr.value
        if isinstance(expr, ast.JoinedStr):
            out = []
            for v in expr.values:
                if isinstance(v, ast.Constant):
                    out.append(str(v.value))
                else:
                    assert isinstance(v, ast.FormattedValue)
                    number = self.constant(v.value)
                    if number is not None:  # a module constant such as MAX_PORT: its value
                        spec = "".join(str(c.value) for c in getattr(v.format_spec, "values", []) if isinstance(c, ast.Constant))
                        out.append(format(number, spec) if spec or not isinstance(number, str) else number)
                        continue
                    inner = self.render(v.value, local, depth + 1) if isinstance(v.value, ast.Name) else None
                    out.append(inner if inner is not None else _hole(v.value))
            return "".join(out)
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
            left, right = self.render(expr.left, local, depth + 1), self.render(expr.right, local, depth + 1)
            if left is None or right is None:
                return None
            return left + right
        if isinstance(expr, ast.IfExp):
            a, b = self.render(expr.body, local, depth + 1), self.render(expr.orelse, local, depth + 1)
            if a is None or b is None:
                return None
            if a == b or "HINT" in a + b:  # two wordings of one message: the fuller one
                return a if len(a) >= len(b) else b
            return _hole(expr)
        if isinstance(expr, ast.Name):
            value = local.get(expr.id, self.constants.get(expr.id))
            if value is not None:
                return self.render(value, {}, depth + 1)
            if expr.id.isupper():  # an imported constant: look it up in the package
                found = _imported_constant(expr.id)
                if found is not None:
                    return found
        return None


_CONSTANT_CACHE: dict[str, str | None] = {}


def _imported_constant(name: str) -> str | None:
    if name not in _CONSTANT_CACHE:
        _CONSTANT_CACHE[name] = None
        for module in _modules():
            if name in module.constants:
                _CONSTANT_CACHE[name] = module.render(module.constants[name], {})
                break
    return _CONSTANT_CACHE[name]


_MODULES: list[_Module] = []


def _modules() -> list[_Module]:
    if not _MODULES:
        for package in PACKAGES:
            for path in sorted((REPO / package).rglob("*.py")):
                _MODULES.append(_Module(path))
    return _MODULES


def _call_name(func: ast.expr) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _functions(tree: ast.AST) -> list[tuple[str, ast.AST]]:
    """(qualified name, node) of every function, plus the module itself."""
    found: list[tuple[str, ast.AST]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, child))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
    visit(tree, "")
    return found


def _own_nodes(func: ast.AST) -> list[ast.AST]:
    """The nodes of ``func`` without those of nested functions."""
    out: list[ast.AST] = []
    stack = list(ast.iter_child_nodes(func))
    while stack:
        node = stack.pop()
        out.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))
    return out


def _locals(func: ast.AST) -> dict[str, ast.expr]:
    """Names assigned exactly once in a function (the values a message may use)."""
    seen: dict[str, list[ast.expr]] = {}
    for node in _own_nodes(func):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    seen.setdefault(t.id, []).append(node.value)
    return {k: v[0] for k, v in seen.items() if len(v) == 1}


@dataclass
class Unreadable:
    """A user-facing raise whose message is not text the scanner can read."""

    where: str
    source: str


def _split(message: str) -> tuple[str, str]:
    cause, _, fix = message.partition("HINT:")
    return cause.strip(), fix.strip()


def error_classes() -> set[str]:
    """``ERROR_CLASSES`` plus every ``class NameError(...)`` the packages define (a new error
    class is in the catalogue without anyone listing it)."""
    found = set(ERROR_CLASSES)
    for module in _modules():
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error") and node.bases:
                found.add(node.name)
    return found


def scan() -> tuple[list[Entry], list[Unreadable]]:
    """Every entry of the catalogue, and the user-facing raises the scanner cannot read."""
    classes = error_classes()
    entries: list[Entry] = []
    unreadable: list[Unreadable] = []
    wrappers: dict[str, tuple[str, str, str]] = {}  # class -> text before/after {exc}, kind
    raw: list[tuple[str, str, str, str, str]] = []  # kind, class, message, where, path
    for module in _modules():
        for qualname, func in _functions(module.tree):
            local = _locals(func)
            for node in _own_nodes(func):
                where = f"{module.rel}:{getattr(node, 'lineno', 0)} ({qualname})"
                if isinstance(node, ast.ExceptHandler) and node.name and node.type is not None:
                    for inner in ast.walk(node):
                        if isinstance(inner, ast.Call) and _call_name(inner.func) in SAY_FUNCS:
                            for arg in inner.args:
                                text = module.render(arg, local)
                                hole = "{" + node.name + "}"
                                # A tuple of classes has no one name: not a wrapper of one class's messages.
                                if text and hole in text and _call_name(node.type):
                                    before, after = text.split(hole, 1)
                                    said = _call_name(inner.func)
                                    kind = "warning" if said in ("warn", "warning") or "warning" in before else "error"
                                    wrappers[_call_name(node.type)] = (before, after, kind)
                if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                    cls = _call_name(node.exc.func)
                    if cls not in classes or module.rel in INTERNAL or f"{module.rel}:{cls}" in INTERNAL:
                        continue
                    args = [a for a in node.exc.args if not (isinstance(a, ast.Constant) and not isinstance(a.value, str))]
                    texts = [module.render(a, local) for a in args[:2]]
                    if not texts or texts[0] is None:
                        unreadable.append(Unreadable(where, ast.unparse(node)))
                        continue
                    if len(texts) == 2 and texts[1] is None:  # a hint handed in: a hole, fixes.yml explains
                        texts[1] = _hole(args[1])
                    message = texts[0] if len(texts) == 1 else f"{texts[0]} HINT: {texts[1]}"
                    raw.append(("error", cls, message, where, module.rel))
                elif isinstance(node, ast.Call):
                    name = _call_name(node.func)
                    if name == "fail" and node.args and isinstance(node.func, ast.Attribute):
                        text = module.render(node.args[0], local)
                        if text is not None and text != "{reason}":
                            raw.append(("error", "", f"error: {text}; stopping the job.", where, module.rel))
                        elif text is None:
                            unreadable.append(Unreadable(where, ast.unparse(node)))
                    elif name in SAY_FUNCS:
                        for arg in node.args[:2]:
                            text = module.render(arg, local)
                            if not text or "{exc}" in text or ("{reason}" in text and name != "log"):
                                continue  # a wrapper of another message (collected where it is made)
                            if name in ALARM_FUNCS or ALARM.search(text):
                                warning = name in ("warn", "warning", "log") or re.search(r"\bwarning\b", text, re.I)
                                raw.append(("warning" if warning else "error", "", text, where, module.rel))
            # module-level reasons handed to fail() by name, e.g. reason = f"lost the node ..."
            for node in _own_nodes(func):
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "reason" for t in node.targets):
                    text = module.render(node.value, local)
                    if text:
                        raw.append(("error", "", f"error: {text}; stopping the job.",
                                    f"{module.rel}:{node.lineno} ({qualname})", module.rel))
    fixes = load_fixes()
    for kind, cls, message, where, path in raw:
        if cls in wrappers:  # printed by the handler that catches it, as an error or a warning
            before, after, kind = wrappers[cls]
            message = before + message + after
        cause, fix = _split(message)
        entry = Entry(kind, cause, fix, where, path, sources=[where])
        if re.fullmatch(r"\{[^}]*\}\.?", fix):  # only a hole: the HINT is made elsewhere
            entry.fix = ""
        if not entry.fix and entry.key in fixes:
            entry.fix, entry.fixed_by = fixes[entry.key], "fixes.yml"
        entries.append(entry)
    return _dedupe(entries), unreadable


def _dedupe(entries: list[Entry]) -> list[Entry]:
    out: dict[tuple[str, str, str], Entry] = {}
    for e in entries:
        key = (e.kind, e.cause, e.fix)
        if key in out:
            out[key].sources.extend(e.sources)
        else:
            out[key] = e
    return list(out.values())


def load_fixes() -> dict[str, str]:
    data = yaml.safe_load(FIXES_FILE.read_text()) if FIXES_FILE.exists() else None
    return dict(data or {})


def missing_fixes(entries: list[Entry]) -> list[Entry]:
    """Errors that say what is wrong but not how to fix it (no HINT, no fixes.yml entry)."""
    return [e for e in entries if e.kind == "error" and not e.fix]


def _md_code(text: str) -> str:
    """Inline code that survives backticks inside the text."""
    ticks = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def markdown() -> str:
    """The catalogue as Markdown, one section per area, errors before warnings."""
    entries, _ = scan()
    lines = [f"The code can print {sum(e.kind == 'error' for e in entries)} errors and "
             f"{sum(e.kind == 'warning' for e in entries)} warnings, listed below by where they come from. "
             "Parts in `{braces}` stand for the values of your job (a variable, a path, a number). "
             "A launcher error is printed as one line, `keras_distrib: error: MESSAGE HINT: FIX`, "
             "and the job exits with code 2 before anything starts; errors inside SCRIPT are Python "
             "exceptions of the same text.", ""]
    for area in dict.fromkeys(title for _, title in AREAS):
        mine = sorted((e for e in entries if e.area == area), key=lambda e: (e.kind != "error", e.cause.lower()))
        if not mine:
            continue
        lines += [f"## {area}", ""]
        for e in mine:
            # One heading per message: the site's search then shows the message itself as the hit.
            label = "Warning: " if e.kind == "warning" else ""
            lines += [f"### {label}{_md_code(e.cause)}", ""]
            if e.kind == "warning":
                lines.append(f"**What it means:** {_escape(e.fix)}" if e.fix else "**What to do:** nothing: it only tells.")
            elif e.fix:
                origin = "" if e.fixed_by == "HINT" else " *(from the docs: the message has no HINT)*"
                lines.append(f"**Fix:** {_escape(e.fix)}{origin}")
            more = f" and {len(e.sources) - 1} more place(s)" if len(e.sources) > 1 else ""
            lines += ["", f"<small>Printed by `{e.sources[0]}`{more}.</small>", ""]
    return "\n".join(lines)


def _escape(text: str) -> str:
    """Fix text in Markdown: holes as code, the rest escaped."""
    out = []
    for i, part in enumerate(re.split(r"(\{[^}]*\})", text)):
        if i % 2:
            out.append(f"`{part}`")
        else:
            out.append(part.replace("<", "&lt;").replace("*", r"\*").replace("_", r"\_"))
    return "".join(out)
