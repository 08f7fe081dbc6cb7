"""Counting a dry run: PyTorch's ``MemTracker`` (by kind and by module), feeding the allocator model.

``torch.distributed._tools.mem_tracker.MemTracker`` counts every storage made under fake tensors by
kind (parameters, buffers, gradients, activations, temporaries, optimizer state) and by module. Two
things are added here, by overriding two of its methods: every change it counts is also replayed by an
:class:`~gpumem.core.predict.allocator.AllocatorModel` per CUDA device, and a second forward of the root
module (a cell of several steps) starts a new iteration instead of raising: the module figures of the
iteration before are kept (``reset_mod_stats`` would drop them).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _ModState, _UpdateType
from torch.utils._pytree import tree_leaves

from gpumem.core.predict.allocator import AllocatorModel
from gpumem.core.predict.guards import NO_CUDA as _NO_CUDA
from gpumem.core.predict.guards import Refusal

__all__ = ["KIND_NAMES", "ModuleFigures", "StepTracker"]

# MemTracker's kinds -> the names the report uses.
KIND_NAMES = {
    "Parameter": "parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Optstate": "optimizer state",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "other tensors",
}
_TOTAL = "Total"
_CUDA_BUILT = torch.backends.cuda.is_built()  # type: ignore[no-untyped-call]
# Operators that run on cuBLAS: the first of them on a stream allocates its workspace.
_MATMULS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "_addmm_activation", "_scaled_mm"}
)
_LT_MATMULS = frozenset({"_addmm_activation", "_scaled_mm"})  # always through cuBLASLt
# cuDNN allocates each convolution's workspace itself, of a size its plan chooses at run time.
_CONVOLUTIONS = frozenset({"convolution", "convolution_backward", "cudnn_convolution", "cudnn_convolution_transpose"})


class ModuleFigures(NamedTuple):
    """One module of one iteration: its parameters, and what its forward left allocated (saved activations)."""

    name: str
    parameter_bytes: int
    forward_bytes: int  # allocated after its forward minus before, summed over its calls


class StepTracker(MemTracker):  # type: ignore[no-untyped-call]
    """MemTracker that replays its counts through the allocator model and allows several iterations."""

    def __init__(self, workspaces: dict[str, tuple[int, int, int]] | None = None) -> None:
        super().__init__()
        self.models: dict[str, AllocatorModel] = {}
        # device -> (bytes of one cuBLAS workspace, of one cuBLASLt workspace, how many threads have them already)
        self.workspaces = dict(workspaces or {})
        self.workspaces_made: dict[str, int] = {}  # device -> bytes of the workspaces the dry run made
        self._matmul_threads: dict[str, list[int]] = {}  # device -> threads in the order of their first matmul
        self._workspace_keys: set[tuple[str, str, str, int]] = set()
        self.modules: dict[str, ModuleFigures] = {}
        self.iterations = 1
        self._adopting = False
        self.convolutions: set[str] = set()  # CUDA devices where cuDNN would run a convolution

    def adopt(self, objects: Iterable[Any], placements: Iterable[tuple[Any, int]] = ()) -> None:
        """Count what exists before the cell (modules, optimizers, tensors) as already allocated.

        ``placements`` pairs a fake storage with the address of the real one, which places it on the
        real allocator's block (:meth:`AllocatorModel.place`) when the model was seeded.
        """
        objects = list(objects)
        self._adopting = True
        try:
            self.track_external(*objects)
        finally:
            self._adopting = False
        for storage, address in placements:
            found = self._WINFO.get(storage)  # type: ignore[no-untyped-call]
            model = self._model(found[0].device) if found is not None else None
            if model is not None and found is not None:
                model.place(id(found[0]), address)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        if name in _MATMULS:
            self._first_matmul(args, lt=name in _LT_MATMULS or (name == "addmm" and _bias_vector(args)))
        elif name in _CONVOLUTIONS and torch.backends.cudnn.enabled:
            self.convolutions.update(
                _device_name(leaf.device)
                for leaf in tree_leaves(args)
                if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda"
            )
        result = super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[no-untyped-call]
        if not _CUDA_BUILT and any(
            isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda" for leaf in tree_leaves(result)
        ):
            # A CPU-only torch makes fake CUDA tensors, but its autograd aborts the process on them.
            raise Refusal(_NO_CUDA)
        return result

    def _first_matmul(self, args: Any, *, lt: bool) -> None:
        """PyTorch keeps one cuBLAS workspace per (handle, stream), and a handle per thread: the forward's
        matmuls make one, autograd's device thread (the backward) another. A thread's first cuBLASLt call (a
        matmul with a bias vector) also makes a cuBLASLt workspace. Those that exist already are not made."""
        device = next((arg.device for arg in args if isinstance(arg, torch.Tensor)), None)
        if device is None or device.type != "cuda":
            return
        name = _device_name(device)
        threads = self._matmul_threads.setdefault(name, [])
        if threading.get_ident() not in threads:
            threads.append(threading.get_ident())
        order = threads.index(threading.get_ident()) + 1  # this thread's workspace is the order-th
        cublas, cublaslt, existing = self.workspaces.get(name, (0, 0, 0))
        for kind, nbytes in (("cublas", cublas), ("cublaslt", cublaslt) if lt else ("", 0)):
            key = ("workspace", kind, name, order)
            if nbytes and order > existing and key not in self._workspace_keys:
                self._workspace_keys.add(key)
                self.workspaces_made[name] = self.workspaces_made.get(name, 0) + nbytes
                self._model(device).allocate(key, nbytes)  # type: ignore[union-attr]

    def _model(self, device: torch.device) -> AllocatorModel | None:
        if device.type != "cuda":
            return None
        name = f"cuda:{device.index or 0}"
        return self.models.setdefault(name, AllocatorModel())

    def _update_snap(
        self,
        u_type: _UpdateType,
        winfo: Any,
        old_mem_consumed: int | None = None,
        old_reftype: Any = None,
    ) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        model = self._model(winfo.device)
        if model is None:
            return
        nbytes = int(winfo.size) * int(winfo.element_size)
        if u_type == _UpdateType.ADD:
            if self._adopting:
                model.adopt(id(winfo), nbytes)
            else:
                model.allocate(id(winfo), nbytes)
        elif u_type == _UpdateType.DEL:
            model.release(id(winfo))
        elif u_type == _UpdateType.SIZE:
            model.resize(id(winfo), nbytes)

    def _update_peak_stats(self, peak_state: Any) -> None:
        """The global peak only: MemTracker also updates every active module's local peak after every
        operator (a walk over all modules each time, a third of a dry run's time), which is not reported."""
        del peak_state
        for device, kinds in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < kinds[_TOTAL]:
                self._peak_mem[device] = kinds[_TOTAL]
                self._peak_mem_snap[device] = dict(kinds)

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)  # type: ignore[no-untyped-call]
            if set(self._mod_tracker.parents) - {name} == {"Global"}:  # the root module again: a new iteration
                self._keep_module_figures()
                self.reset_mod_stats()
                self.iterations += 1
        super()._pre_fw_hook(module, inputs)

    def _keep_module_figures(self) -> None:
        for stats in self.memory_tracking.values():  # type: ignore[no-untyped-call]
            before = stats.snapshots.get(_ModState.PRE_FW, [])
            after = stats.snapshots.get(_ModState.POST_FW, [])
            grown = sum(_total(post) - _total(pre) for pre, post in zip(before, after, strict=False))
            known = self.modules.get(stats.mod_fqn)
            if known is None or grown > known.forward_bytes:
                self.modules[stats.mod_fqn] = ModuleFigures(stats.mod_fqn, int(stats.parameter_mem), grown)

    def empty_cache(self) -> None:
        """The cell's ``torch.cuda.empty_cache()``: each model releases its free segments."""
        for model in self.models.values():
            model.empty_cache()

    def keep_end(self) -> None:
        """The end of the cell: each allocator model keeps its figures now."""
        for model in self.models.values():
            model.keep_end()

    def module_figures(self) -> list[ModuleFigures]:
        """Every module seen, the iteration with the most forward growth of each."""
        self._keep_module_figures()
        return list(self.modules.values())

    def by_kind(self, which: str) -> dict[str, dict[str, int]]:
        """``{device: {kind: bytes}}`` now (``"current"``) or at the peak (``"peak"``), MemTracker's counts."""
        snapshot = self.get_tracker_snapshot(which)
        figures: dict[str, dict[str, int]] = {}
        for device, kinds in snapshot.items():
            named = {KIND_NAMES.get(str(getattr(kind, "value", kind)), str(kind)): int(v) for kind, v in kinds.items()}
            total = named.pop(_TOTAL, None)
            figures[_device_name(device)] = {**named, "total": int(total or 0)}
        return figures


def _bias_vector(args: Any) -> bool:
    """``addmm(bias, a, b)`` with a bias vector: the cuBLASLt path (``gemm_and_bias``)."""
    bias = args[0] if args else None
    return isinstance(bias, torch.Tensor) and bias.dim() == 1


def _total(snapshot: dict[Any, dict[Any, int]]) -> int:
    return sum(int(kinds.get(_TOTAL, 0)) for kinds in snapshot.values())


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index or 0}"
    return str(device)
