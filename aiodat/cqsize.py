"""CQ sizing: everything that feeds an EVD's completion queue must fit in it.

An EVD's CQ is shared by every EP whose ``request_evd`` or ``recv_evd`` it is
(and, through them, by their SRQs).  Each EP may have as many completions
pending as its queues are deep, so a CQ smaller than the sum can overrun: the
device then reports IBV_EVENT_CQ_ERR and completions are lost.  aiodat keeps
the CQ at least as long as that sum: when an EP (or a larger SRQ) would make
the sum exceed the entries of an EVD's CQ, the CQ is grown with
``ibv_resize_cq`` before the EP's QP is created.  The EVD's ``qlen`` (how
many events it queues; DTO completions beyond it wait in the CQ) does not
change.  When the device cannot hold the sum (above ``max_evd_qlen``, the
device's max_cqe) or refuses to resize, :class:`aiodat.InvalidParameter` names
the EVD and both numbers.  Closing an EP gives its share back (aiodat never
shrinks a CQ).  See docs/events.md, "Sharing an EVD between endpoints".

The shares are what ``ep._cq_shares()`` says (duck-typed: this module sits
below ep.py): ``(evd, key, entries)``, where equal keys count once, so an SRQ
whose EPs complete on one EVD counts its size once there.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Hashable, Iterable, Mapping, Optional, Tuple

from aiodat._lib import ffi, lib
from aiodat.errors import InvalidParameter, error_from_errno

if TYPE_CHECKING:
    from aiodat.evd import EVD

Share = Tuple["EVD", Hashable, int]


def demand(ia: Any, evd: "EVD", extra: Iterable[Share] = (), override: Optional[Mapping[Hashable, int]] = None) -> int:
    """The completions that may be pending at once on ``evd``'s CQ: the shares of the IA's EPs
    (``ia._qpn_owner``) plus ``extra``; ``override`` replaces the entries of some keys (an SRQ being resized)."""
    parts: Dict[Hashable, int] = {}
    for ep in list(ia._qpn_owner.values()):
        for share_evd, key, entries in ep._cq_shares():
            if share_evd is evd:
                parts[key] = entries
    for share_evd, key, entries in extra:
        if share_evd is evd:
            parts[key] = entries
    if override:
        for key, entries in override.items():
            if key in parts:
                parts[key] = entries
    return sum(parts.values())


def cq_entries(evd: "EVD") -> int:
    """How many completions the EVD's CQ holds (what the device gave: at least ``qlen``); 0 without a CQ."""
    cq = evd._cq
    return 0 if cq == ffi.NULL else int(cq.cqe)


def fit_cqs(ia: Any, extra: Iterable[Share] = (), override: Optional[Mapping[Hashable, int]] = None,
            evds: Optional[Iterable["EVD"]] = None, what: str = "the new EP") -> None:
    """Grow each EVD that ``extra`` (or ``evds``) names until its demand fits; raise InvalidParameter if it cannot.

    The exact demand walks every EP of the IA, so it is not taken for every new EP: each EVD
    keeps an upper bound of its demand (``_cq_bound``: the last exact figure plus every share
    added since; a closed EP only makes it looser), and a new EP that fits under the bound is
    let through at once.  A CQ that must grow grows to at least one and a half times its size,
    so N EPs sharing one EVD cost O(log N) exact walks, not N."""
    extra = list(extra)
    added: Dict["EVD", int] = {}  # (insertion-ordered) each target EVD -> the entries extra adds to it
    for evd in (evds if evds is not None else ()):
        added[evd] = 0
    for share_evd, _key, entries in extra:
        if evds is None or share_evd in added:
            added[share_evd] = added.get(share_evd, 0) + entries
    limit = ia._device_attr.max_cqe
    for evd, more in added.items():
        have = cq_entries(evd)
        if not have:
            continue
        bound = evd._cq_bound
        if bound is not None and override is None and bound + more <= have:
            evd._cq_bound = bound + more
            continue
        need = demand(ia, evd, extra, override)
        if need > have:
            if need > limit:
                raise InvalidParameter(
                    f"{evd!r} would need {need} CQ entries for its endpoints' queues with {what}, but its CQ has "
                    f"{have} (qlen is {evd.qlen}) and the device allows at most {limit} (max_evd_qlen): use "
                    f"smaller EPAttr queue depths or another EVD")
            if lib.ibv_resize_cq(evd._cq, min(max(need, have + have // 2), limit)):
                exc = error_from_errno(ffi.errno, "ibv_resize_cq")
                raise InvalidParameter(f"{evd!r} would need {need} CQ entries with {what} but its CQ has {have}, "
                                       f"and growing it failed: {exc}") from exc
        evd._cq_bound = need
