"""What every `megamoe reproduce <paper>` command shares: result tables that say how each number was obtained,
where they are written, and the routing traces shipped with the package.

A reproduction writes, into its output folder, one markdown file per table (``<name>.md``) and one PNG per figure
(``<name>.png``), and prints the tables. Every row of a table carries a ``source`` column with one of:

* ``measured here (CPU)`` / ``measured here (GPU <name>)``: timed or counted in this run on this machine;
* ``predicted (<profile> cost model)``: the calibrated performance model (``perfmodel``) for a named hardware
  profile (``johnny``, ``trevor``, ``flexmoe-a100``, or a calibrated JSON);
* ``measured, emulated cluster: <nodes>, inter-node <X> MB/s[, intra-node <Y> MB/s]``: measured on `megamoe cluster`
  (network namespaces, tbf-shaped links) by `megamoe bench gates`, read from its results folder;
* ``not run here: <what it needs>``: a row that could not be produced in this run, saying why;
* ``paper``: the paper's own number, copied for comparison (never computed here).

``parse_markdown_table`` reads a written table back (the tests check invariants on the parsed rows).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from ..launch import run_processes

__all__ = ["Table", "measured", "predicted", "PAPER", "parse_markdown_table", "traces_dir", "shipped_trace",
           "save_figure", "fork_processes"]

PAPER = "paper"


def measured() -> str:
    """The source label of a number measured in this run on this machine."""
    if torch.cuda.is_available():
        return f"measured here (GPU {torch.cuda.get_device_name(0)})"
    return "measured here (CPU)"


def predicted(profile: str) -> str:
    return f"predicted ({profile} cost model)"


def from_trace(trace: str) -> str:
    """The label of a number computed by replaying a routing trace (deterministic: the same on any machine)."""
    return f"computed from trace ({trace})"


FAST_NOTE = "fast mode: small sizes, not comparable to the paper (run without --fast for the full sizes)"


@dataclass
class Table:
    """A result table: ``columns`` (the first is usually what the row is, the last ``source``), ``rows`` (lists of
    cells: numbers are formatted with ``fmt``), ``notes`` printed under it."""
    name: str
    title: str
    columns: List[str]
    rows: List[list] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    fmt: str = "{:.4g}"

    def add(self, *cells) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"table {self.name}: row of {len(cells)} cells, {len(self.columns)} columns")
        self.rows.append(list(cells))

    def _cell(self, v) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return self.fmt.format(v)
        return str(v)

    def to_markdown(self) -> str:
        lines = [f"### {self.title}", "", "| " + " | ".join(self.columns) + " |",
                 "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(self._cell(c) for c in row) + " |" for row in self.rows]
        if self.notes:
            lines.append("")
            lines += [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def write(self, out_dir: str) -> str:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"{self.name}.md")
        with open(path, "w") as f:
            f.write(self.to_markdown())
        return path


def interp(points, x: float) -> Optional[float]:
    """Piecewise-linear y(x) through ``points`` [(x, y)] (sorted here), None outside their x range."""
    pts = sorted(points)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def parse_markdown_table(text: str) -> List[Dict[str, str]]:
    """The rows of the first markdown table in `text` as {column: cell text}."""
    lines = [l.strip() for l in text.splitlines() if l.strip().startswith("|")]
    if len(lines) < 2:
        raise ValueError("no markdown table found")
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = []
    for l in lines[2:]:
        cells = [c.strip() for c in l.strip("|").split("|")]
        if len(cells) != len(head):
            raise ValueError(f"row {l!r}: {len(cells)} cells, header has {len(head)}")
        rows.append(dict(zip(head, cells)))
    return rows


def traces_dir() -> str:
    """The routing traces shipped with the package (made by examples/reproduce/make_traces.sh)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "traces")


def shipped_trace(name: str) -> str:
    """Path prefix of a shipped trace (``load_trace`` reads ``<prefix>.rank<r>``); a clear error if missing."""
    prefix = os.path.join(traces_dir(), name)
    if not os.path.exists(prefix + ".rank0"):
        have = sorted({f.rsplit(".rank", 1)[0] for f in os.listdir(traces_dir()) if ".rank" in f}) \
            if os.path.isdir(traces_dir()) else []
        raise FileNotFoundError(f"no shipped trace {name!r} in {traces_dir()} (have: {have}); regenerate them with "
                                "examples/reproduce/make_traces.sh")
    return prefix


def save_figure(fig, out_dir: str, name: str) -> str:
    """Write a matplotlib figure as ``<out_dir>/<name>.png`` and close it."""
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def mark_fast(tables: Sequence[Table], fast: bool) -> Sequence[Table]:
    """In fast mode every table says first that its sizes are small and not comparable to the paper."""
    for t in tables:
        if fast and FAST_NOTE not in t.notes:
            t.notes.insert(0, FAST_NOTE)
    return tables


def print_tables(tables: Sequence[Table], figures: Sequence[str] = (), log=print, fast: bool = False) -> None:
    """Print the tables (in fast mode each says so first) and the figures' paths."""
    for t in mark_fast(tables, fast):
        log(t.to_markdown())
    for f in figures:
        log(f"figure: {f}")


def header(paper: str, fast: bool, extra: Optional[str] = None) -> str:
    mode = "fast mode (small sizes: the CI test)" if fast else "full mode"
    return f"## megamoe reproduce {paper} -- {mode}" + (f"; {extra}" if extra else "")


def fork_processes(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, *args)`` in `world` gloo processes of this machine (launch.run_processes: one
    intra-op thread each, WORLD_SIZE/RANK set so that ``megamoe train`` inside uses them), saying on stderr when
    the phase starts and ends."""
    run_processes(fn, world, *args, label=f"reproduce: {getattr(fn, '__name__', 'workers').strip('_')}")
