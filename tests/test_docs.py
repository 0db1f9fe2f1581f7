"""The README a newcomer reads: short, its test command is exactly CI's, every relative link in it and in docs/
points at a file that exists, and every `megamoe` subcommand describes itself with -h."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts):
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def test_readme_is_short_and_its_test_command_is_ci():
    readme = _read("README.md")
    assert len(readme.encode()) <= 12 * 1024
    commands = re.findall(r"```bash\n(.+?)\n```", readme)
    assert len(commands) >= 2
    ci = [line for line in _read(".ci", "run").splitlines() if line.startswith("pip install")]
    assert ci == [commands[1]]
    assert "torch==2.13.0" in commands[0] and "pretrain_moe_gpt.py" in commands[0]


def test_relative_links_resolve():
    pages = ["README.md", "BENCHMARKS.md", "CHANGELOG.md", os.path.join("docs", "data", "README.md")]
    for folder in ("docs", os.path.join("docs", "history")):
        pages += [os.path.join(folder, f) for f in os.listdir(os.path.join(ROOT, folder)) if f.endswith(".md")]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", _read(page)):
            if re.match(r"(https?:|#|mailto:)", target):
                continue
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target.split("#")[0]))
            if not os.path.exists(path):
                broken.append(f"{page}: {target}")
    assert not broken, broken


@pytest.mark.parametrize("command", ["train", "bench", "options", "topology", "perf", "trace", "cache-sim",
                                     "balance", "cluster", "reproduce", "fairseq-user-dir"])
def test_every_subcommand_describes_itself(command, capsys):
    from megamoe_plugin.cli import main
    try:
        main([command, "-h"])
    except SystemExit as e:
        assert e.code in (0, None)
    out = capsys.readouterr().out
    assert "usage:" in out and len(out.splitlines()) >= 3, out


FLAG = re.compile(r"--moe-(?:plugin-)?[a-z0-9-]+")
# "`--flag` (default X)", "default `X`", ", default X", "`--flag` (X)" in a sentence naming exactly one option
DEFAULT = re.compile(r"\bdefault(?:s| is| =|:)?\s+(?:the\s+)?`([^`]+)`|\(default:?\s+`?([A-Za-z0-9_.+-]+)`?[,)]|"
                     r",\s+default\s+`?([A-Za-z0-9_.+-]+)`?|`--moe-[a-z0-9-]+` \(`?([0-9][0-9.e+-]*|[a-z_]+)`?\)")


def _same(documented: str, default) -> bool:
    if isinstance(default, bool):               # a switch is documented as on / off
        return documented.strip().lower() in (("on", "true") if default else ("off", "false"))
    try:
        return float(documented) == float(default)
    except (TypeError, ValueError):
        return documented.strip() == str(default)


def test_documented_defaults_match_the_code():
    """Every default the docs state next to exactly one option flag is the option's default in MoEConfig (what
    `megamoe options` prints); a stale one (a profile that is no longer the default, say) fails here."""
    from megamoe_plugin.config import iter_options
    options = {o["flag"]: o for o in iter_options()}
    pages = ["README.md", "patches/README.md"] + [os.path.join("docs", f) for f in
                                                  sorted(os.listdir(os.path.join(ROOT, "docs"))) if f.endswith(".md")]
    checked, wrong = [], []
    for page in pages:
        for sentence in re.split(r"(?<=[.;])\s+", _read(page).replace("\n", " ")):
            flags = {f.replace("--moe-plugin-", "--moe-") for f in FLAG.findall(sentence)} & set(options)
            if len(flags) != 1:
                continue
            (name,) = flags
            for m in DEFAULT.finditer(sentence):
                value = next(g for g in m.groups() if g)
                checked.append((page, name, value))
                if not _same(value, options[name]["default"]):
                    wrong.append(f"{page}: {name} documented default {value!r}, code default "
                                 f"{options[name]['default']!r}: {sentence[:160]}")
    assert len(checked) >= 3, checked          # the checker must see the docs' defaults, not pass on nothing
    assert not wrong, "\n".join(wrong)
