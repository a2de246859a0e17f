"""The README's and docs' training commands, read from their shell blocks; their exit codes, read from their tables."""

import re
import shlex

from conftest import REPO

from mingpt.config.compose import compose
from mingpt.runtime.exits import Exit


def _readme_runs() -> list[list[str]]:
    """The training commands of the shell blocks of the README and docs/ (each once), as argument lists."""
    text = "".join(p.read_text() for p in [REPO / "README.md", *sorted(REPO.glob("docs/*.md"))])
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0]
            if re.search(r"mingpt/main\.py|-m mingpt\.main", line) and shlex.split(line) not in cmds:
                cmds.append(shlex.split(line))
    return cmds


def test_readme_training_examples_each_have_a_run_directory_of_their_own():
    """Run in any order, the examples never resume (or refuse) each other's snapshots."""
    dirs = []
    for args in _readme_runs():
        run_dir = next((a.split("=", 1)[1] for a in args if a.startswith("trainer.run_dir=")), None)
        options = [a for a in args if re.match(r"^(trainer|experiment)=", a)]  # options may set trainer.run_dir
        if run_dir is None:
            run_dir = compose(options).trainer.run_dir
        snap = next((a.split("=", 1)[1] for a in args if a.startswith("snapshot.dir=")), f"{run_dir}/snapshots")
        # the groups of one replica job (and a group's spare) are one run: the same peers
        job = next((a for a in args if a.startswith("replicas.peers=")), " ".join(args))
        dirs.append((run_dir, snap, job))
    assert len(dirs) >= 4
    for field in (0, 1):
        seen = {}
        for d in dirs:
            assert seen.get(d[field], d[2]) == d[2], f"{d[2]!r} shares {d[field]} with {seen[d[field]]!r}"
            seen[d[field]] = d[2]


def test_the_two_machine_recipes_make_a_secret_per_job():
    """A reused secret made two jobs one rendezvous and one launch (the store's lease let the second in)."""
    for page in ("README.md", "docs/multi-node.md", "docs/replicas.md"):
        text = (REPO / page).read_text()
        lines = [line for line in text.splitlines() if line.startswith("mingpt-torchrun --new-secret ~/")]
        assert lines and not any("once" in line for line in lines), (page, lines)
        assert "each job" in text and "secrets.token_hex" not in text, page  # the tool's random secret, no one-liner


def _anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lowercase, punctuation dropped, spaces to '-', repeats numbered."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), re.M):
        anchor = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[anchor] = seen.get(anchor, -1) + 1
        if seen[anchor]:
            seen[f"{anchor}-{seen[anchor]}"] = 0
    return set(seen)


def test_every_link_to_a_section_of_the_docs_finds_its_heading():
    """A figure's link into docs/results.md (or any page's section) that a renamed heading left dangling fails here."""
    broken = []
    for page in [REPO / "README.md", *sorted(REPO.glob("*/README.md")), *sorted(REPO.glob("docs/*.md"))]:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target, anchor in re.findall(r"\]\(([^)\s#]*\.md|)#([^)\s]+)\)", text):
            linked = (page.parent / target) if target else page
            if not linked.exists() or anchor not in _anchors(linked.read_text()):
                broken.append(f"{page.relative_to(REPO)}: {target}#{anchor}")
    assert not broken, broken


def _exit_code_tables() -> dict[str, set[int]]:
    """The codes of every `| code | meaning |` table in the README and docs/, by page."""
    tables = {}
    for page in [REPO / "README.md", *sorted(REPO.glob("docs/*.md"))]:
        for rows in re.findall(r"^\| code \| meaning \|\n\|[- |]+\|\n((?:\|.*\n)+)", page.read_text(), re.M):
            tables[page.name] = {int(row.split("|")[1]) for row in rows.splitlines()}
    return tables


def test_the_exit_code_tables_name_exactly_the_codes_a_job_exits_with():
    """A code added to mingpt/runtime/exits.py and not to the README's table (or the other way round) fails."""
    assert len(Exit.__members__) == len(Exit), "two of Exit's codes are the same number"
    assert all(code.meaning and "\n" not in code.meaning for code in Exit)
    tables = _exit_code_tables()
    assert "README.md" in tables, "the README's exit-code table (| code | meaning |) is gone"
    for page, codes in tables.items():
        lacks, extra = sorted(map(int, set(Exit) - codes)), sorted(codes - set(Exit))
        assert codes == set(Exit), f"{page}: its table lacks {lacks}, mingpt.runtime.exits.Exit lacks {extra}"
