"""Beneath a cell that died of CUDA out-of-memory, show why and how to get the memory back.

The explanation is :mod:`gpumem.core.diagnoses.oom`'s; this is its IPython side. The loaded extension's cell
hooks call one :class:`OomExplainer` around every cell. :func:`install` hooks one into a shell on
its own, without the rest of the extension.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from gpumem.core.diagnoses import oom
from gpumem.ipython.arguments import display

__all__ = ["OomExplainer", "install", "uninstall"]


class OomExplainer:
    """Explains CUDA out-of-memory errors of the cells run in ``shell`` (observing from creation to close).

    ``source`` supplies allocator figures (the shared monitor's by default, once CUDA is initialized);
    ``holder_device`` widens the holders list beyond the failing device (``"all"``, ``"cpu"``; default:
    the device that ran out).
    """

    def __init__(self, shell: Any, *, source: Any = None, holder_device: str | None = None) -> None:
        self.shell = shell
        self.source = source
        self.holder_device = holder_device
        self.cell_started_s = time.monotonic()
        self.closed = False
        oom.start_observing()

    def pre_run_cell(self, _info: Any = None) -> None:
        """A cell starts: the observer's figures count from now on."""
        self.cell_started_s = time.monotonic()
        oom.attach_observer()

    def post_run_cell(self, result: Any) -> None:
        """Never raises: a failure to explain must not cost the user their kernel or the original error."""
        try:
            error = getattr(result, "error_in_exec", None)
            if error is not None:  # most cells raise nothing: nothing to explain
                report = oom.explain_if_oom(
                    error,
                    started_s=self.cell_started_s,
                    shell=self.shell,
                    source=self.source,
                    holder_device=self.holder_device,
                )
                if report is not None:
                    display(text=oom.render_text(report), html=oom.render_html(report))
                    from gpumem.panel.cell_source import note_oom

                    note_oom(report)  # the panels show it too, next to the actions that free memory
            oom.attach_observer()  # the cell may have initialized CUDA
        except (Exception, KeyboardInterrupt) as failure:
            print(f"gpumem: could not explain the out-of-memory error ({type(failure).__name__}: {failure})")

    def close(self) -> None:
        """Stop observing (PyTorch cannot detach an observer: it becomes a no-op once no one observes)."""
        if not self.closed:
            self.closed = True
            oom.stop_observing()


_installed: OomExplainer | None = None


def install(shell: Any, source: Any = None, holder_device: str | None = None) -> OomExplainer:
    """Explain CUDA out-of-memory errors beneath the failing cells of ``shell``, without the rest of gpumem.

    Idempotent: installing into the same shell again only updates ``source`` and ``holder_device``;
    installing into another shell first uninstalls from the previous one.
    """
    global _installed
    if _installed is not None and _installed.shell is shell:
        _installed.source = source
        _installed.holder_device = holder_device
        return _installed
    if _installed is not None:
        uninstall(_installed.shell)
    explainer = OomExplainer(shell, source=source, holder_device=holder_device)
    shell.events.register("pre_run_cell", explainer.pre_run_cell)
    shell.events.register("post_run_cell", explainer.post_run_cell)
    _installed = explainer
    return explainer


def uninstall(shell: Any) -> None:
    """Remove what :func:`install` added to ``shell``; nothing installed there is fine."""
    global _installed
    explainer = _installed
    if explainer is None or explainer.shell is not shell:
        return
    _installed = None
    for event, callback in (("pre_run_cell", explainer.pre_run_cell), ("post_run_cell", explainer.post_run_cell)):
        with contextlib.suppress(ValueError):
            shell.events.unregister(event, callback)
    explainer.close()
