"""Give every storage one owner, so that rows add up to the total without double counting.

A storage goes to the root that reaches it most directly (lowest rank), then to the root reaching most
memory, then to the first in namespace order. Optimizer state then moves to the row that owns its
parameter (usually the model), so a model's row shows what training it costs.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from gpumem.core.holders.model import OPTIMIZER_STATE, PARAMETERS, Holder
from gpumem.core.holders.tensors import StorageKey
from gpumem.core.holders.walk import Root

__all__ = ["attribute"]

_MAX_PARTNERS_NAMED = 3


def attribute(
    roots: list[Root],
    sizes: Mapping[StorageKey, int],
    incomplete: Collection[int] = (),
    graph_saved: Mapping[int, int] | None = None,
) -> list[tuple[bool, Holder]]:
    """``(hidden, row)`` for every root that reaches memory, largest first.

    ``graph_saved`` maps ``id(root)`` to the bytes only that root's autograd graphs keep.
    """
    ledger = _Ledger(roots, sizes)
    saved = graph_saved or {}
    rows: list[tuple[bool, Holder]] = []
    for root in roots:
        if not root.reach:
            continue  # reaches no storage (most names): no row, as ledger.row would find
        row = ledger.row(root, complete=id(root) not in incomplete, graph_saved_bytes=saved.get(id(root), 0))
        if row is not None:
            rows.append((root.hidden, row))
    rows.sort(key=lambda pair: (-pair[1].nbytes, -pair[1].shared_bytes, pair[1].name))
    return rows


class _Ledger:
    """Who owns each storage, who else reaches it, and which optimizer state moved to its parameter's owner."""

    def __init__(self, roots: list[Root], sizes: Mapping[StorageKey, int]) -> None:
        self.sizes = sizes
        self.owner: dict[StorageKey, Root] = {}
        self.reachers: dict[StorageKey, list[Root]] = {}
        self.moved: dict[StorageKey, Root] = {}  # optimizer state storage -> the root it was taken from
        self.state_holders: dict[int, set[str]] = {}  # id(new owner) -> names of the optimizers it took state from
        self._totals: dict[int, int] = {}  # id(root) -> bytes it reaches, for the roots that compete for a storage
        self._choose_owners(roots)
        self._move_optimizer_state(roots)
        self.owned_keys: dict[int, list[StorageKey]] = {}
        for key, holder in self.owner.items():
            self.owned_keys.setdefault(id(holder), []).append(key)

    def _choose_owners(self, roots: list[Root]) -> None:
        owner, reachers = self.owner, self.reachers
        for root in roots:
            for key, edge in root.reach.items():
                current = owner.get(key)
                if current is None:  # the common case: the first (often the only) root reaching it
                    owner[key] = root
                    reachers[key] = [root]
                    continue
                reachers[key].append(root)
                if (edge.rank, -self._reach_total(root), root.order) < (
                    current.reach[key].rank,
                    -self._reach_total(current),
                    current.order,
                ):
                    owner[key] = root

    def _reach_total(self, root: Root) -> int:
        """All the memory ``root`` reaches (the tie-break between equally direct roots), computed once."""
        total = self._totals.get(id(root))
        if total is None:
            total = self._totals[id(root)] = sum(self.sizes[key] for key in root.reach)
        return total

    def _move_optimizer_state(self, roots: list[Root]) -> None:
        """Optimizer state goes to the row that owns the parameter it belongs to (a module, usually)."""
        for root in roots:
            for key, param_key in root.param_of_state.items():
                if self.owner.get(key) is not root or root.reach[key].category != OPTIMIZER_STATE:
                    continue
                param_owner = self.owner.get(param_key)
                if param_owner is None or param_owner is root or param_owner.hidden:
                    continue
                if param_owner.reach[param_key].category != PARAMETERS:
                    continue
                self.owner[key] = param_owner
                self.moved[key] = root
                self.state_holders.setdefault(id(param_owner), set()).add(root.name)

    def row(self, root: Root, *, complete: bool, graph_saved_bytes: int = 0) -> Holder | None:
        """The row of ``root``; None when it reaches no memory at all."""
        sizes, owner, moved, reachers = self.sizes, self.owner, self.moved, self.reachers
        owned = 0
        breakdown: dict[str, int] = {}
        devices: set[str] = set()
        partners: dict[str, None] = {}  # names sharing storage with this root, in order of discovery
        for key in self.owned_keys.get(id(root), ()):
            nbytes = sizes[key]
            owned += nbytes
            category = OPTIMIZER_STATE if key in moved else root.reach[key].category
            breakdown[category] = breakdown.get(category, 0) + nbytes
            devices.add(key[0])
            for other in reachers[key]:
                if other is not root:
                    partners[other.name] = None
        shared = 0
        for key in root.reach:
            holder = owner[key]
            if holder is not root:
                shared += sizes[key]
                partners[holder.name] = None
        if not owned and not shared:
            return None
        partner_names = tuple(partners)
        notes = self._notes(root, owned=owned, partner_names=partner_names)
        return Holder(
            root.name,
            root.type_name,
            next(iter(devices)) if len(devices) == 1 else ",".join(sorted(devices)),
            owned,
            shared,
            len(root.tensor_ids),
            tuple(root.graph_paths),
            breakdown,
            partner_names,
            notes[0] if len(notes) == 1 else "; ".join(notes),
            complete,
            graph_saved_bytes,
        )

    def _notes(self, root: Root, *, owned: int, partner_names: tuple[str, ...]) -> list[str]:
        if owned and not root.note and id(root) not in self.state_holders:
            return []
        notes: list[str] = [root.note] if root.note else []
        if id(root) in self.state_holders:
            notes.append("optimizer state held by " + ", ".join(sorted(self.state_holders[id(root)])))
        if not owned:  # reaches only memory counted under other rows
            verb = "still held by " if root.hidden else "counted under "
            notes.append(verb + ", ".join(partner_names[:_MAX_PARTNERS_NAMED]))
        return notes
