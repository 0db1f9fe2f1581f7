"""How every benchmark prints its report: the parts (header, table, summary) to stdout and, optionally, a file."""
from __future__ import annotations


def emit_report(parts, output=None, separators=None):
    """Print a benchmark report's parts (header, table, summary) and, with `output`, write them to that file
    separated by blank lines."""
    seps = separators or ["\n\n"] * (len(parts) - 1)
    print("".join(p + sep for p, sep in zip(parts, seps + [""])), flush=True)
    if output:
        with open(output, "w") as f:
            f.write("\n\n".join(parts) + "\n")
