"""In a real kernel: 100 reloads in automatic mode with panels open leave exactly one of everything,
unloading leaves nothing, and every cell is recorded with its status, a real interrupt included."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from kernels import Kernel, running_kernel

from _harness import JupyterEnv

pytestmark = pytest.mark.kernel

RELOADS = 100

# What gpumem has put into the kernel, counted from the kernel's own registries (JSON on one line). A shown
# panel walks the holders on a short-lived worker after each cell: the probe first waits for such workers to
# end (on a loaded machine a walk may outlast the cell), so a worker that never ends is still counted.
_PROBE = """
import json as _j, sys as _s, threading as _t
for _th in _t.enumerate():
    if _th.name in ("gpumem-holders-walk", "gpumem-reclaim", "gpumem-free"):
        _th.join(30)
def _gpumem_owned(obj):
    target = getattr(obj, "__self__", obj)
    return type(target).__module__.startswith("gpumem") or getattr(obj, "__module__", "").startswith("gpumem")
_sh = get_ipython()
_w = _s.modules.get("gpumem.panel.widget")
print(_j.dumps({
    "threads": sorted(t.name for t in _t.enumerate() if t.name.startswith("gpumem") and t.is_alive()),
    "callbacks": {name: len(cbs) for name, cbs in _sh.events.callbacks.items()},
    "gpumem_callbacks": sum(_gpumem_owned(cb) for cbs in _sh.events.callbacks.values() for cb in cbs),
    "line_magic": "gpumem" in _sh.magics_manager.magics["line"],
    "cell_magic": "gpumem" in _sh.magics_manager.magics["cell"],
    "registry": sorted(k for k, v in _sh.magics_manager.registry.items() if _gpumem_owned(v)),
    "transformers": sum(_gpumem_owned(t) for t in _sh.input_transformers_cleanup + _sh.input_transformers_post),
    "configurables": sum(_gpumem_owned(c) for c in _sh.configurables),
    "panels": len(_w.open_panels()) if _w is not None else 0,
    "comm_target": "gpumem.status" in _sh.kernel.comm_manager.targets,
}))
del _j, _s, _t, _th, _sh, _w, _gpumem_owned
"""


def probe(kernel: Kernel) -> dict[str, Any]:
    reply = kernel.run(_PROBE)
    assert reply.status == "ok", reply
    result: dict[str, Any] = json.loads(reply.text.strip().splitlines()[-1])
    return result


def ok(kernel: Kernel, code: str) -> str:
    reply = kernel.run(code)
    assert reply.status == "ok" and "Traceback" not in reply.text, (code, reply)
    return reply.text


def test_a_hundred_reloads_with_panels_leave_one_of_everything_and_unload_leaves_nothing(
    jupyter_env: JupyterEnv,
) -> None:
    with running_kernel(jupyter_env) as kernel:
        before = probe(kernel)
        ok(kernel, "%load_ext gpumem\n%gpumem auto on\n%gpumem monitor")
        ok(kernel, "import gpumem\np = gpumem.Panel()\np")
        loaded = probe(kernel)
        assert loaded["threads"] == ["gpumem-panel-writer", "gpumem-sampler"], loaded
        assert loaded["panels"] == 2 and loaded["comm_target"], loaded
        assert loaded["line_magic"] and loaded["cell_magic"] and len(loaded["registry"]) == 1, loaded
        assert loaded["gpumem_callbacks"] == 2 and loaded["transformers"] == 1, loaded
        started = time.monotonic()
        for i in range(RELOADS):
            ok(kernel, "%reload_ext gpumem")
            # Alternate the two ways of making a panel, so that each reload closes both kinds.
            ok(kernel, "%gpumem monitor" if i % 2 else "p = gpumem.Panel()\np")
            now = probe(kernel)
            assert now == {**loaded, "panels": 1}, (i, now)
        elapsed = time.monotonic() - started
        assert "automatic mode is on" in ok(kernel, "%gpumem auto"), "the setting survived the reloads"
        ok(kernel, "%unload_ext gpumem")
        after = probe(kernel)
        assert after == before, (before, after)
        assert ok(kernel, "print(p.closed)").strip() == "True"
    print(f"{RELOADS} reloads with a panel each in {elapsed:.1f} s")


_CELLS: list[tuple[str, str]] = [
    ("x = 1", "ok"),
    ("raise ValueError('a user error')", "error"),
    ("raise KeyboardInterrupt", "interrupted"),
    ("raise SystemExit(3)", "error"),
    ("import torch\nraise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')", "out of memory"),
    ("y = [0] * 10", "ok"),
]


def test_every_cell_is_recorded_with_its_status_a_real_interrupt_included(jupyter_env: JupyterEnv) -> None:
    with running_kernel(jupyter_env) as kernel:
        ok(kernel, "%load_ext gpumem\n%gpumem auto on")
        statuses: list[str] = []
        for code, status in _CELLS:
            reply = kernel.run(code)
            assert reply.status == ("ok" if status == "ok" else "error"), (code, reply)
            assert "gpumem" not in reply.traceback, reply.traceback  # only the user's own frames
            statuses.append(status)
        # A real SIGINT from the kernel manager while the cell sleeps.
        msg_id = kernel.send("import time\ntime.sleep(60)")
        time.sleep(1.5)
        kernel.interrupt()
        reply = kernel.collect(msg_id, timeout=30)
        assert reply.error == "KeyboardInterrupt", reply
        statuses.append("interrupted")
        ok(kernel, "z = 2")
        statuses.append("ok")
        text = ok(
            kernel, "import json, gpumem\nprint(json.dumps(gpumem.history()[['status', 'error']].values.tolist()))"
        )
        # Importing pandas may grow the process enough for automatic mode's summary line under the cell.
        history = json.loads(next(line for line in text.splitlines() if line.startswith("[[")))
    # The cell that switched automatic mode on is not measured; the history cell itself is still running.
    assert [status for status, _ in history] == statuses, history
    errors = [error for _, error in history]
    assert errors[1] == "ValueError: a user error"
    assert errors[3] == "SystemExit: 3"
    assert errors[4].startswith("OutOfMemoryError: CUDA out of memory")
    assert errors[6] == "KeyboardInterrupt"
