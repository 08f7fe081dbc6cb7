"""What a dry run must not do, and how it stops: refusals named by line, RNG states put back, output kept.

While a dry run runs, reading a tensor's value (``.item()``, ``.tolist()``, ``.numpy()``, formatting or
printing it, ``if loss > 0:``), iterating a ``DataLoader`` (its workers and files are real), writing a file
(``open`` for writing, ``torch.save``) and calling an operator without a fake kernel stop it with a
:class:`Refusal` that names the cell's line and the reason. The CPU, CUDA, ``random`` and numpy random
states are saved before and put back after; what the cell prints is captured and dropped.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import random
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses import fake_tensor

__all__ = ["NO_CUDA", "Refusal", "guarded", "refusal_from"]


class Refusal(Exception):  # noqa: N818 - a refusal, not an error of gpumem's
    """The dry run stopped: ``line`` (of the cell, 1-based; None when not in the cell's code) and why."""

    def __init__(self, reason: str, line: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.line = line


NO_CUDA = (
    "this torch is a CPU-only build: it cannot dry-run CUDA tensors (not even fake ones); dry-run the cell with "
    "its tensors on the cpu, or on a machine with CUDA"
)

_VALUE_READS = {
    "item": ".item() reads a tensor's value",
    "tolist": ".tolist() reads a tensor's values",
    "numpy": ".numpy() reads a tensor's values",
    "__repr__": "printing a tensor reads its values",
    "__str__": "printing a tensor reads its values",
    "__format__": "formatting a tensor reads its values",
    "__bool__": "a condition on a tensor reads its value (data-dependent control flow)",
    "__float__": "float() of a tensor reads its value",
    "__int__": "int() of a tensor reads its value",
}
# Formatting a fake tensor would print a made-up value: refused wherever it happens. The other reads are
# refused in the cell's own code only: torch's code reads the constants fake tensors keep (an
# optimizer's step count), and a read without a value fails by itself there.
_ALWAYS = frozenset({"__repr__", "__str__", "__format__"})


def _value_read(name: str, original: Callable[..., Any], filename: str) -> Callable[..., Any]:
    reason = f"{_VALUE_READS[name]}, which a dry run does not have"
    always = name in _ALWAYS

    def read(self: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self, fake_tensor.FakeTensor) and (
            always or sys._getframe(1).f_code.co_filename == filename  # noqa: SLF001 - who asked for the value
        ):
            raise Refusal(reason)
        return original(self, *args, **kwargs)

    return read


def _value_reads_refused(stack: contextlib.ExitStack, filename: str) -> None:
    """Patch the value reads of ``torch.Tensor`` (and FakeTensor's own ``tolist``) for the dry run's length."""
    for owner in (torch.Tensor, fake_tensor.FakeTensor):
        for name in _VALUE_READS:
            if name in vars(owner) or owner is torch.Tensor:
                stack.enter_context(_patched(owner, name, _value_read(name, getattr(owner, name), filename)))


def _refuse(reason: str, original: Callable[..., Any], thread: int) -> Callable[..., Any]:
    """``original``, refused in the dry run's thread (other threads, the kernel's own, go on as before)."""

    def refused(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != thread:
            return original(*args, **kwargs)
        raise Refusal(reason)

    return refused


def _open_for_reading(original: Callable[..., Any], thread: int) -> Callable[..., Any]:
    def guarded_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == thread and any(flag in str(mode) for flag in "wax+"):
            raise Refusal(f"open({file!r}, {mode!r}) writes a file")
        return original(file, mode, *args, **kwargs)

    return guarded_open


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    own = (isinstance(owner, type) and name in vars(owner)) or not isinstance(owner, type)
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, original)
        else:  # inherited: remove ours, so the class is left without an attribute of its own, as it was
            delattr(owner, name)


@contextlib.contextmanager
def _random_states_kept() -> Iterator[None]:
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    python = random.getstate()
    numpy_random = getattr(sys.modules.get("numpy"), "random", None)
    numpy_state = numpy_random.get_state() if numpy_random is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(python)
        if numpy_random is not None and numpy_state is not None:
            numpy_random.set_state(numpy_state)


@contextlib.contextmanager
def _settings_kept() -> Iterator[None]:
    """Global torch settings a cell may change (``torch.set_grad_enabled(False)``, ``cudnn.benchmark = True``)."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = (
        torch.is_grad_enabled(),
        torch.get_default_dtype(),
        torch.get_float32_matmul_precision(),
        torch.are_deterministic_algorithms_enabled(),
        cudnn.benchmark,
        cudnn.deterministic,
        cudnn.allow_tf32,
        matmul.allow_tf32,
    )
    try:
        yield
    finally:
        grad, dtype, precision, deterministic, benchmark, cudnn_deterministic, cudnn_tf32, matmul_tf32 = saved
        torch.set_grad_enabled(grad)
        torch.set_default_dtype(dtype)
        torch.set_float32_matmul_precision(precision)
        torch.use_deterministic_algorithms(deterministic)
        cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32 = benchmark, cudnn_deterministic, cudnn_tf32
        matmul.allow_tf32 = matmul_tf32


def _counters_kept(stack: contextlib.ExitStack, thread: int, empty_cache: Callable[[], None] | None) -> None:
    cuda = torch.cuda
    for name in ("reset_peak_memory_stats", "reset_max_memory_allocated", "reset_accumulated_memory_stats"):
        reason = f"torch.cuda.{name}() resets your own memory counters"
        stack.enter_context(_patched(cuda, name, _refuse(reason, getattr(cuda, name), thread)))
    original = cuda.empty_cache

    def modelled_empty_cache() -> None:
        if threading.get_ident() != thread:
            original()
        elif empty_cache is not None:
            empty_cache()

    stack.enter_context(_patched(cuda, "empty_cache", modelled_empty_cache))


@contextlib.contextmanager
def guarded(filename: str, empty_cache: Callable[[], None] | None = None) -> Iterator[io.StringIO]:
    """Run the dry run inside this: refusals armed, random states kept, output captured (yielded).

    The cell's ``torch.cuda.empty_cache()`` calls ``empty_cache`` (the allocator model's) instead of
    emptying the real cache; resetting PyTorch's memory counters is refused (they are the user's).
    """
    captured = io.StringIO()
    loader = torch.utils.data.DataLoader
    thread = threading.get_ident()
    iterating = "iterating a DataLoader reads real data (its workers and files)"
    with contextlib.ExitStack() as stack:
        stack.enter_context(_random_states_kept())
        stack.enter_context(_settings_kept())
        stack.enter_context(_patched(builtins, "open", _open_for_reading(builtins.open, thread)))
        stack.enter_context(_patched(io, "open", _open_for_reading(io.open, thread)))
        stack.enter_context(_patched(torch, "save", _refuse("torch.save writes a file", torch.save, thread)))
        stack.enter_context(_patched(loader, "__iter__", _refuse(iterating, loader.__iter__, thread)))
        _counters_kept(stack, thread, empty_cache)
        stack.enter_context(contextlib.redirect_stdout(captured))
        stack.enter_context(contextlib.redirect_stderr(captured))
        _value_reads_refused(stack, filename)
        yield captured


def refusal_from(error: BaseException, filename: str, first_line: int = 1) -> Refusal:
    """The refusal for an exception raised by a dry run: the reason, and the cell's line it came from.

    ``first_line`` is the number the cell gives the code's first line (2 below a ``%%gpumem`` header).
    """
    line = None
    for frame, number in traceback.walk_tb(error.__traceback__):
        if frame.f_code.co_filename == filename:
            line = number + first_line - 1
    return Refusal(_reason(error), line)


def _reason(error: BaseException) -> str:
    if isinstance(error, Refusal):
        return error.reason
    if isinstance(error, fake_tensor.DataDependentOutputException):
        return f"{error.func} needs a tensor's value, which a dry run does not have"
    if isinstance(error, fake_tensor.DynamicOutputShapeException):
        return f"{error.func}'s output size depends on the tensor's values, which a dry run does not have"
    if isinstance(error, fake_tensor.UnsupportedOperatorException):
        return f"operator {error.func} has no fake kernel (a C extension?), so it cannot be dry-run"
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if "not linked with support for cuda" in text.lower():
        return NO_CUDA
    if "data-dependent" in text.lower() or "data dependent" in text.lower():
        return f"the cell depends on a tensor's value, which a dry run does not have ({text[:160]})"
    return f"the dry run raised {type(error).__name__}: {text[:200]}"
