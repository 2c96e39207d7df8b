"""Figures taken in rounds and the median of their ratios: the report every ``aiodat bench`` comparison prints.

The machines the benchmarks run on are shared and noisy, so each figure is
taken ``--repeat`` times (rounds), aiodat's and its peers' one after the other
in every round.  A ratio is computed *within* a round (aiodat's figure over the
peer's from the same round), and the report gives the median of those ratios:
a round that ran while the machine was busy slows both sides of its ratio.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence

from .stats import median, ratio


@dataclass
class Figure:
    """One measured quantity, one value per round (None where it could not be measured, with why)."""

    key: str
    label: str
    unit: str
    values: List[Optional[float]] = field(default_factory=list)
    errors: List[Optional[str]] = field(default_factory=list)

    def record(self, value: Optional[float], error: Optional[str] = None) -> None:
        """Append this round's value (or None and the reason it is missing)."""
        self.values.append(value)
        self.errors.append(error if value is None else None)

    @property
    def median(self) -> Optional[float]:
        """The median of the rounds' values, None when no round measured it."""
        return median(self.values)


@dataclass
class Ratio:
    """``ours / theirs`` for each round (same round on both sides) and their median."""

    ours: str
    theirs: str
    label: str
    values: List[Optional[float]]

    @property
    def median(self) -> Optional[float]:
        """The median of the per-round ratios, None when no round had both figures."""
        return median(self.values)


def round_ratios(ours: Sequence[Optional[float]], theirs: Sequence[Optional[float]]) -> List[Optional[float]]:
    """Per-round ratios of two figures' values (None for a round missing either)."""
    return [None if a is None else ratio(a, b) for a, b in zip(ours, theirs)]


def median_of_ratios(ours: Sequence[Optional[float]], theirs: Sequence[Optional[float]]) -> Optional[float]:
    """The median over rounds of ``ours[i] / theirs[i]``: the figure ``--repeat`` reports."""
    return median(round_ratios(ours, theirs))


def _num(value: Optional[float], width: int, digits: int) -> str:
    return f"{'n/a':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


@dataclass
class Comparison:
    """A benchmark's report: figures by round, ratios by round and their medians.

    ``format()`` is what ``aiodat bench ...`` prints, ``as_dict()`` what
    ``--json`` prints; ``ok`` is False when a figure of aiodat's (a key
    starting with ``aiodat``) has a round without a value.
    """

    command: str
    setup: Dict[str, Any]
    rounds: int
    figures: Dict[str, Figure] = field(default_factory=dict)
    ratio_pairs: List[tuple] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    title: str = ""

    def figure(self, key: str, label: str, unit: str) -> Figure:
        """The figure ``key``, made (in print order) the first time it is asked for."""
        if key not in self.figures:
            self.figures[key] = Figure(key, label, unit)
        return self.figures[key]

    def compare(self, ours: str, theirs: str, label: Optional[str] = None) -> None:
        """Report ``ours / theirs`` (figure keys) per round and its median."""
        self.ratio_pairs.append((ours, theirs, label))

    @property
    def ratios(self) -> List[Ratio]:
        """Every requested ratio whose two figures exist."""
        out = []
        for ours, theirs, label in self.ratio_pairs:
            a, b = self.figures.get(ours), self.figures.get(theirs)
            if a is None or b is None:
                continue
            out.append(Ratio(ours, theirs, label or f"{a.label} / {b.label}", round_ratios(a.values, b.values)))
        return out

    @property
    def ok(self) -> bool:
        """True when every figure of aiodat's was measured in every round (a peer's may be missing:
        a tool not installed is not aiodat failing)."""
        return all(v is not None for f in self.figures.values() if f.key.startswith("aiodat") for v in f.values)

    def ratio(self, ours: str, theirs: str) -> Optional[float]:
        """The median ratio of two figures (by key), None when not measured."""
        a, b = self.figures.get(ours), self.figures.get(theirs)
        if a is None or b is None:
            return None
        return median_of_ratios(a.values, b.values)

    def as_dict(self) -> Dict[str, Any]:
        """The report as plain data: setup, each figure's rounds and median, each ratio's rounds and median."""
        return {
            "command": self.command, **self.setup, "rounds": self.rounds,
            "figures": {f.key: {"label": f.label, "unit": f.unit, "values": f.values, "median": f.median,
                                "errors": [e for e in f.errors if e] or None}
                        for f in self.figures.values()},
            "ratios": [{"ours": r.ours, "theirs": r.theirs, "label": r.label, "values": r.values,
                        "median": r.median} for r in self.ratios],
            "notes": self.notes, "ok": self.ok,
        }

    def format(self) -> str:
        """The text table: one row per figure and per ratio, one column per round, then the median."""
        setup = ", ".join(f"{k}={v}" for k, v in self.setup.items() if v is not None)
        lines = [f"{self.command}: {setup}, {self.rounds} round(s)"]
        if self.title:
            lines.append(self.title)
        width = max([len(f"{f.label} ({f.unit})") for f in self.figures.values()] +
                    [len(r.label) for r in self.ratios] + [20]) + 2
        heads = "".join(f"{'round ' + str(i + 1):>11}" for i in range(self.rounds)) + f"{'median':>11}"
        lines.append(f"  {'figure':<{width}}{heads}")
        for f in self.figures.values():
            digits = 4 if f.unit == "Mpps" else (1 if f.unit in ("us", "MB/s") else 2)
            cells = "".join(_num(v, 11, digits) for v in f.values)
            lines.append(f"  {f.label + ' (' + f.unit + ')':<{width}}{cells}{_num(f.median, 11, digits)}")
        ratios = self.ratios
        if ratios:
            lines.append(f"  {'ratio (same round), median of rounds':<{width}}")
            for r in ratios:
                cells = "".join(_num(v, 11, 2) for v in r.values)
                lines.append(f"  {r.label:<{width}}{cells}{_num(r.median, 11, 2)}")
        missing = _missing(self.figures.values())
        lines.extend(f"  not measured: {m}" for m in missing)
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _missing(figures: Iterable[Figure]) -> List[str]:
    out: List[str] = []
    for f in figures:
        seen = []
        for err in f.errors:
            if err and err not in seen:
                seen.append(err)
        out.extend(f"{f.label}: {e}" for e in seen)
    return out
