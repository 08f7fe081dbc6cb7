"""How the walk reads an object without running its code, and the types it never enters.

Nothing here calls a property, ``__getattr__``, ``__len__`` or ``__iter__`` of a user class: the instance
``__dict__`` and ``__slots__`` are found through the class dicts and read through the interpreter's own
descriptors. A container another thread may be changing (a widget callback walks the namespace while a cell
runs) is copied in one C call, again if it changed under the copy (:func:`stable_list`).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from itertools import islice
from typing import Any, TypeVar

__all__ = [
    "ATOMIC_TYPES",
    "EXCEPTION_ARGS",
    "EXCEPTION_CAUSE",
    "EXCEPTION_CONTEXT",
    "EXCEPTION_TRACEBACK",
    "MODULE_INTERNALS",
    "OPAQUE_MODULE_PREFIXES",
    "OPAQUE_TYPES",
    "READ_ATTEMPTS",
    "function_frame_locals",
    "instance_layout",
    "is_opaque",
    "own_dict",
    "slot_values",
    "stable_list",
    "type_name",
]


# Read a container another thread may be changing: a widget callback walks the namespace while a cell runs.
#
# Iterating a dict, set or deque that changes size raises ``RuntimeError``; a list copy made by one C call
# almost never sees a change, and when it does (the interpreter switched threads mid-copy, e.g. to run a
# finalizer) the copy is simply taken again.
T = TypeVar("T")

READ_ATTEMPTS = 64  # each attempt is one C-level copy; a switch mid-copy needs a finalizer or GC to run


def stable_list(read: Callable[[], Iterable[T]], limit: int | None = None) -> list[T]:
    """A list of what ``read()`` yields (at most ``limit`` items), read again if the container changed under it.

    ``read`` is called once per attempt (``user_ns.items``, ``partial(dict.items, obj)``). After
    :data:`READ_ATTEMPTS` failed copies the last ``RuntimeError`` propagates.
    """
    attempt = 1
    while True:  # RuntimeError: "dictionary changed size during iteration", "deque mutated during iteration"
        try:
            return list(islice(read(), limit))
        except RuntimeError:  # noqa: PERF203 (this loop is the retry: it runs once unless the copy failed)
            if attempt >= READ_ATTEMPTS:
                raise
            attempt += 1


# Values that hold no references worth following.
ATOMIC_TYPES: frozenset[type] = frozenset(
    {
        int,
        float,
        complex,
        bool,
        str,
        bytes,
        bytearray,
        type(None),
        range,
        slice,
        type(Ellipsis),
        type(NotImplemented),
        memoryview,
    }
)
# Code, classes and descriptors: what they reference is program structure, not data.
OPAQUE_TYPES = (
    types.ModuleType,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.BuiltinMethodType,
    types.GeneratorType,
    types.CoroutineType,
    types.AsyncGeneratorType,
    types.FrameType,
    types.CodeType,
    types.MappingProxyType,
    types.GetSetDescriptorType,
    types.MemberDescriptorType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.MethodDescriptorType,
    types.ClassMethodDescriptorType,
    property,
    staticmethod,
    classmethod,
)
# Objects of these packages are tools, not data: walking them only costs time (and IPython's are
# reported in their own section).
OPAQUE_MODULE_PREFIXES = (
    "IPython.",
    "ipykernel.",
    "traitlets.",
    "zmq.",
    "tornado.",
    "ipywidgets.",
    "jupyter_client.",
    "prompt_toolkit.",
    "asyncio.",
    "threading",
    "concurrent.",
    "logging",
    "gpumem.",
    "bqplot.",
    "weakref",
    "_weakref",
    "typing",
    "abc",
    "enum",
)

# nn.Module attributes that are bookkeeping, never user data.
MODULE_INTERNALS = frozenset(
    {
        "training",
        "_parameters",
        "_buffers",
        "_modules",
        "_non_persistent_buffers_set",
        "_backward_pre_hooks",
        "_backward_hooks",
        "_is_full_backward_hook",
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_compiled_call_impl",
    }
)

# BaseException's own attribute descriptors: reading through them never runs a subclass's property.
EXCEPTION_ARGS: Any = BaseException.__dict__["args"]
EXCEPTION_TRACEBACK: Any = BaseException.__dict__["__traceback__"]
EXCEPTION_CAUSE: Any = BaseException.__dict__["__cause__"]
EXCEPTION_CONTEXT: Any = BaseException.__dict__["__context__"]

_CO_OPTIMIZED = 0x1  # a function frame; without it the frame is a module or class body (a namespace)
_LAYOUT_CACHE_SIZE = 4096
_UNREADABLE = object()

_MRO: Any = type.__dict__["__mro__"]
_CLASS_DICT: Any = type.__dict__["__dict__"]
_layout_cache: dict[type, tuple[bool, tuple[str, ...]]] = {}


def instance_layout(cls: type) -> tuple[bool, tuple[str, ...]]:
    """(has a plain instance ``__dict__``, slot names) for ``cls``, read from the class dicts only."""
    cached = _layout_cache.get(cls)
    if cached is not None:
        return cached
    slots: list[str] = []
    try:
        mro = _MRO.__get__(cls)
    except Exception:
        mro = (cls,)
    dict_descriptor: Any = None
    for klass in mro:
        class_dict = _CLASS_DICT.__get__(klass)
        if dict_descriptor is None:
            dict_descriptor = class_dict.get("__dict__")
        for name, value in stable_list(class_dict.items):
            if isinstance(value, types.MemberDescriptorType) and name not in slots:
                slots.append(name)
    result = (isinstance(dict_descriptor, types.GetSetDescriptorType), tuple(slots))
    if len(_layout_cache) < _LAYOUT_CACHE_SIZE:
        _layout_cache[cls] = result
    return result


def own_dict(obj: Any) -> dict[str, Any] | None:
    """``obj.__dict__`` when it is the interpreter's own instance dict (never a property's result)."""
    plain, _ = instance_layout(type(obj))
    if not plain:
        return None
    try:
        value = object.__getattribute__(obj, "__dict__")
    except Exception:
        return None
    return value if type(value) is dict else None


def slot_values(obj: Any) -> list[tuple[str, Any]]:
    """``(name, value)`` of every filled slot of ``obj``, read through the slots' member descriptors."""
    cls = type(obj)
    values: list[tuple[str, Any]] = []
    for name in instance_layout(cls)[1]:
        value = _read_slot(cls, name, obj)
        if value is not _UNREADABLE:
            values.append((name, value))
    return values


def _read_slot(cls: type, name: str, obj: Any) -> Any:
    for klass in _MRO.__get__(cls):
        descriptor = _CLASS_DICT.__get__(klass).get(name)
        if descriptor is None:
            continue
        if not isinstance(descriptor, types.MemberDescriptorType):
            return _UNREADABLE
        try:
            return descriptor.__get__(obj, cls)
        except Exception:  # an unset slot raises AttributeError
            return _UNREADABLE
    return _UNREADABLE


def is_opaque(cls: type) -> bool:
    """Whether the walk never enters instances of ``cls`` (code, descriptors, tool packages' objects)."""
    if issubclass(cls, OPAQUE_TYPES):
        return True
    module = cls.__dict__.get("__module__") if "__module__" in cls.__dict__ else None
    return isinstance(module, str) and module.startswith(OPAQUE_MODULE_PREFIXES)


def function_frame_locals(frame: types.FrameType) -> list[tuple[str, Any]]:
    """The locals of a function frame of user code; nothing for namespaces, tool packages, unreadable frames."""
    if not frame.f_code.co_flags & _CO_OPTIMIZED:
        return []
    module_name = frame.f_globals.get("__name__", "")
    if isinstance(module_name, str) and module_name.startswith(OPAQUE_MODULE_PREFIXES):
        return []
    try:
        return stable_list(frame.f_locals.items)
    except Exception:
        return []


def type_name(value: Any) -> str:
    """The class name, read without trusting it to be a string."""
    name = type(value).__name__
    return name if isinstance(name, str) else "?"
