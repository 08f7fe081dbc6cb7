"""Who holds the memory: a bounded walk from named variables to tensors, storages counted once.

The walk starts at each name of a namespace and follows containers, ``nn.Module`` members, optimizer
state, and plain objects' own ``__dict__`` / ``__slots__`` to a bounded depth and time. It never calls
user code on the way: no properties, no ``__getattr__``, no ``__eq__`` / ``__hash__`` / ``__len__`` of
user classes (objects are tracked by ``id``, containers read through the built-in base methods).

Every tensor storage is attributed to exactly one row, so rows add up to the total without double
counting; a storage reached from several names is counted under the most direct one and the others
show it as ``shared_bytes``. IPython's own references (output cache, last exception) are walked
separately and listed as ``hidden``: they are what ``gpumem.free(deep=True)`` releases.

torch is never imported here: with no torch in ``sys.modules`` there can be no tensors to find.
"""

from __future__ import annotations

import gc
import re
import sys
import time
import types
from collections import deque
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from gpumem.core.devices import parse_device
from gpumem.core.runtime import cuda_source, ipython_shell
from gpumem.core.units import format_bytes

__all__ = [
    "CycleReport",
    "Holder",
    "HolderReport",
    "find_cycles",
    "find_holders",
    "render_html",
    "render_text",
]

DEFAULT_MAX_DEPTH = 5
DEFAULT_TIME_BUDGET_S = 1.0
DEFAULT_MAX_ITEMS = 10_000
MAX_GRAPH_PATHS = 8
FREE_COMMAND = "%gpumem free --deep"

# Categories of bytes in a row's breakdown.
PARAMETERS = "parameters"
GRADIENTS = "gradients"
OPTIMIZER_STATE = "optimizer state"
BUFFERS = "buffers"
TENSORS = "tensors"
OTHER = "other"

# Hidden (IPython-held) references always rank after every user name.
_HIDDEN_RANK = 1_000


class Holder(NamedTuple):
    """One name (or one IPython reference) and the tensor memory counted under it.

    ``nbytes`` is the memory attributed to this row (each storage is attributed to one row only);
    ``shared_bytes`` is memory this name also reaches but that is counted under another row
    (``shared_with`` names them). ``graph_paths`` are paths of reached tensors that carry a
    ``grad_fn``: each keeps its autograd graph (and the activations it saved) alive. ``complete`` is
    False when the walk stopped early inside this name (a limit or an error): ``nbytes`` is then a
    lower bound.
    """

    name: str
    type_name: str
    device: str
    nbytes: int
    shared_bytes: int
    tensor_count: int
    graph_paths: tuple[str, ...]
    breakdown: dict[str, int]
    shared_with: tuple[str, ...] = ()
    note: str = ""
    complete: bool = True


class CycleReport(NamedTuple):
    """Tensors found in unreachable reference cycles by one ``gc`` pass (those cycles are then freed)."""

    nbytes: int
    tensor_count: int
    object_count: int
    member_types: tuple[tuple[str, int], ...]  # (type name, count) of the cycles' members, most common first


class HolderReport(NamedTuple):
    """The result of :func:`find_holders`.

    ``total_bytes`` counts the rows in ``holders`` (user names); ``hidden_bytes`` the rows in ``hidden``
    (IPython's references). ``unattributed`` explains whatever ``memory_allocated`` holds beyond both.
    """

    holders: list[Holder]
    total_bytes: int
    hidden: list[Holder]
    unattributed: str
    truncated: bool
    elapsed_s: float
    hidden_bytes: int = 0
    device: str = "cuda"
    allocated_bytes: int | None = None
    unattributed_bytes: int | None = None
    truncation: tuple[str, ...] = ()
    torch_loaded: bool = True
    cycles: CycleReport | None = None

    def __repr__(self) -> str:
        """The table ``%gpumem who`` prints, so that ``gpumem.holders()`` reads well on its own."""
        return render_text(self)

    def _repr_html_(self) -> str:
        return render_html(self)


class _OutOfTime(Exception):
    pass


# ----------------------------------------------------------------------------------------------
# Device filter
# ----------------------------------------------------------------------------------------------

# ----------------------------------------------------------------------------------------------
# Types the walk never enters
# ----------------------------------------------------------------------------------------------

_ATOMIC: frozenset[type] = frozenset(
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
_OPAQUE = (
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
_OPAQUE_MODULE_PREFIXES = (
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
_MODULE_INTERNALS = frozenset(
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

# Names IPython puts into the user namespace (its own section covers what they hold).
_IPYTHON_NAMES = frozenset({"In", "Out", "_ih", "_oh", "_dh", "exit", "quit", "get_ipython", "_exit_code"})
_IPYTHON_NAME_RE = re.compile(r"^(_+|_\d+|_i+|_i\d+)$")

_type_dict_cache: dict[type, tuple[bool, tuple[str, ...]]] = {}

# BaseException's own attribute descriptors: reading through them never runs a subclass's property.
_EXCEPTION_ARGS: Any = BaseException.__dict__["args"]
_EXCEPTION_TRACEBACK: Any = BaseException.__dict__["__traceback__"]
_EXCEPTION_CAUSE: Any = BaseException.__dict__["__cause__"]
_EXCEPTION_CONTEXT: Any = BaseException.__dict__["__context__"]


def _instance_layout(cls: type) -> tuple[bool, tuple[str, ...]]:
    """(has a plain instance ``__dict__``, slot names) for ``cls``, read from the class dicts only."""
    cached = _type_dict_cache.get(cls)
    if cached is not None:
        return cached
    plain_dict = False
    slots: list[str] = []
    try:
        mro = type.__dict__["__mro__"].__get__(cls)
    except Exception:
        mro = (cls,)
    dict_descriptor: Any = None
    for klass in mro:
        class_dict = type.__dict__["__dict__"].__get__(klass)
        if dict_descriptor is None and "__dict__" in class_dict:
            dict_descriptor = class_dict["__dict__"]
        for name, value in class_dict.items():
            if isinstance(value, types.MemberDescriptorType) and name not in slots:
                slots.append(name)
    plain_dict = isinstance(dict_descriptor, types.GetSetDescriptorType)
    result = (plain_dict, tuple(slots))
    if len(_type_dict_cache) < 4096:
        _type_dict_cache[cls] = result
    return result


def _own_dict(obj: Any) -> dict[str, Any] | None:
    """``obj.__dict__`` when it is the interpreter's own instance dict (never a property's result)."""
    plain, _ = _instance_layout(type(obj))
    if not plain:
        return None
    try:
        value = object.__getattribute__(obj, "__dict__")
    except Exception:
        return None
    return value if type(value) is dict else None


def _opaque_type(cls: type) -> bool:
    module = cls.__dict__.get("__module__") if "__module__" in cls.__dict__ else None
    if not isinstance(module, str):
        return False
    return module.startswith(_OPAQUE_MODULE_PREFIXES)


def _short_repr(key: Any) -> str:
    if type(key) in (str, int, float, bool) or key is None:
        text = repr(key)
        return text if len(text) <= 40 else text[:37] + "..."
    return f"<{type(key).__name__}>"


# ----------------------------------------------------------------------------------------------
# The walk
# ----------------------------------------------------------------------------------------------


class _Edge(NamedTuple):
    rank: int
    category: str
    path: str


class _Root:
    """What one name reaches: the best (lowest rank) edge to every storage."""

    __slots__ = ("graph_paths", "hidden", "name", "note", "order", "param_of_state", "reach", "tensor_ids", "type_name")

    def __init__(self, name: str, type_name: str, order: int, hidden: bool, note: str = "") -> None:
        self.name = name
        self.type_name = type_name
        self.order = order
        self.hidden = hidden
        self.note = note
        self.reach: dict[tuple[str, int, int], _Edge] = {}
        self.tensor_ids: set[int] = set()
        self.graph_paths: list[str] = []
        self.param_of_state: dict[tuple[str, int, int], tuple[str, int, int]] = {}


class _Walker:
    def __init__(
        self,
        torch: Any,
        device_kind: str | None,
        device_index: int | None,
        max_depth: int,
        max_items: int,
        deadline: float,
    ) -> None:
        self.tensor_type: type = torch.Tensor
        nn = getattr(torch, "nn", None)
        self.module_type: type | None = getattr(nn, "Module", None)
        optim = getattr(torch, "optim", None)
        self.optimizer_type: type | None = getattr(optim, "Optimizer", None)
        numpy = sys.modules.get("numpy")
        self.ndarray_type: type | None = getattr(numpy, "ndarray", None)
        self.device_kind = device_kind
        self.device_index = device_index
        self.max_depth = max_depth
        self.max_items = max_items
        self.deadline = deadline
        self.sizes: dict[tuple[str, int, int], int] = {}
        self.truncation: list[str] = []
        self.incomplete: set[int] = set()  # ids of the roots whose walk stopped early
        self._depth_notes = 0
        self._ticks = 0
        self.root: _Root = _Root("", "", 0, False)
        self.visited: set[int] = set()

    # -- budget ------------------------------------------------------------------------------
    def _tick(self) -> None:
        self._ticks += 1
        if self._ticks & 255 == 0 and time.perf_counter() > self.deadline:
            raise _OutOfTime

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
        cls = type(obj)
        if cls in _ATOMIC:
            return
        self._tick()
        if issubclass(cls, self.tensor_type):
            self.tensor(obj, path, rank, category)
            return
        oid = id(obj)
        if oid in self.visited:
            return
        if issubclass(cls, _OPAQUE) or _opaque_type(cls):
            return
        if self.module_type is not None and issubclass(cls, self.module_type):
            self.visited.add(oid)
            self.module(obj, path, depth, rank)
            return
        if self.optimizer_type is not None and issubclass(cls, self.optimizer_type):
            self.visited.add(oid)
            self.optimizer(obj, path, depth, rank)
            return
        if depth >= self.max_depth:
            self._note_depth(path)
            return
        self.visited.add(oid)
        child_depth = depth + 1
        child_rank = rank + 1
        if issubclass(cls, dict):
            self._items(dict.items(obj), dict.__len__(obj), path, child_depth, child_rank, category)
        elif issubclass(cls, (list, tuple)):
            base: Any = list if issubclass(cls, list) else tuple
            size = base.__len__(obj)
            iterator = base.__iter__(obj)
            for index, item in enumerate(_capped(iterator, self.max_items)):
                self.visit(item, f"{path}[{index}]", child_depth, child_rank, category)
            if size > self.max_items:
                self._note_items(path, size)
        elif issubclass(cls, (set, frozenset)):
            base = set if issubclass(cls, set) else frozenset
            size = base.__len__(obj)
            for item in _capped(base.__iter__(obj), self.max_items):
                self.visit(item, f"{path}{{...}}", child_depth, child_rank, category)
            if size > self.max_items:
                self._note_items(path, size)
        elif issubclass(cls, deque):
            size = deque.__len__(obj)
            for index, item in enumerate(_capped(deque.__iter__(obj), self.max_items)):
                self.visit(item, f"{path}[{index}]", child_depth, child_rank, category)
            if size > self.max_items:
                self._note_items(path, size)
        elif issubclass(cls, BaseException):
            self.exception(obj, path, child_depth, child_rank)
        elif cls is types.TracebackType:
            self.traceback(obj, path, child_depth, child_rank)
        elif self.ndarray_type is not None and issubclass(cls, self.ndarray_type):
            array: Any = obj
            if getattr(array, "dtype", None) is not None and array.dtype.kind == "O":
                size = int(array.size)
                for index, item in enumerate(_capped(iter(array.flat), self.max_items)):
                    self.visit(item, f"{path}.flat[{index}]", child_depth, child_rank, category)
                if size > self.max_items:
                    self._note_items(path, size)
        else:
            self.attributes(obj, path, child_depth, child_rank, category)

    def _items(
        self, items: Iterable[tuple[Any, Any]], size: int, path: str, depth: int, rank: int, category: str
    ) -> None:
        for key, value in _capped(iter(items), self.max_items):
            label = f"{path}[{_short_repr(key)}]"
            if type(key) not in _ATOMIC:
                self.visit(key, label, depth, rank, category)
            self.visit(value, label, depth, rank, category)
        if size > self.max_items:
            self._note_items(path, size)

    def attributes(self, obj: Any, path: str, depth: int, rank: int, category: str) -> None:
        own = _own_dict(obj)
        if own is not None:
            self._attribute_items(own.items(), dict.__len__(own), path, depth, rank, category)
        _, slots = _instance_layout(type(obj))
        for name in slots:
            descriptor = _slot_descriptor(type(obj), name)
            if descriptor is None:
                continue
            try:
                value = descriptor.__get__(obj, type(obj))
            except Exception:
                continue
            self.visit(value, f"{path}.{name}", depth, rank, category)

    def _attribute_items(
        self, items: Iterable[tuple[str, Any]], size: int, path: str, depth: int, rank: int, category: str
    ) -> None:
        for name, value in _capped(iter(items), self.max_items):
            self.visit(value, f"{path}.{name}", depth, rank, category)
        if size > self.max_items:
            self._note_items(path, size)

    def exception(self, error: BaseException, path: str, depth: int, rank: int) -> None:
        """Arguments, attributes, traceback frames and chained exceptions, read through BaseException's slots."""
        args = _EXCEPTION_ARGS.__get__(error)
        if type(args) is tuple:
            for index, arg in enumerate(args):
                self.visit(arg, f"{path}.args[{index}]", depth, rank, TENSORS)
        own = _own_dict(error)
        if own is not None:
            self._attribute_items(own.items(), len(own), path, depth, rank, TENSORS)
        tb = _EXCEPTION_TRACEBACK.__get__(error)
        if type(tb) is types.TracebackType:
            self.traceback(tb, f"{path}.__traceback__", depth, rank)
        for link, descriptor in (("__cause__", _EXCEPTION_CAUSE), ("__context__", _EXCEPTION_CONTEXT)):
            chained = descriptor.__get__(error)
            if chained is not None:
                self.visit(chained, f"{path}.{link}", depth, rank, TENSORS)

    def traceback(self, tb: types.TracebackType, path: str, depth: int, rank: int) -> None:
        """Locals of every function frame in the traceback (module-level frames are namespaces, skipped)."""
        seen = 0
        current: types.TracebackType | None = tb
        while current is not None and seen < 256:
            seen += 1
            frame = current.tb_frame
            current = current.tb_next
            if id(frame) in self.visited:
                continue
            self.visited.add(id(frame))
            code = frame.f_code
            if not code.co_flags & 0x1:  # not CO_OPTIMIZED: module or class body, its locals are a namespace
                continue
            module_name = frame.f_globals.get("__name__", "")
            if isinstance(module_name, str) and module_name.startswith(_OPAQUE_MODULE_PREFIXES):
                continue
            try:
                local_items = list(frame.f_locals.items())
            except Exception:
                continue
            where = f"{path}<frame {code.co_name}>"
            self._attribute_items(local_items, len(local_items), where, depth, rank, TENSORS)

    def module(self, module: Any, path: str, depth: int, rank: int) -> None:
        """Every parameter, gradient and buffer of the module tree, plus tensors in its own attributes."""
        member_rank = rank + 1
        stack: list[tuple[Any, str]] = [(module, path)]
        while stack:
            current, where = stack.pop()
            self._tick()
            own = _own_dict(current)
            if own is None:
                continue
            parameters = own.get("_parameters")
            if type(parameters) is dict:
                for name, param in parameters.items():
                    if param is not None:
                        self.tensor(param, f"{where}.{name}", member_rank, PARAMETERS)
            buffers = own.get("_buffers")
            if type(buffers) is dict:
                for name, buffer in buffers.items():
                    if buffer is not None:
                        self.tensor(buffer, f"{where}.{name}", member_rank, BUFFERS)
            children = own.get("_modules")
            if type(children) is dict:
                for name, child in reversed(list(children.items())):
                    if child is not None and id(child) not in self.visited:
                        self.visited.add(id(child))
                        stack.append((child, f"{where}.{name}"))
            for name, value in own.items():
                if name in _MODULE_INTERNALS or type(value) in _ATOMIC:
                    continue
                self.visit(value, f"{where}.{name}", depth + 1, member_rank, OTHER)

    def optimizer(self, optimizer: Any, path: str, depth: int, rank: int) -> None:
        """State tensors (attributed to their parameter's owner later) and the parameters it steps."""
        own = _own_dict(optimizer)
        if own is None:
            return
        groups = own.get("param_groups")
        param_index: dict[int, int] = {}
        if isinstance(groups, list):
            for group_number, group in enumerate(groups):
                if not isinstance(group, dict):
                    continue
                params = dict.get(group, "params")
                if isinstance(params, list):
                    for param in params:
                        param_index.setdefault(id(param), len(param_index))
                        self.tensor(
                            param,
                            f"{path}.param_groups[{group_number}]['params'][{len(param_index) - 1}]",
                            rank + 2,
                            PARAMETERS,
                        )
                for key, value in dict.items(group):
                    if key != "params" and type(value) not in _ATOMIC:
                        self.visit(value, f"{path}.param_groups[{group_number}][{key!r}]", depth + 2, rank + 2, OTHER)
        state = own.get("state")
        if isinstance(state, dict):
            for param, entries in dict.items(state):
                label = f"{path}.state[param {param_index.get(id(param), '?')}]"
                param_keys = self.storage_keys(param) if issubclass(type(param), self.tensor_type) else []
                if not isinstance(entries, dict):
                    self.visit(entries, label, depth + 2, rank + 1, OPTIMIZER_STATE)
                    continue
                for name, value in dict.items(entries):
                    if issubclass(type(value), self.tensor_type):
                        for key in self.tensor(value, f"{label}[{name!r}]", rank + 1, OPTIMIZER_STATE):
                            if param_keys:
                                self.root.param_of_state[key] = param_keys[0][0]
                    elif type(value) not in _ATOMIC:
                        self.visit(value, f"{label}[{name!r}]", depth + 2, rank + 1, OPTIMIZER_STATE)

    # -- tensors -----------------------------------------------------------------------------
    def _wanted(self, device: Any) -> str | None:
        kind = getattr(device, "type", None)
        if not isinstance(kind, str) or kind == "meta":
            return None
        index = getattr(device, "index", None)
        if self.device_kind is not None and kind != self.device_kind:
            return None
        if self.device_index is not None and index != self.device_index:
            return None
        return kind if index is None else f"{kind}:{index}"

    def storage_keys(self, tensor: Any, _depth: int = 0) -> list[tuple[tuple[str, int, int], int]]:
        """``((device, data_ptr, nbytes), nbytes)`` of every storage behind ``tensor`` on a wanted device."""
        try:
            device_name = self._wanted(tensor.device)
        except Exception:
            return []
        if device_name is None:
            return []
        keys: list[tuple[tuple[str, int, int], int]] = []
        try:
            layout = str(tensor.layout)
        except Exception:
            layout = "torch.strided"
        try:
            if layout == "torch.sparse_coo":
                parts = [tensor._indices(), tensor._values()]
            elif layout in ("torch.sparse_csr", "torch.sparse_bsr"):
                parts = [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
            elif layout in ("torch.sparse_csc", "torch.sparse_bsc"):
                parts = [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]
            else:
                parts = []
            if parts:
                for part in parts:
                    keys.extend(self.storage_keys(part, _depth + 1))
                return keys
            storage = tensor.untyped_storage()
            nbytes = int(storage.nbytes())
            pointer = int(storage.data_ptr())
            if nbytes > 0:
                keys.append(((device_name, pointer, nbytes), nbytes))
            return keys
        except Exception:
            pass
        flatten = getattr(type(tensor), "__tensor_flatten__", None)
        if flatten is not None and _depth < 4:
            try:
                inner_names, _ = flatten(tensor)
                for inner_name in inner_names:
                    inner = _own_dict(tensor)
                    value = inner.get(inner_name) if inner is not None else None
                    if isinstance(value, self.tensor_type):
                        keys.extend(self.storage_keys(value, _depth + 1))
            except Exception:
                return keys
        return keys

    def tensor(self, tensor: Any, path: str, rank: int, category: str) -> list[tuple[str, int, int]]:
        root = self.root
        tid = id(tensor)
        if tid in self.visited:
            return []
        self.visited.add(tid)
        self._tick()
        found = self.storage_keys(tensor)
        keys: list[tuple[str, int, int]] = []
        if found:
            root.tensor_ids.add(tid)
            for key, nbytes in found:
                keys.append(key)
                self.sizes[key] = nbytes
                edge = root.reach.get(key)
                if edge is None or rank < edge.rank:
                    root.reach[key] = _Edge(rank, category, path)
            try:
                has_graph = tensor.grad_fn is not None
            except Exception:
                has_graph = False
            if has_graph and len(root.graph_paths) < MAX_GRAPH_PATHS:
                root.graph_paths.append(path)
        try:
            is_leaf_with_grad = tensor.requires_grad and tensor.grad_fn is None
            gradient = tensor.grad if is_leaf_with_grad else None
        except Exception:
            gradient = None
        if gradient is not None:
            self.tensor(gradient, f"{path}.grad", rank, GRADIENTS)
        return keys


def _capped(iterator: Iterator[Any], limit: int) -> Iterator[Any]:
    for count, item in enumerate(iterator):
        if count >= limit:
            return
        yield item


def _slot_descriptor(cls: type, name: str) -> Any:
    for klass in type.__dict__["__mro__"].__get__(cls):
        value = type.__dict__["__dict__"].__get__(klass).get(name)
        if value is not None:
            return value if isinstance(value, types.MemberDescriptorType) else None
    return None


# ----------------------------------------------------------------------------------------------
# IPython's hidden references
# ----------------------------------------------------------------------------------------------


class HiddenReference(NamedTuple):
    """One place IPython keeps an object alive: a row name, the objects, and how to release them."""

    name: str
    objects: tuple[Any, ...]
    note: str


def ipython_names(shell: Any) -> set[str]:
    """Names in ``shell.user_ns`` that IPython manages (output cache aliases, input history, helpers)."""
    user_ns: dict[str, Any] = shell.user_ns
    hidden: dict[str, Any] = getattr(shell, "user_ns_hidden", {}) or {}
    out_cache = user_ns.get("_oh")
    out: Mapping[Any, Any] = out_cache if isinstance(out_cache, dict) else {}
    out_ids = {id(value) for value in out.values()}
    displayhook = getattr(shell, "displayhook", None)
    names: set[str] = set()
    for name, value in user_ns.items():
        if name in _IPYTHON_NAMES:
            names.add(name)
        elif _IPYTHON_NAME_RE.match(name):
            if (
                (name in hidden and hidden[name] is value)
                or id(value) in out_ids
                or (name in ("_", "__", "___") and getattr(displayhook, name, None) is value)
                or name.startswith("_i")
            ):
                names.add(name)
        elif name in hidden and hidden[name] is value and name.startswith("_"):
            names.add(name)
    return names


def hidden_references(shell: Any) -> list[HiddenReference]:
    """IPython's output cache entries and the last exception, as rows to walk."""
    refs: list[HiddenReference] = []
    user_ns: dict[str, Any] = shell.user_ns
    hidden_ns: dict[str, Any] = getattr(shell, "user_ns_hidden", {}) or {}
    out = user_ns.get("_oh")
    out_map: dict[int, Any] = out if isinstance(out, dict) else {}
    displayhook = getattr(shell, "displayhook", None)
    covered: set[int] = set()
    for number, value in sorted(out_map.items(), key=lambda item: item[0] if isinstance(item[0], int) else 0):
        aliases = [f"_{number}"]
        for name in ("_", "__", "___"):
            if user_ns.get(name) is value or hidden_ns.get(name) is value:
                aliases.append(name)
        covered.add(id(value))
        refs.append(HiddenReference(f"Out[{number}]", (value,), "also " + ", ".join(aliases)))
    # Results that are no longer in Out (culled, or Out cleared by hand) but still in _, __, ___.
    for name in ("_", "__", "___"):
        for value in (hidden_ns.get(name), getattr(displayhook, name, None) if displayhook is not None else None):
            if value is None or type(value) in _ATOMIC or id(value) in covered:
                continue
            covered.add(id(value))
            refs.append(HiddenReference(name, (value,), "output-cache alias"))
    last_result = getattr(getattr(shell, "last_execution_result", None), "result", None)
    if last_result is not None and type(last_result) not in _ATOMIC and id(last_result) not in covered:
        refs.append(HiddenReference("last result", (last_result,), "shell.last_execution_result.result"))
    error_objects: list[Any] = []
    places: list[str] = []
    for label, value in _last_error_places(shell):
        if value is not None:
            error_objects.append(value)
            places.append(label)
    if error_objects:
        refs.append(HiddenReference(_last_error_name(error_objects), tuple(error_objects), ", ".join(places)))
    return refs


def _last_error_places(shell: Any) -> list[tuple[str, Any]]:
    places: list[tuple[str, Any]] = [
        ("sys.last_value", getattr(sys, "last_value", None)),
        ("sys.last_exc", getattr(sys, "last_exc", None)),
        ("sys.last_traceback", getattr(sys, "last_traceback", None)),
    ]
    if shell is not None:
        interactive_tb = getattr(shell, "InteractiveTB", None)
        places.append(("shell.InteractiveTB.tb", getattr(interactive_tb, "tb", None)))
        last = getattr(shell, "last_execution_result", None)
        places.append(("shell.last_execution_result.error_in_exec", getattr(last, "error_in_exec", None)))
    return places


def _last_error_name(objects: list[Any]) -> str:
    for value in objects:
        if isinstance(value, BaseException):
            return f"last exception ({type(value).__name__})"
    return "last exception"


# ----------------------------------------------------------------------------------------------
# Attribution
# ----------------------------------------------------------------------------------------------


def _attribute(
    roots: list[_Root], sizes: Mapping[tuple[str, int, int], int], incomplete: Collection[int] = ()
) -> list[tuple[bool, Holder]]:
    """Give every storage one owner (lowest rank, then the name reaching most, then namespace order)."""
    reach_total = {id(root): sum(sizes[key] for key in root.reach) for root in roots}
    owner: dict[tuple[str, int, int], _Root] = {}
    reachers: dict[tuple[str, int, int], list[_Root]] = {}
    for root in roots:
        mine = root.reach
        for key, edge in mine.items():
            reachers.setdefault(key, []).append(root)
            current = owner.get(key)
            if current is None or (edge.rank, -reach_total[id(root)], root.order) < (
                current.reach[key].rank,
                -reach_total[id(current)],
                current.order,
            ):
                owner[key] = root
    # Optimizer state goes to the row that owns the parameter it belongs to (a module, usually).
    state_note: dict[int, set[str]] = {}
    moved: dict[tuple[str, int, int], _Root] = {}
    for root in roots:
        for key, param_key in root.param_of_state.items():
            if owner.get(key) is not root or root.reach[key].category != OPTIMIZER_STATE:
                continue
            param_owner = owner.get(param_key)
            if param_owner is None or param_owner is root or param_owner.hidden:
                continue
            if param_owner.reach[param_key].category != PARAMETERS:
                continue
            owner[key] = param_owner
            moved[key] = root
            state_note.setdefault(id(param_owner), set()).add(root.name)
    owned_keys: dict[int, list[tuple[str, int, int]]] = {}
    for key, holder in owner.items():
        owned_keys.setdefault(id(holder), []).append(key)
    rows: list[tuple[bool, Holder]] = []
    for root in roots:
        owned = 0
        shared = 0
        breakdown: dict[str, int] = {}
        devices: set[str] = set()
        partners: dict[str, None] = {}
        for key in owned_keys.get(id(root), ()):
            nbytes = sizes[key]
            owned += nbytes
            category = OPTIMIZER_STATE if key in moved else root.reach[key].category
            breakdown[category] = breakdown.get(category, 0) + nbytes
            devices.add(key[0])
            for other in reachers[key]:
                if other is not root:
                    partners[other.name] = None
        for key in root.reach:
            holder = owner[key]
            if holder is not root:
                shared += sizes[key]
                partners[holder.name] = None
        if not owned and not shared:
            continue
        partner_names = tuple(partners)
        notes: list[str] = [root.note] if root.note else []
        if id(root) in state_note:
            notes.append("optimizer state held by " + ", ".join(sorted(state_note[id(root)])))
        if not owned and shared:
            verb = "still held by " if root.hidden else "counted under "
            notes.append(verb + ", ".join(partner_names[:3]))
        rows.append(
            (
                root.hidden,
                Holder(
                    name=root.name,
                    type_name=root.type_name,
                    device=",".join(sorted(devices)),
                    nbytes=owned,
                    shared_bytes=shared,
                    tensor_count=len(root.tensor_ids),
                    graph_paths=tuple(root.graph_paths),
                    breakdown=breakdown,
                    shared_with=partner_names,
                    note="; ".join(notes),
                    complete=id(root) not in incomplete,
                ),
            )
        )
    rows.sort(key=lambda pair: (-pair[1].nbytes, -pair[1].shared_bytes, pair[1].name))
    return rows


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------


def find_holders(
    namespace: Mapping[str, Any],
    *,
    device: str | int | None = "cuda",
    shell: Any = None,
    include_hidden: bool = True,
    max_depth: int = DEFAULT_MAX_DEPTH,
    time_budget_s: float = DEFAULT_TIME_BUDGET_S,
    max_items: int = DEFAULT_MAX_ITEMS,
    source: Any = None,
    cycles: bool = False,
    names: Iterable[str] | None = None,
) -> HolderReport:
    """Walk ``namespace`` (and, with an IPython ``shell``, its hidden references) for tensor memory.

    ``device`` filters storages: ``"cuda"`` (every CUDA device), ``"cuda:N"``, ``"cpu"`` or ``"all"``.
    ``shell`` defaults to the running IPython shell when ``namespace`` is its user namespace. ``source``
    (a :class:`~gpumem.core.sources.MemorySource`) supplies ``memory_allocated`` for the remainder; it defaults
    to the shared monitor's. ``cycles=True`` runs one garbage collection to find tensors in reference
    cycles (which frees them). ``names`` restricts the walk to those names.
    """
    started = time.perf_counter()
    device_kind, device_index = parse_device(device)
    device_label = "all" if device_kind is None else device_kind + ("" if device_index is None else f":{device_index}")
    if max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    cycle_report = find_cycles(device) if cycles else None
    torch = sys.modules.get("torch")
    if shell is None:
        shell = _running_shell(namespace)
    if torch is None or not hasattr(torch, "Tensor"):
        return HolderReport(
            holders=[],
            total_bytes=0,
            hidden=[],
            unattributed="torch is not imported in this process, so no tensor can hold memory",
            truncated=False,
            elapsed_s=time.perf_counter() - started,
            device=device_label,
            torch_loaded=False,
            cycles=cycle_report,
        )
    walker = _Walker(torch, device_kind, device_index, max_depth, max_items, started + time_budget_s)
    roots: list[_Root] = []
    skip = ipython_names(shell) if shell is not None and namespace is getattr(shell, "user_ns", None) else set()
    wanted = set(names) if names is not None else None
    out_of_time = False
    try:
        items = list(namespace.items())
    except Exception:
        items = []
    try:
        for order, (name, value) in enumerate(items):
            if type(value) in _ATOMIC or name in skip or (wanted is not None and name not in wanted):
                continue
            if not isinstance(name, str) or (name.startswith("__") and name.endswith("__")):
                continue
            root = _Root(name, _type_name(value), order, hidden=False)
            roots.append(root)
            _walk_guarded(walker, root, (value,), 0)
        if include_hidden and shell is not None:
            for order, ref in enumerate(hidden_references(shell)):
                root = _Root(ref.name, _type_name(ref.objects[0]), len(items) + order, hidden=True, note=ref.note)
                roots.append(root)
                _walk_guarded(walker, root, ref.objects, _HIDDEN_RANK)
    except _OutOfTime:
        out_of_time = True
        walker.incomplete.add(id(walker.root))
        walker.truncation.append(f"time budget {time_budget_s:g} s used up; later names were not walked")
    rows = _attribute(roots, walker.sizes, walker.incomplete)
    user_rows = [row for hidden, row in rows if not hidden]
    hidden_rows = [row for hidden, row in rows if hidden]
    total = sum(row.nbytes for row in user_rows)
    hidden_total = sum(row.nbytes for row in hidden_rows)
    allocated = _allocated_bytes(source, device_kind, device_index)
    unattributed_bytes = None if allocated is None else allocated - total - hidden_total
    return HolderReport(
        holders=user_rows,
        total_bytes=total,
        hidden=hidden_rows,
        unattributed=_unattributed_text(device_kind, allocated, unattributed_bytes),
        truncated=out_of_time or bool(walker.truncation),
        elapsed_s=time.perf_counter() - started,
        hidden_bytes=hidden_total,
        device=device_label,
        allocated_bytes=allocated,
        unattributed_bytes=unattributed_bytes,
        truncation=tuple(walker.truncation),
        torch_loaded=True,
        cycles=cycle_report,
    )


def _walk_guarded(walker: _Walker, root: _Root, objects: Iterable[Any], rank: int) -> None:
    """Walk one root; an object that changes or fails under the walk costs that root's completeness only."""
    walker.root = root
    walker.visited = set()
    try:
        for obj in objects:
            walker.visit(obj, root.name, 0, rank, TENSORS)
    except _OutOfTime:
        raise
    except Exception as error:  # e.g. a dict resized by a running cell while a widget thread walks it
        walker.incomplete.add(id(root))
        walker.truncation.append(f"{root.name} not fully walked ({type(error).__name__}: {error})")


def _type_name(value: Any) -> str:
    name = type(value).__name__
    return name if isinstance(name, str) else "?"


def _running_shell(namespace: Mapping[str, Any]) -> Any:
    shell = ipython_shell()
    if shell is not None and getattr(shell, "user_ns", None) is namespace:
        return shell
    return None


def _allocated_bytes(source: Any, device_kind: str | None, device_index: int | None) -> int | None:
    """PyTorch's ``memory_allocated`` summed over the filtered CUDA devices; None when it can't be read."""
    if device_kind not in (None, "cuda"):
        return None
    source = cuda_source(source)
    if source is None:
        return None
    try:
        snapshot = source.snapshot()
    except Exception:
        return None
    readings = [r for r in snapshot.allocator if device_index is None or r.device == device_index]
    if not readings:
        return None
    return int(sum(r.allocated_bytes for r in readings))


_REMAINDER_CAUSES = (
    "tensors kept by autograd graphs (saved activations), the allocator's rounding of every block "
    "(to 512 bytes and more), and tensors reachable from no name (closures, C++ objects, other threads, "
    "or beyond the walk's limits)"
)


def _unattributed_text(device_kind: str | None, allocated: int | None, remainder: int | None) -> str:
    if allocated is None or remainder is None:
        if device_kind not in (None, "cuda"):
            return "memory_allocated: n/a (PyTorch counts only CUDA allocations)"
        return "memory_allocated: unavailable (CUDA is not initialized in this process)"
    if remainder >= 0:
        return f"{format_bytes(remainder)} of {format_bytes(allocated)} allocated not attributed: {_REMAINDER_CAUSES}"
    return (
        f"named tensors add up to {format_bytes(-remainder)} more than memory_allocated "
        f"({format_bytes(allocated)}): memory changed during the walk"
    )


# ----------------------------------------------------------------------------------------------
# Reference cycles
# ----------------------------------------------------------------------------------------------


def find_cycles(device: str | int | None = "cuda") -> CycleReport:
    """Run one collection with ``gc.DEBUG_SAVEALL`` to see the tensors only cycles keep alive.

    The unreachable objects are inspected, then released and collected again: like the next automatic
    collection would, this frees them. Tensors are counted by storage, on the filtered devices.
    """
    device_kind, device_index = parse_device(device)
    torch = sys.modules.get("torch")
    previous_flags = gc.get_debug()
    start = len(gc.garbage)
    gc.set_debug(previous_flags | gc.DEBUG_SAVEALL)
    try:
        gc.collect()
    finally:
        gc.set_debug(previous_flags)
    found = gc.garbage[start:]
    del gc.garbage[start:]
    counts: dict[str, int] = {}
    nbytes = 0
    tensor_count = 0
    try:
        if torch is not None:
            walker = _Walker(torch, device_kind, device_index, 1, 0, float("inf"))
            root = _Root("cycles", "", 0, False)
            walker.root = root
            for obj in found:
                name = _type_name(obj)
                counts[name] = counts.get(name, 0) + 1
                if isinstance(obj, walker.tensor_type):
                    walker.tensor(obj, "", 0, TENSORS)
            nbytes = sum(walker.sizes[key] for key in root.reach)
            tensor_count = len(root.tensor_ids)
        else:
            for obj in found:
                name = _type_name(obj)
                counts[name] = counts.get(name, 0) + 1
        object_count = len(found)
    finally:
        found.clear()
        del found
        gc.collect()
    ranked = tuple(sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:8])
    return CycleReport(nbytes, tensor_count, object_count, ranked)


# ----------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------


def _breakdown_text(row: Holder) -> str:
    if not row.breakdown or set(row.breakdown) == {TENSORS}:
        return ""
    order = (PARAMETERS, GRADIENTS, OPTIMIZER_STATE, BUFFERS, TENSORS, OTHER)
    parts = [f"{name} {format_bytes(row.breakdown[name])}" for name in order if row.breakdown.get(name)]
    return ", ".join(parts)


def _row_notes(row: Holder) -> list[str]:
    notes: list[str] = []
    breakdown = _breakdown_text(row)
    if breakdown:
        notes.append(breakdown)
    if row.shared_bytes:
        notes.append(f"{format_bytes(row.shared_bytes)} shared with {', '.join(row.shared_with[:3])} (counted once)")
    elif row.shared_with:
        notes.append(f"shares storage with {', '.join(row.shared_with[:3])}")
    if row.graph_paths:
        notes.append("keeps an autograd graph alive: " + ", ".join(row.graph_paths[:3]))
    if row.note:
        notes.append(row.note)
    return notes


def _bytes_text(nbytes: int, complete: bool) -> str:
    """A size, marked as a lower bound when the walk stopped early (see the "Walk truncated" line)."""
    return format_bytes(nbytes) if complete else f"\u2265 {format_bytes(nbytes)}"


def _nothing_found(report: HolderReport) -> str:
    where = "any device" if report.device == "all" else report.device
    if report.truncated:
        return f"no name was found holding tensor memory on {where} (the walk stopped early, see below)"
    return f"no name holds tensor memory on {where}"


def render_text(report: HolderReport, *, limit: int = 20) -> str:
    """A plain-text table for terminals and ``text/plain``."""
    if not report.torch_loaded:
        return "gpumem who: " + report.unattributed
    shown = [*report.holders[:limit], *report.hidden]
    name_width = max([len(row.name) for row in shown] + [11])
    type_width = max([len(row.type_name) for row in shown] + [4])
    device_width = max([len(row.device) for row in shown] + [6])
    indent = " " * (name_width + 4)

    def row_lines(row: Holder) -> list[str]:
        head = (
            f"  {row.name:<{name_width}}  {row.type_name:<{type_width}}  {row.device:<{device_width}}  "
            f"{_bytes_text(row.nbytes, row.complete):>10}"
        )
        return [head, *(indent + note for note in _row_notes(row))]

    lines = [f"Tensor memory held by names ({report.device}), walked in {report.elapsed_s * 1000:.0f} ms"]
    if not report.holders:
        hint = " (`%gpumem who --device cpu` lists CPU tensors)" if report.device.startswith("cuda") else ""
        lines.append(f"  {_nothing_found(report)}{hint}")
    for row in report.holders[:limit]:
        lines.extend(row_lines(row))
    if len(report.holders) > limit:
        rest = sum(row.nbytes for row in report.holders[limit:])
        lines.append(f"  ... {len(report.holders) - limit} more names, {format_bytes(rest)} (--all lists them)")
    total_width = name_width + type_width + device_width + 6
    lines.append(f"  {'total named':<{total_width}}{_bytes_text(report.total_bytes, not report.truncated):>10}")
    if report.hidden:
        lines.append(f"Held by IPython (release with {FREE_COMMAND}):")
        for row in report.hidden:
            lines.extend(row_lines(row))
    if report.allocated_bytes is not None:
        lines.append(f"memory_allocated {format_bytes(report.allocated_bytes)}: {report.unattributed}")
    else:
        lines.append(report.unattributed)
    if report.cycles is not None:
        lines.append(_cycles_text(report.cycles))
    if report.truncated:
        lines.append("Walk truncated: " + "; ".join(report.truncation))
    return "\n".join(lines)


def _cycles_text(cycles: CycleReport) -> str:
    if not cycles.object_count:
        return "Reference cycles: none were waiting for the garbage collector"
    members = ", ".join(f"{name} x{count}" for name, count in cycles.member_types[:5])
    return (
        f"Reference cycles: {cycles.object_count} unreachable objects ({members}) held "
        f"{format_bytes(cycles.nbytes)} in {cycles.tensor_count} tensors; collected now"
    )


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def render_html(report: HolderReport, *, limit: int = 20) -> str:
    """An HTML table for notebooks."""
    if not report.torch_loaded:
        return f"<div class='gpumem-who'>{_escape(report.unattributed)}</div>"
    parts = [
        "<div class='gpumem-who'>",
        f"<b>Tensor memory held by names ({_escape(report.device)})</b>",
        "<table><thead><tr><th style='text-align:left'>name</th><th style='text-align:left'>type</th>"
        "<th>device</th><th style='text-align:right'>bytes</th><th style='text-align:left'>notes</th></tr>"
        "</thead><tbody>",
    ]

    def row_html(row: Holder) -> str:
        notes = "<br>".join(_escape(note) for note in _row_notes(row))
        return (
            f"<tr><td style='text-align:left'><code>{_escape(row.name)}</code></td>"
            f"<td style='text-align:left'>{_escape(row.type_name)}</td><td>{_escape(row.device)}</td>"
            f"<td style='text-align:right'>{_bytes_text(row.nbytes, row.complete)}</td>"
            f"<td style='text-align:left'>{notes}</td></tr>"
        )

    if not report.holders:
        parts.append(f"<tr><td colspan=5>{_escape(_nothing_found(report))}</td></tr>")
    parts.extend(row_html(row) for row in report.holders[:limit])
    if len(report.holders) > limit:
        rest = sum(row.nbytes for row in report.holders[limit:])
        parts.append(
            f"<tr><td colspan=3>... {len(report.holders) - limit} more names</td>"
            f"<td style='text-align:right'>{format_bytes(rest)}</td><td></td></tr>"
        )
    parts.append(
        f"<tr><td colspan=3><b>total named</b></td><td style='text-align:right'>"
        f"<b>{_bytes_text(report.total_bytes, not report.truncated)}</b></td><td></td></tr>"
    )
    if report.hidden:
        parts.append(
            f"<tr><td colspan=5 style='text-align:left'><b>Held by IPython</b> (release with "
            f"<code>{FREE_COMMAND}</code>)</td></tr>"
        )
        parts.extend(row_html(row) for row in report.hidden)
    parts.append("</tbody></table>")
    prefix = f"memory_allocated {format_bytes(report.allocated_bytes)}: " if report.allocated_bytes is not None else ""
    parts.append(f"<div>{_escape(prefix + report.unattributed)}</div>")
    if report.cycles is not None:
        parts.append(f"<div>{_escape(_cycles_text(report.cycles))}</div>")
    if report.truncated:
        parts.append(f"<div><i>Walk truncated: {_escape('; '.join(report.truncation))}</i></div>")
    parts.append(f"<div style='opacity:.6'>walked in {report.elapsed_s * 1000:.0f} ms</div></div>")
    return "".join(parts)
