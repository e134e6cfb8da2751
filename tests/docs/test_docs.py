"""Every code block of the docs (docs/*.md and README.md) runs here.

A page is one session: its Python blocks run in order in one namespace, in a scratch
directory that sees the repository's examples/, benchmarks/ and scripts/. A JSON block
is a strategy file: it must load, and when the Python before it defined `directives`,
equal that list. A shell block's commands run when they are quick (`piper explain`,
`simulate`, `search`); commands that train for minutes or start processes (the main job,
the launcher, benchmarks, SLURM) have their arguments checked by the script's own
parser instead: the main job, the launcher and the benchmarks have tests of their own.
`text` blocks are output listings and run nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest
from piper_jax.directives import check_directives
from piper_jax.directives.json_format import directive_from_dict, directive_to_dict

import piper_jax as piper
from piper_jax import cli, launch

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LINKED = ("examples", "benchmarks", "scripts", "docs")


def blocks(page: Path) -> list[tuple[str, str, int]]:
    """(language, code, line number) of each fenced block of `page`."""
    text = page.read_text()
    found = FENCE.finditer(text)
    return [(m.group(1), m.group(2), text[: m.start()].count("\n") + 1) for m in found]


@pytest.fixture
def session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """A scratch directory laid out like the repository root, and a fresh namespace."""
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    return {"__name__": "__docs__"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_code_block_of_the_page_runs(page: Path, session: dict) -> None:
    found = blocks(page)
    for lang, code, line in found:
        where = f"{page.relative_to(ROOT)}:{line}"
        if lang == "python":
            exec(compile(code, where, "exec"), session)
        elif lang == "json":
            check_strategy(code, session, where)
        elif lang == "bash":
            for argv in commands(code):
                check_command(argv, where)
        else:
            assert lang == "text", f"{where}: a ```{lang} block; use python, json, bash or text"


def check_strategy(code: str, session: dict, where: str) -> None:
    data = json.loads(code)
    if isinstance(data, dict) and "op" in data:
        loaded = [directive_from_dict(data, 0)]
    else:
        Path("strategy.json").write_text(code)
        loaded = piper.load_directives("strategy.json")
    if "directives" in session:
        want = [directive_to_dict(d) for d in check_directives(session.pop("directives"))]
        assert [directive_to_dict(d) for d in loaded] == want, f"{where}: JSON != Python"


def commands(code: str) -> list[list[str]]:
    """The command lines of a shell block (continuations joined, comments dropped)."""
    text = code.replace("\\\n", " ")
    return [argv for line in text.splitlines() if (argv := shlex.split(line, comments=True))]


def check_command(argv: list[str], where: str) -> None:
    while re.match(r"^[A-Z_]+=", argv[0]):  # environment settings before the command
        argv = argv[1:]
    program, args = os.path.basename(argv[0]), argv[1:]
    if program == "srun":
        return check_command(args, where)
    if program == "piper" and args[:1] != ["launch"]:
        with contextlib.redirect_stdout(sys.stderr):
            assert cli.main(args) == 0, f"{where}: {shlex.join(argv)} failed"
        return
    if program in ("piper", "piper-launch"):
        parsed = launch._parser().parse_args(args[1:] if program == "piper" else args)
        return check_command(["python", parsed.script, *parsed.script_args], where)
    if program == "bash" and args[0] in ("scripts/train.sh", "scripts/test.sh"):
        script = "examples/train.py" if args[0].endswith("train.sh") else None
        assert Path(args[0]).is_file(), where
        return check_command(["python", script, *args[1:]], where) if script else None
    assert program.startswith("python"), f"{where}: no rule for {shlex.join(argv)}"
    script, flags = args[0], args[1:]
    assert Path(script).is_file(), f"{where}: no script {script}"
    if script == "examples/train.py":
        import train

        try:
            with contextlib.redirect_stdout(sys.stderr):
                train.parse_args(flags)
        except SystemExit as stop:  # --help
            assert stop.code == 0, f"{where}: {shlex.join(argv)} does not parse"
        return
    text = Path(script).read_text()
    for flag in flags:
        if flag.startswith("--"):
            assert f'"{flag.split("=")[0]}"' in text, f"{where}: {script} has no {flag}"


def test_a_json_block_that_drifts_from_its_python_fails(session: dict) -> None:
    """The harness itself: JSON must equal the Python list before it, field for field."""
    session["directives"] = [piper.split({"PP": "*"}, num_microbatches=2)]
    with pytest.raises(AssertionError, match="JSON != Python"):
        four = '[{"op": "split", "filter": {"PP": "*"}, "num_microbatches": 4}]'
        check_strategy(four, session, "x")
    with pytest.raises(piper.DirectiveError, match="unknown op 'splitt'"):
        check_strategy('[{"op": "splitt"}]', {}, "x")


def test_shell_blocks_split_into_commands() -> None:
    code = "# a comment\npiper explain s.json \\\n  --model m.py:f  # why\n\nbash scripts/test.sh\n"
    assert commands(code) == [
        ["piper", "explain", "s.json", "--model", "m.py:f"],
        ["bash", "scripts/test.sh"],
    ]
    with pytest.raises(AssertionError, match="no rule for"):
        check_command(["make", "all"], "x")
