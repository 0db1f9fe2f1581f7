"""Reading the markdown tables the benchmarks write, and writing the results pages' tables.

The layer benchmarks (`megamoe bench layer`, `bench megatron`, the GPU runs) ship their raw output as markdown;
``read_tables`` turns every pipe table of such a file into a list of row dicts keyed by the header cells.
"""
from __future__ import annotations

import re
from typing import Dict, Iterable, List, Optional, Sequence

from ..reproduce.common import parse_markdown_table


def read_tables(text: str) -> List[List[Dict[str, str]]]:
    """Every pipe table in ``text``, each a list of {header cell: row cell} (``parse_markdown_table`` per table)."""
    blocks, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            blocks.append("\n".join(current))
            current = []
    return [parse_markdown_table(block) for block in blocks]


def number(cell: str) -> Optional[float]:
    """The first number in a table cell ('1,234.5 ms' -> 1234.5), None for '-' or text."""
    found = re.search(r"-?\d[\d,]*\.?\d*(?:e[-+]?\d+)?", cell or "")
    return float(found.group().replace(",", "")) if found else None


def ratio(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}x"


def span(values: Iterable[Optional[float]], digits: int = 2, unit: str = "x") -> str:
    """'a-b' over the values that exist (one value: 'a'), formatted with ``unit``."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return "-"
    lo, hi = f"{vals[0]:.{digits}f}", f"{vals[-1]:.{digits}f}"
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def percent(value: Optional[float], digits: int = 1, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value * 100:+.{digits}f}%" if signed else f"{value * 100:.{digits}f}%"


def table(header: Sequence[str], rows: Iterable[Sequence[object]], align: Optional[str] = None) -> str:
    """A markdown table; ``align`` one character a column ('l' or 'r')."""
    align = align or "l" * len(header)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
