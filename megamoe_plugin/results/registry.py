"""The results pages' building blocks: one ``Section`` per benchmark, built from shipped raw data.

A section builder is registered with ``@section(key)``; it gets a ``Data`` (the data folder and the run index,
``docs/data/runs.json``) and returns the section's markdown and its headline rows. Builders only read files under
``docs/data``: every number a results page shows comes from there.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional


@dataclass
class Headline:
    """One row of the headline table: what was measured, against which target, met or not."""
    benchmark: str
    result: str
    target: str
    met: Optional[bool]  # None: no target was set for this benchmark
    anchor: str = ""


@dataclass
class Section:
    key: str
    title: str
    body: str
    headlines: List[Headline] = field(default_factory=list)
    runs: List[str] = field(default_factory=list)  # ids in runs.json


class Data:
    """The shipped raw data (``root``/docs/data) and its run index."""

    def __init__(self, root: str):
        self.root = root
        self.folder = os.path.join(root, "docs", "data")
        with open(os.path.join(self.folder, "runs.json")) as f:
            index = json.load(f)
        self.testbeds: Dict[str, str] = index["testbeds"]
        self.runs: Dict[str, dict] = {r["id"]: r for r in index["runs"]}
        self.files: Dict[str, dict] = index.get("files", {})

    def path(self, run_id: str, key: str = "path") -> str:
        return os.path.join(self.folder, self.runs[run_id][key])

    def json(self, run_id: str, key: str = "path"):
        with open(self.path(run_id, key)) as f:
            return json.load(f)

    def text(self, run_id: str, key: str = "path") -> str:
        with open(self.path(run_id, key)) as f:
            return f.read()

    def commit(self, run_id: str) -> str:
        """The commit that shipped the run, and the code's commit when that was an earlier one."""
        r = self.runs[run_id]
        return f"`{r['commit']}`" + (f" (code of `{r['code']}`)" if r.get("code") else "")

    def provenance(self, run_id: str) -> str:
        """'**Measured on <testbed>**, <date>, commit <c> ([raw data](...))' for a run of the index."""
        r = self.runs[run_id]
        note = f". {r['note']}" if r.get("note") else ""
        return f"**{r['how']}**, {r['date']}, commit {self.commit(run_id)} ([raw data](docs/data/{r['path']})){note}"

    def gpu_name(self) -> str:
        """The GPU of the layer benchmark's GPU run (its ``gpu`` field), as the pages name it."""
        return self.runs["layer-gpu"].get("gpu", "GPU")

    def command(self, run_id: str) -> str:
        return f"```bash\n{self.runs[run_id]['command']}\n```"


SECTIONS: Dict[str, Callable[[Data], Section]] = {}


def section(key: str):
    def register(fn: Callable[[Data], Section]):
        SECTIONS[key] = fn
        return fn
    return register


def met_text(met: Optional[bool]) -> str:
    return {True: "**met**", False: "**missed**", None: "no target"}[met]
