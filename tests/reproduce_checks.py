"""Checks shared by the `megamoe reproduce` tests: run a paper's fast mode once, read its tables back, and check
what must hold for any table and figure (a valid source label on every row, the paper's numbers present, PNGs)."""
import os
import re

SOURCE = re.compile(r"^(paper|measured here \((CPU|GPU .+)\)|predicted \(.+ cost model\)|"
                    r"measured, emulated cluster: .+ nodes? .+, inter-node \d+ MB/s.*|not run here: .+|computed from trace \(.+\))$")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LAUNCHER_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def run_fast(module, out_dir: str):
    """``module.run(out_dir, fast=True)`` as a single process (launcher variables hidden); (result, printed text)."""
    saved = {k: os.environ.pop(k) for k in LAUNCHER_ENV if k in os.environ}
    printed = []
    try:
        res = module.run(out_dir, fast=True, log=printed.append)
    finally:
        os.environ.update(saved)
    return res, "\n".join(printed)


def read_table(res: dict, out_dir: str, name: str):
    """The rows of table `name`, which the run must have reported writing."""
    from megamoe_plugin.reproduce.common import parse_markdown_table
    path = os.path.join(out_dir, f"{name}.md")
    assert path in res["tables"], (path, res["tables"])
    with open(path) as f:
        return parse_markdown_table(f.read())


def check_tables_and_figures(res: dict, printed=None, measured_in_every_table: bool = True, fast: bool = True) -> None:
    """Every table printed (when `printed` is given), every row labelled, the paper's numbers beside ours; every figure a real PNG."""
    import matplotlib.image as mpimg
    from megamoe_plugin.reproduce.common import parse_markdown_table
    for p in res["tables"]:
        with open(p) as f:
            text = f.read()
        assert printed is None or text.splitlines()[0] in printed, p
        assert ("- fast mode: small sizes, not comparable to the paper" in text) == fast, p
        rows = parse_markdown_table(text)
        assert rows, p
        for r in rows:
            assert SOURCE.match(r["source"]), (p, r)
        assert any(r["source"] == "paper" for r in rows), p
        if measured_in_every_table:
            assert any(r["source"].startswith(("measured here", "computed from trace")) for r in rows), p
    for p in res["figures"]:
        with open(p, "rb") as f:
            assert f.read(8) == PNG_MAGIC, p
        img = mpimg.imread(p)
        assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 200, p
