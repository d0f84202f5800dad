"""A pretend device for tests: NumPy arrays that must be moved to and from the host explicitly,
as CuPy's must (``HPCPAR_BACKEND=strict``).

The GPU path goes wrong in one way a CPU run cannot show: code that hands a host (NumPy) array
where a device array is expected, or reads a device array as if it were on the host. CuPy
refuses both (``TypeError``), so such code fails on the first GPU run. ``StrictArray`` wraps a
NumPy array and refuses the same things:

- implicit conversion to NumPy (``np.asarray(x)``, the buffer protocol, MPI): ``TypeError``,
  with CuPy's own advice; ``x.get()`` and ``xp.asnumpy(x)`` are the explicit ways out;
- a NumPy array among the operands of an operator or an ``xp`` / ``np`` function:
  ``TypeError``; ``xp.asarray`` and ``xp.array`` are the explicit way in;
- ``xp.ascontiguousarray(numpy_array)`` (CuPy takes only its own arrays there).

What CuPy allows stays allowed: Python scalars and lists, ``int(x)`` / ``float(x)`` of one
element, ``x.item()``, ``x.set(numpy_array)`` (a host-to-device copy), NumPy functions called
on device arrays (dispatched through ``__array_function__`` / ``__array_ufunc__``). And what it
refuses is refused: ``x[...] = numpy_array`` (CuPy 14 fills a view from scalars alone).
Everything is computed by NumPy on the host, so results equal a NumPy run bit for bit.

While a ``parallel.device.budget.Budget`` counts, every operation here reports to it: an operation
that computes (one kernel launch on a GPU), a new array and its bytes, a read back to the host
(a sync), an upload. Views (slices, reshapes, transposes) compute nothing and are not counted.
While a step is captured (``parallel.device.capture``, for ``parallel.device.graphs``), every
operation is recorded and what a CUDA graph cannot hold (a read, an upload, CuPy's matmul) is
refused.
"""

from __future__ import annotations

import types

import numpy as np

from . import budget, capture

_IMPLICIT = ("Implicit conversion to a NumPy array is not allowed (strict device backend, "
             "as CuPy). Please use `.get()` to construct a NumPy array explicitly.")


def _mixed(what) -> TypeError:
    return TypeError(f"Unsupported type {type(what)} (a host NumPy array where a device array "
                     "is expected: move it with xp.asarray first, as CuPy requires)")


def _unwrap(value):
    """Arguments for NumPy: StrictArray -> its array; a NumPy array is refused."""
    if isinstance(value, StrictArray):
        return value._a
    if isinstance(value, np.ndarray):
        raise _mixed(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v) for v in value)
    return value


def _unwrap_kwargs(kwargs: dict) -> dict:
    return {k: _unwrap(v) for k, v in kwargs.items()}


def _wrap(value):
    """Results from NumPy: arrays (and arrays in tuples) become StrictArrays; so does a
    reduction's NumPy scalar (CuPy's is a 0-d device array, and reading it is a sync)."""
    if isinstance(value, np.ndarray):
        return StrictArray(value)
    if isinstance(value, np.generic):
        return StrictArray(np.asarray(value))
    if isinstance(value, tuple):
        return tuple(_wrap(v) for v in value)
    if isinstance(value, list):
        return [_wrap(v) for v in value]
    return value


def unwrapped(a):
    """The NumPy array a strict array stands for; anything else as it is."""
    return a._a if isinstance(a, StrictArray) else a


def arrays_of(value) -> list[np.ndarray]:
    """The NumPy arrays among (nested) values: arguments, results, contexts."""
    return _arrays(value, [])


def _arrays(value, out: list) -> list:
    """The NumPy arrays among (nested) arguments, unwrapped."""
    if isinstance(value, StrictArray):
        out.append(value._a)
    elif isinstance(value, np.ndarray):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _arrays(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _arrays(v, out)
    return out


def _counted(result, inputs: list, computes: bool = True):
    """Report ``result`` of an operation on ``inputs`` (NumPy arrays) to the budget counting
    now: a result that shares no memory with an input is a new array, computed (``computes``:
    False for ``empty``, which only allocates); one that does is a view (nothing), unless
    the operation wrote into it (``out=``, in place: ``result`` None)."""
    b = budget._current
    if b is None:
        return result
    several = isinstance(result, (tuple, list))          # (``split`` returns a list of views)
    fresh = [r for r in (result if several else (result,))
             if isinstance(r, np.ndarray)
             and not any(np.may_share_memory(r, a) for a in inputs)]
    if result is None or not (several or isinstance(result, np.ndarray)) or fresh:
        if computes:
            b.op()
    for r in fresh:
        b.allocated(r)
    return result


def _read() -> None:
    if capture._active is not None:
        capture._active.read()
    b = budget._current
    if b is not None:
        b.read()


def _upload() -> None:
    if capture._active is not None:
        capture._active.upload()
    if budget._current is not None:
        budget._current.upload()


def _record(name: str, args) -> None:
    if capture._active is not None:
        capture._active.record(name, args)


def _basic(key) -> bool:
    """An index of ints, slices, ``...`` and ``None`` alone (a view: CuPy's basic indexing)."""
    keys = key if isinstance(key, tuple) else (key,)
    return all(k is None or k is Ellipsis or isinstance(k, (int, slice, np.integer))
               for k in keys)


def _index(key):
    """An index: device arrays unwrap; host index arrays are allowed (CuPy copies them)."""
    if isinstance(key, StrictArray):
        return key._a
    if isinstance(key, tuple):
        return tuple(_index(k) for k in key)
    return key


class StrictArray:
    """A device array stand-in around a NumPy array (see the module docstring)."""

    __slots__ = ("_a",)
    __array_priority__ = 100

    def __init__(self, a: np.ndarray):
        self._a = a

    # ---- leaving and entering the device ----------------------------------------------------

    def __array__(self, dtype=None, copy=None):
        raise TypeError(_IMPLICIT)

    def get(self, stream=None, order="C", out=None) -> np.ndarray:
        _read()
        if out is not None:
            np.copyto(out, self._a)
            return out
        return np.array(self._a, order=order)

    def set(self, arr, stream=None) -> None:
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"Only numpy.ndarray can be set to a device array, not {type(arr)}")
        _upload()
        self._a[...] = arr

    def item(self):
        _read()
        return self._a.item()

    def tolist(self):
        _read()
        return self._a.tolist()

    def __float__(self):
        _read()
        return float(self._a)

    def __int__(self):
        _read()
        return int(self._a)

    def __bool__(self):
        _read()
        return bool(self._a)

    def __index__(self):
        _read()
        return self._a.__index__()

    # ---- NumPy's protocols: device arrays in, device arrays out -----------------------------

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        _record(ufunc.__name__ if method == "__call__" else f"{ufunc.__name__}.{method}",
                (inputs, kwargs))
        out = kwargs.pop("out", None)
        kwargs = _unwrap_kwargs(kwargs)
        if out is not None:
            kwargs["out"] = tuple(_unwrap(o) for o in out)
        args = _unwrap(inputs)
        result = getattr(ufunc, method)(*args, **kwargs)
        if out is not None:          # in place: hand back the device arrays given
            _counted(None, [])
            return out[0] if len(out) == 1 else out
        return _wrap(_counted(result, _arrays(args, [])))

    def __array_function__(self, func, types_, args, kwargs):
        _record(func.__name__, (args, kwargs))
        args, kwargs = _unwrap(args), _unwrap_kwargs(kwargs)
        return _wrap(_counted(func(*args, **kwargs), _arrays((args, kwargs), []),
                              func.__name__ not in _ALLOCATE_ONLY))

    # ---- array behaviour --------------------------------------------------------------------

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: StrictArray(self._a.T))

    def __getitem__(self, key):
        _record("getitem", (self, key))
        return _wrap(_counted(self._a[_index(key)], [self._a]))

    def __setitem__(self, key, value):
        _record("setitem", (self, key, value))
        if isinstance(value, StrictArray):
            value = value._a
        elif isinstance(value, np.ndarray) and value.ndim and _basic(key):
            # CuPy 14 fills a basic slice from scalars alone (found on an H100)
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill (as CuPy): "
                             "copy host data in with .set() or xp.asarray first")
        elif isinstance(value, np.ndarray):
            _upload()
        self._a[_index(key)] = value
        _counted(None, [])

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (_wrap(row) for row in self._a)

    def __repr__(self):
        return f"strict.{self._a!r}"

    def __getattr__(self, name):
        """Array methods (astype, reshape, sum, view, ...): device in, device out."""
        if name.startswith("__"):      # __array_interface__ and the like: no host view
            raise AttributeError(name)
        attr = getattr(self._a, name)
        return _Function(attr) if callable(attr) else _wrap(attr)


def _binary(ufunc, reflected=False):
    if reflected:
        return lambda self, other: ufunc(other, self)
    return lambda self, other: ufunc(self, other)


def _inplace(ufunc):
    def op(self, other):
        ufunc(self, other, out=(self,))
        return self
    return op


for _name, _ufunc in [("add", np.add), ("sub", np.subtract), ("mul", np.multiply),
                      ("truediv", np.true_divide), ("floordiv", np.floor_divide),
                      ("mod", np.remainder), ("pow", np.power), ("matmul", np.matmul),
                      ("and", np.bitwise_and), ("or", np.bitwise_or), ("xor", np.bitwise_xor),
                      ("lshift", np.left_shift), ("rshift", np.right_shift)]:
    setattr(StrictArray, f"__{_name}__", _binary(_ufunc))
    setattr(StrictArray, f"__r{_name}__", _binary(_ufunc, reflected=True))
    setattr(StrictArray, f"__i{_name}__", _inplace(_ufunc))
for _name, _ufunc in [("lt", np.less), ("le", np.less_equal), ("gt", np.greater),
                      ("ge", np.greater_equal), ("eq", np.equal), ("ne", np.not_equal)]:
    setattr(StrictArray, f"__{_name}__", _binary(_ufunc))
StrictArray.__neg__ = lambda self: np.negative(self)
StrictArray.__pos__ = lambda self: np.positive(self)
StrictArray.__abs__ = lambda self: np.absolute(self)
StrictArray.__invert__ = lambda self: np.invert(self)
StrictArray.__hash__ = None


class _Function:
    """An ``xp`` function (or ufunc, with its methods such as ``add.at``): device arrays in,
    device arrays out, host arrays refused."""

    def __init__(self, fn):
        self._fn = fn

    def __call__(self, *args, **kwargs):
        _record(getattr(self._fn, "__name__", "function"), (args, kwargs))
        args, kwargs = _unwrap(args), _unwrap_kwargs(kwargs)
        inputs = _arrays((args, kwargs), [])
        owner = getattr(self._fn, "__self__", None)     # a bound method's array
        if isinstance(owner, np.ndarray):
            inputs.append(owner)
        result = self._fn(*args, **kwargs)
        if kwargs.get("out") is not None:   # written into ``out``: a kernel, no new array
            _counted(None, [])
            return _wrap(result)
        return _wrap(_counted(result, inputs,
                              getattr(self._fn, "__name__", "") not in _ALLOCATE_ONLY))

    def __getattr__(self, name):
        attr = getattr(self._fn, name)
        return _Function(attr) if callable(attr) else attr


_ALLOCATE_ONLY = ("empty", "empty_like")      # new arrays that no kernel fills


def asarray(a, dtype=None, order=None):
    """Host data (or a device array) to the device: the explicit way in."""
    if isinstance(a, StrictArray):
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    data = np.array(a, dtype=dtype, order=order or "K", copy=True)
    _upload()
    if budget._current is not None:
        budget._current.allocated(data)
    return StrictArray(data)


def array(a, dtype=None, copy=True, order="K"):
    if isinstance(a, StrictArray):
        _record("array", (a, dtype, order))
        return StrictArray(_counted(np.array(a._a, dtype=dtype, copy=True, order=order), []))
    return asarray(a, dtype=dtype, order=order)


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, StrictArray):          # CuPy: "Argument 'a' has incorrect type"
        raise TypeError(f"Argument 'a' has incorrect type (expected device array, got "
                        f"{type(a).__name__}): ascontiguousarray takes only device arrays")
    _record("ascontiguousarray", (a, dtype))
    return StrictArray(_counted(np.ascontiguousarray(a._a, dtype=dtype), [a._a]))


def peek(a: StrictArray) -> np.ndarray:
    """The host array behind ``a``, uncounted and unchecked: for the backend's own checks
    (``parallel.device.graphs``), never for the program's reads."""
    return a._a


def asnumpy(a, out=None):
    return a.get(out=out) if isinstance(a, StrictArray) else np.asarray(a)


class _Module(types.ModuleType):
    """``xp`` for the strict backend: NumPy's namespace, wrapped."""

    ndarray = StrictArray

    def __getattr__(self, name):
        attr = getattr(np, name)
        if isinstance(attr, types.ModuleType):
            raise AttributeError(f"the strict backend has no xp.{name} (module)")
        if callable(attr) and not isinstance(attr, type):
            return _Function(attr)
        return attr                      # dtypes, constants


xp = _Module("hpcpar.parallel.device.strict_arrays.xp")
for _fn in (asarray, array, ascontiguousarray, asnumpy):
    setattr(xp, _fn.__name__, _fn)
