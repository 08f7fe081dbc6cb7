"""Fake copies of the user's objects: what a dry run runs on instead of them.

Tensors, modules and optimizers (and the containers and objects that hold them) are deep-copied under
PyTorch's ``FakeCopyMode`` with one shared memo, so every copy holds fake tensors (shape, dtype, device,
no data) and the copies keep the originals' sharing: an optimizer's parameters are the fake copies of the
model's, a tensor held by two names is one fake. Parameters' gradients, which ``Parameter.__deepcopy__``
does not copy, are copied too. Functions whose globals are the namespace are rebuilt over the copied
namespace, so a step function defined in the notebook runs on the copies as well. Objects that cannot be
deep-copied (open files, locks, C objects) are shared, and named in the report.
"""

from __future__ import annotations

import contextlib
import copy
import types
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensor, FakeTensorMode

__all__ = ["Isolation", "isolate", "kernels_as_real", "modules_convert", "no_context_probe", "rebuild"]

# Values that are never copied: they hold no user state a cell can change through the namespace.
_SHARED_TYPES = (types.ModuleType, type, types.BuiltinFunctionType, types.MethodWrapperType)
_LARGEST_COPIED = 64 << 20  # bytes of a non-torch value (a numpy array) above which it is shared, not copied


@dataclass
class Isolation:
    """The copied namespace and what became of each name."""

    namespace: dict[str, Any]
    fake_mode: FakeTensorMode
    faked: list[str] = field(default_factory=list)  # names whose value holds fake copies of tensors
    shared: list[str] = field(default_factory=list)  # names that could not be copied (the cell sees the original)
    roots: list[Any] = field(default_factory=list)  # the copied modules, optimizers and tensors, to count
    placements: list[tuple[Any, int]] = field(default_factory=list)  # (fake storage, real address) on CUDA


def isolate(namespace: Mapping[str, Any], skip: Iterable[str] = (), home: Mapping[str, Any] | None = None) -> Isolation:
    """A copy of ``namespace`` over fake copies; names in ``skip`` (IPython's own) are left out.

    Functions whose globals are ``home`` (default: ``namespace`` itself) are rebuilt over the copy.
    """
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    skipped = set(skip)
    isolation = Isolation({}, fake_mode)
    memo: dict[int, Any] = {}
    order = sorted(namespace, key=lambda name: _copy_order(namespace[name]))
    with FakeCopyMode(fake_mode):
        for name in order:
            if name in skipped or name == "__builtins__":  # IPython's own names: seen as they are, not copied
                isolation.namespace[name] = namespace[name]
                continue
            _copy_one(name, namespace[name], memo, isolation)
    originals = list(_tensors_of(_torch_roots(namespace[name] for name in isolation.faked)))
    with FakeCopyMode(fake_mode):
        _copy_gradients(originals, memo)
    isolation.placements = _placements(originals, memo)
    _scalars_as_constants(namespace, isolation.faked, memo, fake_mode)
    _unconditional_scaler_steps(isolation.namespace.values())
    home = namespace if home is None else home
    isolation.namespace.update(_rebound_functions(namespace, home, isolation.namespace, skipped))
    isolation.roots = list(_torch_roots(isolation.namespace[name] for name in isolation.faked))
    return isolation


def _tensors_of(roots: Iterable[Any]) -> Iterator[torch.Tensor]:
    """Every tensor a root holds: parameters, buffers and their gradients, optimizer state, the tensor itself."""
    for root in roots:
        if isinstance(root, torch.nn.Module):
            for parameter in root.parameters():
                yield parameter
                if parameter.grad is not None:
                    yield parameter.grad
            yield from root.buffers()
        elif isinstance(root, torch.optim.Optimizer):
            for state in root.state.values():
                yield from (value for value in state.values() if isinstance(value, torch.Tensor))
        elif isinstance(root, torch.Tensor):
            yield root
            if root.is_leaf and root.grad is not None:
                yield root.grad


def _placements(originals: list[torch.Tensor], memo: dict[int, Any]) -> list[tuple[Any, int]]:
    """(fake storage, the real storage's address) of every CUDA tensor copied."""
    pairs: dict[int, tuple[Any, int]] = {}
    for original in originals:
        fake = memo.get(id(original))
        if original.is_cuda and isinstance(fake, torch.Tensor):
            storage = fake.untyped_storage()
            pairs[id(storage)] = (storage, original.untyped_storage().data_ptr())
    return list(pairs.values())


def _copy_order(value: Any) -> int:
    """Modules first, then optimizers, then the rest: the memo then maps a parameter to its module's copy."""
    if isinstance(value, torch.nn.Module):
        return 0
    if isinstance(value, torch.optim.Optimizer):
        return 1
    return 2


def _copy_one(name: str, value: Any, memo: dict[int, Any], isolation: Isolation) -> None:
    if isinstance(value, (*_SHARED_TYPES, types.FunctionType)):
        isolation.namespace[name] = value
        return
    if not isinstance(value, torch.Tensor) and _nbytes(value) > _LARGEST_COPIED:
        isolation.namespace[name] = value  # a large array: copying it would cost its memory
        isolation.shared.append(name)
        return
    try:
        copied = copy.deepcopy(value, memo)
    except Exception:
        isolation.namespace[name] = value
        if _holds_torch(value):
            isolation.shared.append(name)
        return
    isolation.namespace[name] = copied
    if copied is not value and _holds_torch(copied):
        isolation.faked.append(name)


def _nbytes(value: Any) -> int:
    nbytes = getattr(value, "nbytes", 0)
    return nbytes if isinstance(nbytes, int) else 0


def _copy_gradients(originals: list[torch.Tensor], memo: dict[int, Any]) -> None:
    """``Parameter.__deepcopy__`` drops ``.grad``: give each copied parameter a fake copy of its gradient."""
    for original in originals:
        if original.is_leaf and original.grad is not None:
            fake = memo.get(id(original))
            if isinstance(fake, torch.Tensor) and fake.grad is None:
                fake.grad = copy.deepcopy(original.grad, memo)


def _scalars_as_constants(
    namespace: Mapping[str, Any], faked: list[str], memo: dict[int, Any], fake_mode: FakeTensorMode
) -> None:
    """An optimizer's step counters are CPU scalars its step reads (``.item()``); a fake copy of a real
    tensor has no value, but one made under the fake mode from a number keeps it as a constant."""
    for original in _torch_roots(namespace[name] for name in faked):
        copied = memo.get(id(original))
        if not isinstance(original, torch.optim.Optimizer) or not isinstance(copied, torch.optim.Optimizer):
            continue
        for parameter, state in original.state.items():
            fake = memo.get(id(parameter))
            target = copied.state.get(fake) if fake is not None else None
            if target is None:
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() == 0 and value.device.type == "cpu":
                    number = value.item()  # the real value, read outside the fake mode
                    with fake_mode:
                        target[key] = torch.tensor(number, dtype=value.dtype)


def _unconditional_scaler_steps(values: Iterable[Any]) -> None:
    """A GradScaler skips ``optimizer.step()`` when a gradient is not finite, which it learns with ``.item()``,
    a value a dry run does not have. The copies step always (the case that takes memory)."""
    scaler_type = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if scaler_type is None:
        return
    for value in values:
        if isinstance(value, scaler_type):
            value._maybe_opt_step = _always_step  # noqa: SLF001 - on the fake copy only


def _always_step(optimizer: Any, optimizer_state: Any, *args: Any, **kwargs: Any) -> Any:
    del optimizer_state
    return optimizer.step(*args, **kwargs)


def _holds_torch(value: Any, depth: int = 0) -> bool:
    if isinstance(value, torch.Tensor | torch.nn.Module | torch.optim.Optimizer):
        return True
    if depth > 2:  # noqa: PLR2004 - containers of containers of tensors, not deeper
        return False
    if isinstance(value, Mapping):
        return any(_holds_torch(item, depth + 1) for item in list(value.values())[:64])
    if isinstance(value, list | tuple | set):
        return any(_holds_torch(item, depth + 1) for item in list(value)[:64])
    state = getattr(value, "__dict__", None)
    return isinstance(state, dict) and any(_holds_torch(item, depth + 1) for item in list(state.values())[:64])


def _torch_roots(values: Iterable[Any], depth: int = 0) -> Iterator[Any]:
    """The modules, optimizers and tensors inside the copied values (MemTracker counts them as existing)."""
    for value in values:
        if isinstance(value, torch.Tensor | torch.nn.Module | torch.optim.Optimizer):
            yield value
        elif depth < 3:  # noqa: PLR2004 - as _holds_torch
            if isinstance(value, Mapping):
                yield from _torch_roots(list(value.values()), depth + 1)
            elif isinstance(value, list | tuple | set):
                yield from _torch_roots(list(value), depth + 1)
            elif isinstance(getattr(value, "__dict__", None), dict):
                yield from _torch_roots(list(vars(value).values()), depth + 1)


def _rebound_functions(
    original: Mapping[str, Any], home: Mapping[str, Any], copied: dict[str, Any], skip: set[str]
) -> dict[str, Any]:
    """Functions defined over ``home`` (a notebook's ``def step():``), rebuilt to see ``copied``."""
    rebound: dict[str, Any] = {}
    for name, value in original.items():
        if name in skip or not isinstance(value, types.FunctionType) or value.__globals__ is not home:
            continue
        rebound[name] = rebuild(value, copied)
    return rebound


def rebuild(function: types.FunctionType, namespace: dict[str, Any], closure: tuple[Any, ...] | None = None) -> Any:
    """``function`` with ``namespace`` as its globals (and ``closure``'s cells, if given)."""
    closure = function.__closure__ if closure is None else closure
    copied = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__, closure)
    copied.__kwdefaults__ = copy.copy(function.__kwdefaults__)
    copied.__dict__.update(function.__dict__)
    copied.__qualname__ = function.__qualname__
    return copied


@contextlib.contextmanager
def kernels_as_real() -> Iterator[None]:
    """Let optimizers and ``clip_grad_norm_`` choose their foreach (multi-tensor) kernels for fake tensors as
    they do for real ones, by device: PyTorch admits only plain tensors there, so a fake step would take the
    one-tensor-at-a-time path, whose temporaries are one parameter's, where the real step's are all of them."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    lists: list[list[Any]] = [
        optimizer._foreach_supported_types,  # noqa: SLF001
        _foreach_utils._foreach_supported_types,  # noqa: SLF001
    ]
    added = [kinds for kinds in lists if FakeTensor not in kinds]
    for kinds in added:
        kinds.append(FakeTensor)
    try:
        yield
    finally:
        for kinds in added:
            kinds.remove(FakeTensor)


@contextlib.contextmanager
def no_context_probe(started: list[str]) -> Iterator[None]:
    """Keep PyTorch's fake tensors from allocating on a CUDA device.

    The first fake tensor on a CUDA device makes a real one-element tensor there (``init_gpu_context``), so
    that a backward over fakes finds a CUDA context. Where this process has the context, that allocation
    (512 B, in a 2 MiB segment the first time) is its only effect, and is skipped; where it has not, the
    context alone is made (no tensor, no cached segment) and the device is appended to ``started``: the
    dry run started CUDA there, and says so.
    """
    from torch._subclasses import fake_tensor

    original = fake_tensor.init_gpu_context

    def init_gpu_context(device: torch.device) -> None:
        if device.type != "cuda":
            original(device)
            return
        if not torch.cuda.is_available() or _has_context(device):
            return
        index = _device_index(device)
        torch.cuda.synchronize(index)  # the runtime makes the device's primary context for this call
        if _has_context(device) and f"cuda:{index}" not in started:
            started.append(f"cuda:{index}")

    fake_tensor.init_gpu_context = init_gpu_context  # type: ignore[assignment]
    try:
        yield
    finally:
        fake_tensor.init_gpu_context = original


def _has_context(device: torch.device) -> bool:
    """Whether this process holds a CUDA context on ``device``, asked without creating one."""
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return False
    probe = getattr(torch._C, "_cuda_hasPrimaryContext", None)  # noqa: SLF001 - PyTorch's own test of it
    return bool(probe is not None and probe(_device_index(device)))


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@contextlib.contextmanager
def modules_convert(fake_mode: FakeTensorMode) -> Iterator[None]:
    """Let ``module.half()``, ``.to(device)``, ``.cuda()`` run on fake parameters, as they run on real ones.

    ``Module._apply`` swaps a fake parameter with its converted copy (``torch.utils.swap_tensors``), which
    refuses a tensor with a weak reference, and the fake mode's memo holds one on every fake it made
    (PyTorch issue 148977): so a cell that builds a model and moves it failed. The swap is let through once
    the two fakes are out of the memo, which only caches them.
    """
    import torch.utils

    original = torch.utils.swap_tensors
    memo = fake_mode.fake_tensor_converter.tensor_memo

    def swap_tensors(first: torch.Tensor, second: torch.Tensor) -> None:
        for tensor in (first, second):
            if isinstance(tensor, FakeTensor):
                # Keys only: a reference kept to a weakref object keeps it on the tensor.
                keys = [getattr(ref, "key", None) for ref in weakref.getweakrefs(tensor)]
                for key in keys:
                    if key is not None and memo.get(key) is tensor:
                        del memo[key]
        shared = first.untyped_storage()._cdata == second.untyped_storage()._cdata  # noqa: SLF001 - identity
        original(first, second)  # type: ignore[no-untyped-call]
        if isinstance(second, FakeTensor) and not shared:
            # A real parameter takes its converted data with `.data =`, which frees the old storage there
            # and then; after a swap the old data would live on in _apply's loop variable until the next
            # parameter is converted. Emptied, it is freed at the same moment as the real one.
            second.untyped_storage().resize_(0)

    torch.utils.swap_tensors = swap_tensors
    try:
        yield
    finally:
        torch.utils.swap_tensors = original
