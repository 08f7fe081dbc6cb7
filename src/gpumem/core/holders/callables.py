"""The data code objects keep alive, read without running them: closures, defaults, bound objects, frames, classes.

Functions, methods, generators and cells are final types, so their attributes are the interpreter's own and
reading them runs no user code; a class's namespace is read through ``type``'s own ``__dict__`` descriptor.
Library code stays opaque (its closures and class attributes are the library's business and would cost
time), except suspended generators: their locals are the arguments of one call, which is user data.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from gpumem.core.holders.objects import OPAQUE_MODULE_PREFIXES, function_frame_locals, stable_list

__all__ = ["LIBRARY_PACKAGES", "Members", "code_reader", "is_library_module"]

# (path suffix, value) of what one code object keeps alive; None when it is running and was not read.
Members = list[tuple[str, Any]] | None

# Top-level packages whose functions and classes stay opaque, besides the opaque module prefixes.
LIBRARY_PACKAGES = frozenset({"builtins", "torch", "numpy"})

_CLASS_DICT: Any = type.__dict__["__dict__"]
_EMPTY = object()


def is_library_module(name: object) -> bool:
    """Whether code of module ``name`` is a tool's or library's (opaque) rather than the user's."""
    if not isinstance(name, str):
        return False
    return name.startswith(OPAQUE_MODULE_PREFIXES) or name.partition(".")[0] in LIBRARY_PACKAGES


def code_reader(cls: type) -> Callable[[Any], Members] | None:
    """How to read instances of ``cls`` when they are code (functions, methods, generators, classes)."""
    reader = _READERS.get(cls)
    if reader is None and issubclass(cls, type):
        return _class_members
    return reader


def _function_members(function: types.FunctionType) -> Members:
    """Closure cells, default arguments and function attributes of a user function (not its globals)."""
    if is_library_module(function.__module__):
        return []
    code = function.__code__
    members: list[tuple[str, Any]] = []
    for name, cell in zip(code.co_freevars, function.__closure__ or (), strict=False):
        value = _cell_value(cell)
        if value is not _EMPTY:
            members.append((f".<closure {name}>", value))
    defaults = function.__defaults__ or ()
    positional = code.co_varnames[: code.co_argcount]
    for name, value in zip(positional[len(positional) - len(defaults) :], defaults, strict=False):
        members.append((f".<default {name}>", value))
    keyword_defaults = function.__kwdefaults__
    if type(keyword_defaults) is dict:
        members.extend((f".<default {name}>", value) for name, value in stable_list(keyword_defaults.items))
    attributes = function.__dict__
    if type(attributes) is dict:
        members.extend((f".{name}", value) for name, value in stable_list(attributes.items))
    return members


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell: the variable is not assigned yet
        return _EMPTY


def _method_members(method: types.MethodType) -> Members:
    """A bound method keeps its object and its function."""
    return [(".__self__", method.__self__), (".__func__", method.__func__)]


def _builtin_method_members(method: Any) -> Members:
    """A built-in bound method (``tensor.add_``, ``list.append``) keeps its object; a module's function, nothing."""
    bound = method.__self__
    if bound is None or isinstance(bound, types.ModuleType):
        return []
    return [(".__self__", bound)]


def _suspended_frame_members(frame: types.FrameType | None, running: bool, awaited: Any) -> Members:
    """The locals of a suspended generator or coroutine; never a running frame's (it may be this thread's)."""
    if running:
        return None
    members: list[tuple[str, Any]] = []
    if frame is not None:
        members.extend((f".<local {name}>", value) for name, value in function_frame_locals(frame))
    if awaited is not None:
        members.append((".<awaiting>", awaited))
    return members


def _generator_members(generator: types.GeneratorType[Any, Any, Any]) -> Members:
    return _suspended_frame_members(generator.gi_frame, generator.gi_running, generator.gi_yieldfrom)


def _coroutine_members(coroutine: types.CoroutineType[Any, Any, Any]) -> Members:
    return _suspended_frame_members(coroutine.cr_frame, coroutine.cr_running, coroutine.cr_await)


def _async_generator_members(generator: types.AsyncGeneratorType[Any, Any]) -> Members:
    return _suspended_frame_members(generator.ag_frame, generator.ag_running, generator.ag_await)


def _class_members(cls: type) -> Members:
    """A user class's own attributes (``Config.table``); its dunders, bases and library classes are skipped."""
    namespace = _CLASS_DICT.__get__(cls)
    if is_library_module(namespace.get("__module__")):
        return []
    return [
        (f".{name}", value)
        for name, value in stable_list(namespace.items)
        if not (isinstance(name, str) and name.startswith("__") and name.endswith("__"))
    ]


_READERS: dict[type, Callable[[Any], Members]] = {
    types.FunctionType: _function_members,
    types.MethodType: _method_members,
    types.BuiltinFunctionType: _builtin_method_members,  # also types.BuiltinMethodType: the same type
    types.MethodWrapperType: _builtin_method_members,
    types.GeneratorType: _generator_members,
    types.CoroutineType: _coroutine_members,
    types.AsyncGeneratorType: _async_generator_members,
}
