"""What autograd graphs keep alive: the tensors their nodes saved for backward (activations, mostly).

A tensor with a ``grad_fn`` keeps its whole graph alive until backward frees it (or the tensor goes).
Each node's saved tensors are read through torch's own ``_raw_saved_*`` descriptors, whose
``SavedTensor.data`` returns the tensor without running any unpack hook; a Python ``Function``'s
context is read through ``torch._C._FunctionBase``'s descriptors and its own ``__dict__`` only, so no
user code runs. ``AccumulateGrad`` nodes keep their leaf (``variable``) alive too. After backward, a
node's saved tensors are gone and ``data`` is None: nothing is counted for them, and a root whose graph keeps
no tensor beyond leaves named elsewhere (a loss after ``backward()``) is no longer said to keep a graph alive.

The walk is bounded by a node count and the holder walk's deadline; storages are counted once.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from gpumem.core.holders.objects import own_dict
from gpumem.core.holders.tensors import StorageKey, storage_keys
from gpumem.core.holders.walk import Root, Walker

__all__ = ["GraphWalker", "saved_by_graphs"]

DEFAULT_MAX_NODES = 100_000
_CLOCK_EVERY = 256  # nodes between two reads of the clock


class GraphWalker(Walker):
    """The holder walk, also remembering, per root, the ``grad_fn`` of every tensor it reached."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.graph_starts: dict[int, dict[int, Any]] = {}  # id(root) -> {id(node): node}
        self.saved_keys: dict[StorageKey, int] = {}  # storages only graphs hold (filled by saved_by_graphs)

    def graph_start(self, node: Any) -> None:
        """Remember the reached tensor's graph for :func:`saved_by_graphs`."""
        starts = self.graph_starts.get(id(self.root))
        if starts is None:
            starts = self.graph_starts[id(self.root)] = {}
        starts[id(node)] = node


class _NodeReader:
    """Reads one node's next functions and saved tensors through torch's descriptors, never user attributes."""

    def __init__(self, torch: Any) -> None:
        self.function_base: type | None = getattr(getattr(torch, "_C", None), "_FunctionBase", None)
        self.tensor_type: type = torch.Tensor
        base_dict = vars(self.function_base) if self.function_base is not None else {}
        self._python_next = base_dict.get("next_functions")
        self._python_saved = base_dict.get("_raw_saved_tensors")
        self._saved_names: dict[type, tuple[str, ...]] = {}

    def next_nodes(self, node: Any) -> list[Any]:
        if self.function_base is not None and isinstance(node, self.function_base):
            pairs = self._python_next.__get__(node) if self._python_next is not None else ()
        else:
            pairs = node.next_functions
        return [pair[0] for pair in pairs if pair[0] is not None]

    def saved_tensors(self, node: Any) -> list[Any]:
        """The tensors ``node`` keeps for backward (empty once backward freed them)."""
        found: list[Any] = []
        if self.function_base is not None and isinstance(node, self.function_base):
            raw = self._python_saved.__get__(node) if self._python_saved is not None else None
            found.extend(_saved_data(item) for item in raw or ())
            context = own_dict(node)  # tensors stored as ctx attributes instead of save_for_backward
            found.extend(value for value in (context or {}).values() if isinstance(value, self.tensor_type))
        else:
            for name in self._names(type(node)):
                value = getattr(node, name)
                items = value if isinstance(value, (list, tuple)) else (value,)
                found.extend(_saved_data(item) for item in items)
        return [tensor for tensor in found if isinstance(tensor, self.tensor_type)]

    def holds_leaf(self, node: Any) -> bool:
        """An ``AccumulateGrad`` node: what it keeps is the leaf (a parameter), not a saved activation."""
        return "variable" in self._names(type(node)) if not isinstance(node, self.function_base or ()) else False

    def _names(self, node_type: type) -> tuple[str, ...]:
        names = self._saved_names.get(node_type)
        if names is None:
            own = vars(node_type)
            names = tuple(name for name in own if name.startswith("_raw_saved_"))
            if "variable" in own:  # AccumulateGrad: the leaf it accumulates into
                names += ("variable",)
            self._saved_names[node_type] = names
        return names


def _saved_data(item: Any) -> Any:
    """A SavedTensor's tensor without unpack hooks (None after backward); a plain tensor as it is."""
    kind = type(item)  # torch._C._autograd.SavedTensor: ``data`` and ``register_hooks`` in every torch 2.x
    if hasattr(kind, "data") and (hasattr(kind, "register_hooks") or hasattr(kind, "unpack")):
        try:
            return item.data
        except Exception:
            return None
    return item


def _read_node(reader: _NodeReader, node: Any, queue: deque[Any]) -> list[Any]:
    """``node``'s saved tensors, its next nodes queued; a node that fails to read is skipped, the rest kept."""
    try:
        tensors = reader.saved_tensors(node)
        queue.extend(reader.next_nodes(node))
    except Exception:
        return []
    return tensors


def saved_by_graphs(
    torch: Any,
    walker: GraphWalker,
    roots: list[Root],
    *,
    max_nodes: int = DEFAULT_MAX_NODES,
) -> tuple[dict[int, int], int, list[str]]:
    """``({id(root): bytes}, total, notes)``: storages saved by the roots' graphs and reached by no name.

    Roots are taken in namespace order (user names before IPython's references); a storage saved by
    several graphs is counted under the first root that reaches it. Storages the walk already counted
    under a row (a parameter saved by a matmul) are not counted again. The storages found are left in
    ``walker.saved_keys`` (the remainder matches them against the allocator's blocks).
    """
    reader = _NodeReader(torch)
    known: set[StorageKey] = set(walker.sizes)
    per_root: dict[int, int] = {}
    counted: dict[StorageKey, int] = {}
    # Node wrappers can be made afresh at each access and freed after: keep each visited one alive, or a
    # later node could reuse its id() and be taken for one already seen.
    seen: dict[int, Any] = {}
    notes: list[str] = []
    nodes = 0
    keeping: dict[int, bool] = {}  # id(node) -> it keeps a tensor other than a leaf named elsewhere
    for root in sorted(roots, key=lambda r: (r.hidden, r.order)):
        queue = deque(walker.graph_starts.get(id(root), {}).values())
        keeps = False
        while queue:
            node = queue.popleft()
            if id(node) in seen:
                keeps = keeps or keeping[id(node)]
                continue
            seen[id(node)] = node
            nodes += 1
            if nodes > max_nodes or (nodes % _CLOCK_EVERY == 0 and time.perf_counter() > walker.deadline):
                notes.append(f"autograd graphs: stopped after {nodes - 1:,} nodes (saved tensors are a lower bound)")
                walker.saved_keys = counted
                return per_root, sum(counted.values()), notes
            keeping[id(node)] = False
            leaf_holder = reader.holds_leaf(node)
            for tensor in _read_node(reader, node, queue):
                for key, nbytes in storage_keys(tensor, walker.devices, reader.tensor_type):
                    keeping[id(node)] = keeping[id(node)] or not (leaf_holder and key in known)
                    if key in known or key in counted:
                        continue
                    counted[key] = nbytes
                    per_root[id(root)] = per_root.get(id(root), 0) + nbytes
            keeps = keeps or keeping[id(node)]
        if not keeps:
            root.graph_paths.clear()  # backward freed what it saved: the graph holds nothing more
    walker.saved_keys = counted
    return per_root, sum(counted.values()), notes
