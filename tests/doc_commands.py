"""The commands a page of the docs gives, read from the page itself: the fenced ```sh blocks under one
heading, split into commands (continuation lines joined, a here-document's body kept with its command).

tests/helm checks them offline, tests/node runs them verbatim on a real node; neither copies them.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "README.md"
OPERATIONS = REPO_ROOT / "docs" / "operations.md"

_FENCE = re.compile(r"^```sh\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_HEREDOC = re.compile(r"<<-?\s*'?(\w+)'?")


@dataclass(frozen=True)
class Command:
    """One shell command as the page writes it, and the here-document it reads (``""``: none)."""

    line: str
    stdin: str = ""

    @property
    def argv(self) -> list[str]:
        """The words of the command, without its comment and its here-document redirection."""
        return shlex.split(_HEREDOC.sub("", self.line), comments=True)

    @property
    def script(self) -> str:
        """The command as a shell reads it from the page, here-document included."""
        end = _heredoc_end(self.line)
        return f"{self.line}\n{self.stdin}{end}\n" if end else f"{self.line}\n"


def _heredoc_end(line: str) -> str:
    found = _HEREDOC.search(line)
    return found.group(1) if found else ""


def section(page: Path, heading: str) -> str:
    """The text under ``heading`` (a ``## `` line, matched by its start) up to the next heading of its level."""
    text = page.read_text()
    start = re.search(rf"^## {re.escape(heading)}.*$", text, re.MULTILINE)
    assert start, f"{page.name} has no heading starting '## {heading}'"
    rest = text[start.end():]
    end = re.search(r"^## ", rest, re.MULTILINE)
    return rest[:end.start()] if end else rest


def sh_blocks(page: Path, heading: str) -> list[str]:
    """The fenced ```sh blocks under ``heading``, in order."""
    blocks = _FENCE.findall(section(page, heading))
    assert blocks, f"{page.name}, '{heading}': no ```sh block"
    return blocks


def commands(block: str) -> list[Command]:
    """The commands of one block: comment-only and empty lines left out, ``\\`` continuations joined."""
    lines = block.splitlines()
    found: list[Command] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.rstrip().endswith("\\") and i < len(lines):
            line = line.rstrip()[:-1].rstrip() + " " + lines[i].strip()
            i += 1
        end = _heredoc_end(line)
        if not end:
            found.append(Command(line.strip()))
            continue
        body = []
        while i < len(lines) and lines[i] != end:
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"here-document of '{line}' has no closing {end}"
        i += 1
        found.append(Command(line.strip(), "".join(f"{b}\n" for b in body)))
    return found


def page_commands(page: Path, heading: str) -> list[Command]:
    """Every command of every ```sh block under ``heading``."""
    return [c for block in sh_blocks(page, heading) for c in commands(block)]
