"""The sandbox a chat template runs in: jinja2's immutable sandbox, with a time and a size limit.

A chat template is code from a model hub. jinja2's ``ImmutableSandboxedEnvironment`` keeps it
away from Python's internals and from changing its inputs, but not from running forever or
building a string larger than memory. Here every loop iteration, call, attribute lookup,
operator and filter of the template checks the clock, and every value it builds is measured:

- time: ``seconds`` per conversation (``HPCPAR_TEMPLATE_SECONDS``); nested loops that never
  print still look at the clock at each iteration;
- size: ``chars`` per value and per rendered conversation (``HPCPAR_TEMPLATE_MB``), checked
  before the operations that could make something large in one step (``s * n``, ``a ** b``,
  ``"%*d" % ...``, ``center``, ``replace``, ``join``, ``indent``, ``wordwrap``, ``tojson`` ...),
  and after every other one, so no value outgrows the limit by more than one step;
- integers: at most ``INT_BITS`` bits (Python's own limit prints no more than 4300 digits).

Past one, rendering stops with ``RenderLimit``. No thread and no signal is used (they would
meet MPI's): the checks run inside the template's own code, as it calls back into this
environment.
"""

from __future__ import annotations

import inspect
import json
import re
from functools import update_wrapper
from math import inf, log2
from time import perf_counter

from jinja2 import nodes
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum
from jinja2.visitor import NodeTransformer

INT_BITS = 1 << 16              # no chat template needs an integer larger than 2^65536
PASSED = ("context", "eval_ctx", "environment")   # what jinja passes a filter first
_NUMBER = re.compile(r"\d+")
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d+|\*)?(?:\.(\d+|\*))?")   # %-09.3f
_BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")                           # {0:>9.3}
_NESTED_SPEC = re.compile(r":[^{}]*\{")          # "{0:{1}}": a width taken from the arguments


class RenderLimit(Exception):
    """A template ran past its time or size limit (the message says which, and how to raise
    it)."""


class _Guard(NodeTransformer):
    """Every ``{% for %}`` iterates through ``environment.looped`` (which looks at the clock
    at each item), and every ``~`` concatenation passes ``environment.sized``."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = _call("looped", node.iter)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        return _call("sized", self.generic_visit(node))


def _call(method: str, arg: nodes.Expr) -> nodes.Call:
    return nodes.Call(nodes.EnvironmentAttribute(method, lineno=arg.lineno), [arg], [], None,
                      None, lineno=arg.lineno)


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox (with ``trim_blocks``, ``lstrip_blocks`` and loop controls,
    as transformers renders chat templates), bounded in time and size: ``limit`` sets the
    bounds of the next rendering, ``compile_source`` turns a template's source into a template
    whose loops and concatenations check them."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        self.deadline, self.seconds, self.chars = inf, 0.0, 0
        self.concat = self._concat                   # how buffered output (macros, set) joins
        self.filters["tojson"] = self.tojson
        for name, f in list(self.filters.items()):
            self.filters[name] = self._checked_filter(f, _PRECHECKS.get(name))
        self.globals["lipsum"] = self._lipsum

    # ---- the bounds ------------------------------------------------------------------------

    def limit(self, seconds: float, chars: int) -> None:
        """From now: ``seconds`` of rendering (0: no limit) and values and text of at most
        ``chars`` characters (0: no limit)."""
        self.seconds, self.chars = seconds, chars
        self.deadline = perf_counter() + seconds if seconds else inf

    def compile_source(self, source: str):
        """The template of ``source``, its loops and concatenations guarded (under the limits
        set last: compiling folds constant expressions, which runs their filters)."""
        return self.from_string(_Guard().visit(self.parse(source)))

    def tick(self) -> None:
        if perf_counter() > self.deadline:
            raise RenderLimit(f"rendering the chat template took more than {self.seconds:g} s "
                              f"(HPCPAR_TEMPLATE_SECONDS={self.seconds:g}); raise it (0: no "
                              "limit) if the template is meant to take that long")

    def too_large(self, size, what: str = "built a value") -> None:
        if self.chars and isinstance(size, (int, float)) and size > self.chars:
            mb = self.chars / 1e6
            raise RenderLimit(f"the chat template {what} of more than {mb:g} MB "
                              f"(HPCPAR_TEMPLATE_MB={mb:g}); raise it (0: no limit) if the "
                              "conversation is meant to be that long")

    def sized(self, value):
        """``value``, once checked against the size limit (and an integer's bits)."""
        self.tick()
        if isinstance(value, int) and value.bit_length() > INT_BITS:
            self.too_many_bits()
        if self.chars:
            self.too_large(self.weight(value))
        return value

    @staticmethod
    def too_many_bits() -> None:
        raise RenderLimit(f"the chat template computed an integer of more than {INT_BITS:,} "
                          "bits, which no template needs")

    def weight(self, value) -> int:
        """About the characters ``value`` prints as: a string's length, a container's items'
        summed (a list repeating one string counts it each time); stops past the limit."""
        total, stack, seen = 0, [value], 0
        while stack:
            v = stack.pop()
            if isinstance(v, (str, bytes)):
                total += len(v)
            elif isinstance(v, int):
                total += v.bit_length() // 3 + 1          # about its decimal digits
            elif isinstance(v, dict):
                stack.extend(v.keys())
                stack.extend(v.values())
                total += 1
            elif isinstance(v, (list, tuple, set, frozenset)):
                stack.extend(v)
                total += 1
            else:
                total += 1
            if total > self.chars:
                return total
            seen += 1
            if not seen & 4095:
                self.tick()
        return total

    def looped(self, iterable):
        """A loop's items, the clock checked at each one."""
        for item in iterable:
            self.tick()
            yield item

    # ---- the sandbox's hooks ---------------------------------------------------------------

    def call(__self, __context, __obj, *args, **kwargs):  # jinja's own signature
        __self.tick()
        if isinstance(getattr(__obj, "__self__", None), (str, bytes)):
            __self._check_method(__obj, args)
        return __self.sized(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj, attribute):
        self.tick()
        return self._format_checked(obj, attribute, super().getattr(obj, attribute))

    def getitem(self, obj, argument):
        self.tick()
        return self._format_checked(obj, argument, super().getitem(obj, argument))

    def call_binop(self, context, operator, left, right):
        self.tick()
        if operator == "*":
            self._check_product(left, right)
        elif operator == "**":
            self._check_power(left, right)
        elif operator == "%" and isinstance(left, str):
            self._check_format(left, right if isinstance(right, tuple) else (right,), "%")
        return self.sized(super().call_binop(context, operator, left, right))

    def _concat(self, pieces) -> str:
        pieces = list(pieces)
        self.too_large(sum(map(len, pieces)), "rendered a text")
        return "".join(pieces)

    # ---- checks before an operation that could make a large value in one step ---------------

    def _check_product(self, left, right) -> None:
        for seq, n in ((left, right), (right, left)):
            if isinstance(n, int) and not isinstance(seq, (int, float)) and n > 0:
                self.too_large(self.weight(seq) * n)
        if isinstance(left, int) and isinstance(right, int) and (
                left.bit_length() + right.bit_length() > INT_BITS):
            self.too_many_bits()

    def _check_power(self, base, exponent) -> None:
        if (isinstance(base, int) and isinstance(exponent, int) and exponent > 0
                and abs(base) > 1 and exponent * log2(abs(base)) > INT_BITS):
            self.too_many_bits()

    def _check_format(self, fmt: str, args, style: str) -> None:
        """The widths and precisions of a ``%`` (``style`` "%") or ``str.format`` ("{}")
        format string (``%9d``, ``{:>9}``, and from the arguments for ``%*d`` or ``{0:{1}}``)
        within the size limit."""
        args = [v for a in args for v in (a.values() if isinstance(a, dict) else [a])]
        if style == "%":
            specs = [n for spec in _PERCENT_SPEC.findall(fmt) for n in spec]
            from_args = "*" in specs
        else:
            specs = [n for spec in _BRACE_SPEC.findall(fmt) for n in _NUMBER.findall(spec)]
            from_args = _NESTED_SPEC.search(fmt) is not None
        widths = [int(n) for n in specs if n.isdigit()]
        if from_args:
            widths += [abs(a) for a in args if isinstance(a, int)]
        self.too_large(max(widths, default=0))

    def _format_checked(self, obj, name, value):
        """``str.format`` / ``format_map``, found through ``.`` or ``[]``, checked first."""
        if not (isinstance(obj, str) and name in ("format", "format_map") and callable(value)):
            return value

        def checked(*args, **kwargs):
            self._check_format(obj, (*args, *kwargs.values()), "{}")
            return value(*args, **kwargs)
        return update_wrapper(checked, value)

    def _check_method(self, method, args) -> None:
        s, name = method.__self__, method.__name__
        if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
            self.too_large(args[0])
        elif name == "expandtabs" and args and isinstance(args[0], int):
            self.too_large(len(s) + s.count("\t" if isinstance(s, str) else b"\t") * args[0])
        elif name == "replace" and len(args) >= 2:
            self.too_large(_replaced_length(s, *args[:3]))
        elif name == "join" and args:
            self.too_large(self._joined(args[0], s))
        elif name == "translate" and args and isinstance(args[0], dict):
            longest = max((self.weight(v) for v in args[0].values()), default=1)
            self.too_large(len(s) * longest)

    def _joined(self, items, separator) -> int:
        if not isinstance(items, (list, tuple, str)):
            return 0                               # a generator: checked after, as it runs
        return self.weight(items) + len(separator) * max(len(items) - 1, 0)

    # ---- filters and globals ----------------------------------------------------------------

    def _checked_filter(self, f, precheck):
        """``f`` looking at the clock, checking its arguments with ``precheck`` (before) and
        its result's size (after); jinja's markers (pass_context ...) kept."""
        signature = inspect.signature(f) if precheck else None
        # the context / environment jinja passes first, when the signature does not show it
        lead = int(precheck is not None and getattr(f, "jinja_pass_arg", None) is not None
                   and next(iter(signature.parameters)) not in PASSED)

        def checked(*args, **kwargs):
            self.tick()
            if precheck is not None:
                bound = signature.bind(*args[lead:], **kwargs)
                bound.apply_defaults()
                if precheck(self, bound.arguments):          # True: it read a generator
                    args, kwargs = (*args[:lead], *bound.args), bound.kwargs
            return self.sized(f(*args, **kwargs))
        return update_wrapper(checked, f)

    def _lipsum(self, n=5, html=True, min=20, max=100):   # jinja's names
        self.too_large(int(n) * int(max) * 12)
        return self.sized(generate_lorem_ipsum(n, html, min, max))

    def tojson(self, value, ensure_ascii=False, indent=None, separators=None,
               sort_keys=False) -> str:
        """transformers' ``tojson`` (non-ASCII text kept), built piece by piece within the
        size limit."""
        encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent,
                                   separators=separators, sort_keys=sort_keys)
        if isinstance(indent, int):
            self.too_large(indent)
        elif isinstance(indent, str):
            self.too_large(len(indent))
        pieces, size = [], 0
        for piece in encoder.iterencode(value):
            size += len(piece)
            self.too_large(size, "rendered a text")
            self.tick()
            pieces.append(piece)
        return "".join(pieces)


def _replaced_length(s, old, new, count=-1) -> int:
    count = -1 if count is None else count
    found = len(s) + 1 if not old else s.count(old)
    found = found if count < 0 else min(found, count)
    return len(s) + found * (len(new) - len(old))


def _soft(value) -> str:
    return value if isinstance(value, str) else str(value)


def _pre_center(env, a):
    env.too_large(a["width"])


def _pre_indent(env, a):
    text, width = _soft(a["s"]), a["width"]
    width = len(width) if isinstance(width, str) else width
    if isinstance(width, int):
        env.too_large(len(text) + (text.count("\n") + 1) * width)


def _pre_replace(env, a):
    if isinstance(a["count"], (int, type(None))):
        env.too_large(_replaced_length(_soft(a["s"]), _soft(a["old"]), _soft(a["new"]),
                                       a["count"]))


def _pre_join(env, a):
    items, read = a["value"], False
    if not isinstance(items, (list, tuple, str)):
        a["value"] = items = list(env.looped(items))       # a generator is read once, here
        read = True
    env.too_large(env._joined(items, _soft(a["d"])))
    return read


def _pre_wordwrap(env, a):
    text, width, wrap = _soft(a["s"]), a["width"], a["wrapstring"]
    if isinstance(width, int):
        wrap = "\n" if wrap is None else _soft(wrap)
        env.too_large(len(text) + (len(text) // max(width, 1) + 1) * len(wrap))


def _pre_format(env, a):
    env._check_format(_soft(a["value"]), (*a["args"], *a["kwargs"].values()), "%")


def _pre_batch(env, a):
    env.too_large(a["linecount"])


def _pre_slice(env, a):
    env.too_large(a["slices"])


_PRECHECKS = {"center": _pre_center, "indent": _pre_indent, "replace": _pre_replace,
              "join": _pre_join, "wordwrap": _pre_wordwrap, "format": _pre_format,
              "batch": _pre_batch, "slice": _pre_slice}
