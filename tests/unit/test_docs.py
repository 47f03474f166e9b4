"""The documentation cannot drift from the code: docs/flags.md is what tools/gen_flags_doc.py writes
now, it names every flag ``python pretrain_gpt.py --help`` prints, and every relative link of
README.md and docs/*.md reaches an existing file (and heading, for a ``#anchor``)."""

from __future__ import annotations

import glob
import os
import re

from megatron_ext.arguments import build_parser  # the parser pretrain_gpt.py's --help prints
from tools.gen_flags_doc import DEFAULT_OUTPUT, REGENERATE, render_flags_doc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """Markdown without fenced code blocks and code spans (a ``[x](y)`` there is not a link)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def get_anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped (but - and _), spaces to dashes,
    a repeated heading gets -1, -2, ..."""
    anchors: set[str] = set()
    for _, title in HEADING.findall(FENCE.sub("", text)):
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").strip().lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


def find_broken_links(page: str) -> list[str]:
    """Every relative link of the Markdown file ``page`` whose file or anchor does not exist."""
    with open(page, encoding="utf-8") as fh:
        text = fh.read()
    broken = []
    for target in LINK.findall(_prose(text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(resolved):
            broken.append(f"{target} (no file {os.path.relpath(resolved, ROOT)})")
        elif anchor and resolved.endswith(".md"):
            with open(resolved, encoding="utf-8") as fh:
                if anchor not in get_anchors(fh.read()):
                    broken.append(f"{target} (no heading #{anchor} in {os.path.relpath(resolved, ROOT)})")
    return broken


def test_flags_reference_is_what_the_script_writes():
    with open(DEFAULT_OUTPUT, encoding="utf-8") as fh:
        committed = fh.read()
    assert committed == render_flags_doc(), f"docs/flags.md is stale: regenerate it with `{REGENERATE}`"


def test_flags_reference_names_every_flag_of_help():
    with open(DEFAULT_OUTPUT, encoding="utf-8") as fh:
        reference = fh.read()
    flags = set()
    for line in build_parser().format_help().splitlines():
        if line.startswith("  -"):  # an option's invocation: "  -h, --help", "  --device {auto,cpu,cuda}"
            invocation = re.split(r"\s{2,}", line.strip())[0]
            flags.update(re.findall(r"(?:^|, )(--?[a-z][\w-]*)", invocation))
    assert len(flags) > 150  # the parse above found the flags, not nothing
    missing = sorted(f for f in flags if f"`{f}`" not in reference)
    assert not missing, f"flags in --help but not in docs/flags.md: {missing}; regenerate it with `{REGENERATE}`"


def test_every_relative_link_resolves():
    assert len(PAGES) > 5
    broken = {os.path.relpath(p, ROOT): b for p in PAGES if (b := find_broken_links(p))}
    assert not broken, f"broken links: {broken}"


def test_link_check_finds_missing_files_and_anchors(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Run `it` (twice)\n\n## Run it twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n[ok](other.md) [ok](other.md#run-it-twice) [ok](other.md#run-it-twice-1) "
        "[ok](#page) ![ok](other.md) [web](https://example.com/x.md)\n"
        "`[code](nowhere.md)`\n```\n[code](nowhere.md)\n```\n"
        "[bad](missing.md) [bad](other.md#nope) [bad](#nope)\n"
    )
    broken = find_broken_links(str(page))
    assert [b.split()[0] for b in broken] == ["missing.md", "other.md#nope", "#nope"], broken
