"""The bounded walk from one root (a name, or one IPython reference) to the tensor storages it reaches.

Containers are read through their built-in base methods and copied before they are walked (another
thread may be changing them); ``nn.Module`` and optimizers are read by their own rules at any depth,
so that their tensors are categorized; user code (functions, methods, suspended generators, classes)
through what it keeps alive (:mod:`~.callables`); everything else through its own ``__dict__`` and slots.
"""

from __future__ import annotations

import sys
import time
import types
from collections import deque
from collections.abc import Iterable
from functools import partial
from typing import Any, NamedTuple

from gpumem.core.holders.callables import Members, code_reader
from gpumem.core.holders.hints import module_attribute_note
from gpumem.core.holders.model import (
    BUFFERS,
    GRADIENTS,
    MAX_GRAPH_PATHS,
    OPTIMIZER_STATE,
    OTHER,
    PARAMETERS,
    TENSORS,
)
from gpumem.core.holders.objects import (
    ATOMIC_TYPES,
    EXCEPTION_ARGS,
    EXCEPTION_CAUSE,
    EXCEPTION_CONTEXT,
    EXCEPTION_TRACEBACK,
    MODULE_INTERNALS,
    function_frame_locals,
    is_opaque,
    own_dict,
    slot_values,
    stable_list,
)
from gpumem.core.holders.tensors import DeviceFilter, StorageKey, storage_keys

__all__ = ["Edge", "OutOfTimeError", "Root", "Walker", "walk_root"]

# Containers walked element by element, read through these base classes (first match wins).
_ELEMENT_BASES: tuple[type, ...] = (list, tuple, set, frozenset, deque)
# What the walk does with an instance, by its class (Walker._classify).
_TENSOR, _CODE, _MODULE, _OPTIMIZER, _DICT, _ELEMENTS, _EXCEPTION, _TRACEBACK, _ARRAY, _OBJECT = range(10)
_MAX_FRAMES = 256  # frames of one traceback
_MAX_LABEL = 40  # characters of a dict key shown in a path
_TICKS_PER_CLOCK_READ = 256


class OutOfTimeError(Exception):
    """The walk's time budget is used up (raised from deep inside the walk, caught by the caller)."""


class Edge(NamedTuple):
    """How a root reaches one storage: the rank (lower is more direct), the byte category, the path."""

    rank: int
    category: str
    path: str


class Root:
    """What one name reaches: the best (lowest rank) edge to every storage."""

    __slots__ = (
        "attribute_paths",
        "graph_paths",
        "hidden",
        "name",
        "note",
        "order",
        "param_of_state",
        "reach",
        "tensor_ids",
        "type_name",
    )

    def __init__(self, name: str, type_name: str, order: int, hidden: bool, note: str = "") -> None:
        self.name = name
        self.type_name = type_name
        self.order = order
        self.hidden = hidden
        self.note = note
        self.reach: dict[StorageKey, Edge] = {}
        self.tensor_ids: set[int] = set()
        self.graph_paths: list[str] = []
        self.param_of_state: dict[StorageKey, StorageKey] = {}
        # Storages reached best through a module attribute that is no parameter or buffer -> that attribute's path.
        self.attribute_paths: dict[StorageKey, str] = {}


class Walker:
    """Walks roots one after another (``root`` and ``visited`` are reset per root), sharing the storage sizes."""

    def __init__(
        self,
        torch: Any,
        devices: DeviceFilter,
        max_depth: int,
        max_items: int,
        deadline: float,
    ) -> None:
        self.tensor_type: type = torch.Tensor
        self.module_type: type | None = getattr(getattr(torch, "nn", None), "Module", None)
        self.optimizer_type: type | None = getattr(getattr(torch, "optim", None), "Optimizer", None)
        self.ndarray_type: type | None = getattr(sys.modules.get("numpy"), "ndarray", None)
        self.devices = devices
        self.max_depth = max_depth
        self.max_items = max_items
        self.deadline = deadline
        self.sizes: dict[StorageKey, int] = {}
        self.truncation: list[str] = []
        self.incomplete: set[int] = set()  # ids of the roots whose walk stopped early
        self._depth_notes = 0
        self._ticks = 0
        self.root: Root = Root("", "", 0, hidden=False)
        self.visited: set[int] = set()
        self._kinds: dict[type, tuple[int, Any]] = {}  # by class: what to do with its instances (_classify)
        self._module_attribute: str | None = None  # the module attribute being walked (its path), if any

    # -- budget ------------------------------------------------------------------------------
    def _tick(self) -> None:
        self._ticks += 1
        if self._ticks % _TICKS_PER_CLOCK_READ == 0 and time.perf_counter() > self.deadline:
            raise OutOfTimeError

    def _note_depth(self, path: str) -> None:
        self.incomplete.add(id(self.root))
        self._depth_notes += 1
        if self._depth_notes == 1:
            self.truncation.append(f"depth limit {self.max_depth} reached (first at {path})")

    def _note_items(self, path: str, size: int) -> None:
        self.incomplete.add(id(self.root))
        self.truncation.append(f"{path} has {size:,} items; only the first {self.max_items:,} were looked at")

    # -- entry -------------------------------------------------------------------------------
    def visit(self, obj: Any, path: str, depth: int, rank: int, category: str) -> None:
        """Count ``obj`` if it is a tensor, else walk into it (once per root, within the depth limit)."""
        cls = type(obj)
        if cls in ATOMIC_TYPES:
            return
        self._tick()
        kind, how = self._kinds.get(cls) or self._classify(cls)
        if kind == _TENSOR:
            self.tensor(obj, path, rank, category)
            return
        oid = id(obj)
        if oid in self.visited:
            return
        if kind == _CODE:  # code is opaque to the generic walk: only its own reader enters it
            if how is not None:
                self._code(obj, how, path, depth, rank, category)
            return
        if kind in (_MODULE, _OPTIMIZER):  # walked by their own rules, at any depth
            self.visited.add(oid)
            (self.module if kind == _MODULE else self.optimizer)(obj, path, depth, rank)
            return
        if depth >= self.max_depth:
            self._note_depth(path)
            return
        self.visited.add(oid)
        self._enter(obj, kind, how, path, depth + 1, rank + 1, category)

    def _classify(self, cls: type) -> tuple[int, Any]:
        """What the walk does with instances of ``cls``, and the container base or code reader it uses:
        worked out once per class and walk (the subclass tests were about a sixth of a walk's time)."""
        found: tuple[int, Any] = (_OBJECT, None)
        if issubclass(cls, self.tensor_type):
            found = (_TENSOR, None)
        elif is_opaque(cls):
            found = (_CODE, code_reader(cls))
        elif self.module_type is not None and issubclass(cls, self.module_type):
            found = (_MODULE, None)
        elif self.optimizer_type is not None and issubclass(cls, self.optimizer_type):
            found = (_OPTIMIZER, None)
        elif issubclass(cls, dict):
            found = (_DICT, None)
        elif (base := next((base for base in _ELEMENT_BASES if issubclass(cls, base)), None)) is not None:
            found = (_ELEMENTS, base)
        elif issubclass(cls, BaseException):
            found = (_EXCEPTION, None)
        elif cls is types.TracebackType:
            found = (_TRACEBACK, None)
        elif self.ndarray_type is not None and issubclass(cls, self.ndarray_type):
            found = (_ARRAY, None)
        self._kinds[cls] = found
        return found

    def _code(self, obj: Any, reader: Any, path: str, depth: int, rank: int, category: str) -> None:
        """What a function, method, generator or class keeps alive, one level deeper (like a container)."""
        if depth >= self.max_depth:
            self._note_depth(path)
            return
        self.visited.add(id(obj))
        members: Members = reader(obj)
        if members is None:
            self.incomplete.add(id(self.root))
            self.truncation.append(f"{path} was running during the walk; its locals were not read")
            return
        for label, value in members:
            self.visit(value, f"{path}{label}", depth + 1, rank + 1, category)

    def _enter(self, obj: Any, kind: int, base: Any, path: str, depth: int, rank: int, category: str) -> None:
        """Walk the members of ``obj``; ``depth`` and ``rank`` are already the members'."""
        if kind == _DICT:
            items = stable_list(partial(dict.items, obj), self.max_items)
            self._items(items, dict.__len__(obj), path, depth, rank, category)
        elif kind == _ELEMENTS:
            self._elements(obj, base, path, depth, rank, category)
        elif kind == _EXCEPTION:
            self.exception(obj, path, depth, rank)
        elif kind == _TRACEBACK:
            self.traceback(obj, path, depth, rank)
        elif kind == _ARRAY:
            self._object_array(obj, path, depth, rank, category)
        else:
            self.attributes(obj, path, depth, rank, category)

    def _elements(self, obj: Any, base: Any, path: str, depth: int, rank: int, category: str) -> None:
        size = base.__len__(obj)
        unordered = base in (set, frozenset)
        for index, item in enumerate(stable_list(partial(base.__iter__, obj), self.max_items)):
            if type(item) in ATOMIC_TYPES:
                continue  # visit would return at once: no path is built for it
            self.visit(item, f"{path}{{...}}" if unordered else f"{path}[{index}]", depth, rank, category)
        if size > self.max_items:
            self._note_items(path, size)

    def _object_array(self, array: Any, path: str, depth: int, rank: int, category: str) -> None:
        """A numpy array of Python objects (``dtype=object``); numeric arrays hold no references."""
        if getattr(array, "dtype", None) is None or array.dtype.kind != "O":
            return
        size = int(array.size)
        for index, item in enumerate(stable_list(lambda: iter(array.flat), self.max_items)):
            self.visit(item, f"{path}.flat[{index}]", depth, rank, category)
        if size > self.max_items:
            self._note_items(path, size)

    def _items(self, items: list[tuple[Any, Any]], size: int, path: str, depth: int, rank: int, category: str) -> None:
        for key, value in items:
            atomic_key = type(key) in ATOMIC_TYPES
            if atomic_key and type(value) in ATOMIC_TYPES:
                continue  # nothing to walk: no label is built for it
            label = f"{path}[{_short_repr(key)}]"
            if not atomic_key:
                self.visit(key, label, depth, rank, category)
            self.visit(value, label, depth, rank, category)
        if size > self.max_items:
            self._note_items(path, size)

    def attributes(self, obj: Any, path: str, depth: int, rank: int, category: str) -> None:
        """A plain object's own ``__dict__`` and slots."""
        own = own_dict(obj)
        if own is not None:
            self._named(stable_list(own.items, self.max_items), dict.__len__(own), path, depth, rank, category)
        for name, value in slot_values(obj):
            self.visit(value, f"{path}.{name}", depth, rank, category)

    def _named(self, items: list[tuple[str, Any]], size: int, path: str, depth: int, rank: int, category: str) -> None:
        for name, value in items:
            if type(value) not in ATOMIC_TYPES:
                self.visit(value, f"{path}.{name}", depth, rank, category)
        if size > self.max_items:
            self._note_items(path, size)

    def exception(self, error: BaseException, path: str, depth: int, rank: int) -> None:
        """Arguments, attributes, traceback frames and chained exceptions, read through BaseException's slots."""
        args = EXCEPTION_ARGS.__get__(error)
        if type(args) is tuple:
            for index, arg in enumerate(args):
                self.visit(arg, f"{path}.args[{index}]", depth, rank, TENSORS)
        own = own_dict(error)
        if own is not None:
            items = stable_list(own.items, self.max_items)
            self._named(items, len(own), path, depth, rank, TENSORS)
        tb = EXCEPTION_TRACEBACK.__get__(error)
        if type(tb) is types.TracebackType:
            self.traceback(tb, f"{path}.__traceback__", depth, rank)
        for link, descriptor in (("__cause__", EXCEPTION_CAUSE), ("__context__", EXCEPTION_CONTEXT)):
            chained = descriptor.__get__(error)
            if chained is not None:
                self.visit(chained, f"{path}.{link}", depth, rank, TENSORS)

    def traceback(self, tb: types.TracebackType, path: str, depth: int, rank: int) -> None:
        """Locals of every function frame in the traceback (module-level frames are namespaces, skipped)."""
        current: types.TracebackType | None = tb
        for _ in range(_MAX_FRAMES):
            if current is None:
                return
            frame = current.tb_frame
            current = current.tb_next
            if id(frame) in self.visited:
                continue
            self.visited.add(id(frame))
            local_items = function_frame_locals(frame)
            if local_items:
                where = f"{path}<frame {frame.f_code.co_name}>"
                self._named(local_items, len(local_items), where, depth, rank, TENSORS)

    def module(self, module: Any, path: str, depth: int, rank: int) -> None:
        """Every parameter, gradient and buffer of the module tree, then the tensors in its modules' attributes.

        Parameters and buffers come first, so that an attribute viewing one (``self.w_t = self.proj.weight.T``)
        counts as the parameter, not as an attribute.
        """
        member_rank = rank + 1
        tree: list[tuple[dict[str, Any], str]] = []
        stack: list[tuple[Any, str]] = [(module, path)]
        while stack:
            current, where = stack.pop()
            self._tick()
            own = own_dict(current)
            if own is None:
                continue
            tree.append((own, where))
            self._module_tensors(own, where, member_rank)
            stack.extend(self._unvisited_children(own, where))
        for own, where in tree:
            for name, value in stable_list(own.items):
                if name not in MODULE_INTERNALS and type(value) not in ATOMIC_TYPES:
                    self._module_attribute_value(value, f"{where}.{name}", depth + 1, member_rank)

    def _module_attribute_value(self, value: Any, path: str, depth: int, rank: int) -> None:
        """A module attribute that is no parameter, buffer or submodule (a cached tensor, a list of them)."""
        outer, self._module_attribute = self._module_attribute, path
        try:
            self.visit(value, path, depth, rank, OTHER)
        finally:
            self._module_attribute = outer

    def _module_tensors(self, own: dict[str, Any], where: str, rank: int) -> None:
        for attribute, category in (("_parameters", PARAMETERS), ("_buffers", BUFFERS)):
            members = own.get(attribute)
            if type(members) is dict:
                for name, tensor in stable_list(members.items):
                    if tensor is not None:
                        self.tensor(tensor, f"{where}.{name}", rank, category)

    def _unvisited_children(self, own: dict[str, Any], where: str) -> list[tuple[Any, str]]:
        """The submodules not walked yet, marked as visited, in the order the stack pops them first to last."""
        children = own.get("_modules")
        if type(children) is not dict:
            return []
        found: list[tuple[Any, str]] = []
        for name, child in reversed(stable_list(children.items)):
            if child is not None and id(child) not in self.visited:
                self.visited.add(id(child))
                found.append((child, f"{where}.{name}"))
        return found

    def optimizer(self, optimizer: Any, path: str, depth: int, rank: int) -> None:
        """State tensors (attributed to their parameter's owner later) and the parameters it steps."""
        own = own_dict(optimizer)
        if own is None:
            return
        groups = own.get("param_groups")
        param_index = self._param_groups(groups, path, depth, rank) if isinstance(groups, list) else {}
        state = own.get("state")
        if isinstance(state, dict):
            for param, entries in stable_list(partial(dict.items, state)):
                label = f"{path}.state[param {param_index.get(id(param), '?')}]"
                self._state_entries(param, entries, label, depth, rank)

    def _param_groups(self, groups: list[Any], path: str, depth: int, rank: int) -> dict[int, int]:
        """Walk the parameter groups; returns each parameter's number (by id) for the state's labels."""
        param_index: dict[int, int] = {}
        for group_number, group in enumerate(stable_list(partial(list.__iter__, groups))):
            if not isinstance(group, dict):
                continue
            where = f"{path}.param_groups[{group_number}]"
            params = dict.get(group, "params")
            if isinstance(params, list):
                for param in stable_list(partial(list.__iter__, params)):
                    param_index.setdefault(id(param), len(param_index))
                    self.tensor(param, f"{where}['params'][{len(param_index) - 1}]", rank + 2, PARAMETERS)
            for key, value in stable_list(partial(dict.items, group)):
                if key != "params" and type(value) not in ATOMIC_TYPES:
                    self.visit(value, f"{where}[{key!r}]", depth + 2, rank + 2, OTHER)
        return param_index

    def _state_entries(self, param: Any, entries: Any, label: str, depth: int, rank: int) -> None:
        """One parameter's optimizer state; each state storage remembers the parameter's storage."""
        if not isinstance(entries, dict):
            self.visit(entries, label, depth + 2, rank + 1, OPTIMIZER_STATE)
            return
        param_keys = (
            storage_keys(param, self.devices, self.tensor_type) if issubclass(type(param), self.tensor_type) else []
        )
        for name, value in stable_list(partial(dict.items, entries)):
            where = f"{label}[{name!r}]"
            if issubclass(type(value), self.tensor_type):
                for key in self.tensor(value, where, rank + 1, OPTIMIZER_STATE):
                    if param_keys:
                        self.root.param_of_state[key] = param_keys[0][0]
            elif type(value) not in ATOMIC_TYPES:
                self.visit(value, where, depth + 2, rank + 1, OPTIMIZER_STATE)

    # -- tensors -----------------------------------------------------------------------------
    def tensor(self, tensor: Any, path: str, rank: int, category: str) -> list[StorageKey]:
        """Record the storages of ``tensor`` (and of its gradient) for the current root; returns their keys."""
        root = self.root
        tid = id(tensor)
        if tid in self.visited:
            return []
        self.visited.add(tid)
        self._tick()
        keys: list[StorageKey] = []
        for key, nbytes in storage_keys(tensor, self.devices, self.tensor_type):
            keys.append(key)
            self.sizes[key] = nbytes
            edge = root.reach.get(key)
            if edge is None or rank < edge.rank:
                root.reach[key] = Edge(rank, category, path)
                if self._module_attribute is not None and category == OTHER:
                    root.attribute_paths[key] = self._module_attribute
                elif root.attribute_paths:
                    root.attribute_paths.pop(key, None)
        try:
            node = tensor.grad_fn  # the graph keeps the tensors it saved alive
            gradient = tensor.grad if node is None and tensor.requires_grad else None  # a non-leaf's .grad warns
        except Exception:
            node, gradient = None, None
        if node is not None:
            self.graph_start(node)
        if keys:
            root.tensor_ids.add(tid)
            if node is not None and len(root.graph_paths) <= MAX_GRAPH_PATHS:  # one more: 'more than N'
                root.graph_paths.append(path)
        if gradient is not None:
            self.tensor(gradient, f"{path}.grad", rank, GRADIENTS)
        return keys

    def graph_start(self, node: Any) -> None:
        """A reached tensor's ``grad_fn`` (the graph walk overrides this to remember it)."""


def _short_repr(key: Any) -> str:
    if type(key) in (str, int, float, bool) or key is None:
        text = repr(key)
        return text if len(text) <= _MAX_LABEL else text[: _MAX_LABEL - 3] + "..."
    return f"<{type(key).__name__}>"


def walk_root(walker: Walker, root: Root, objects: Iterable[Any], rank: int) -> None:
    """Walk one root; an object that changes or fails under the walk costs that root's completeness only."""
    walker.root = root
    walker.visited = set()
    try:
        for obj in objects:
            walker.visit(obj, root.name, 0, rank, TENSORS)
    except OutOfTimeError:
        raise
    except Exception as error:  # e.g. a container whose copy kept failing, or a hostile object
        walker.incomplete.add(id(root))
        walker.truncation.append(f"{root.name} not fully walked ({type(error).__name__}: {error})")
    finally:
        if root.attribute_paths:
            note = module_attribute_note(root.attribute_paths, walker.sizes)
            root.note = f"{root.note}; {note}" if root.note else note
