"""File names read from index files, kept inside the directory that holds the index.

A ``*.index.json`` names its shards. A crafted or broken one could name ``../x`` or an
absolute path and make us read (or memory-map) a file outside the checkpoint. The check
is on the name as written, not on where it resolves: the Hugging Face cache keeps every
file of a snapshot as a symlink into its blob store, outside the snapshot directory.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath, PureWindowsPath


def file_inside(root: Path, name: object, entry: str, error: type[Exception]) -> Path:
    """``root / name`` where ``name`` is a relative path that stays inside ``root``;
    otherwise ``error`` naming ``entry``, the index entry that gave the name."""
    if not isinstance(name, str) or not name.strip():
        raise error(f"{entry} = {name!r}: not a file name. Fix: re-export the files")
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if (
        PurePosixPath(name).is_absolute()
        or PureWindowsPath(name).is_absolute()
        or PureWindowsPath(name).drive
        or ".." in parts
    ):
        raise error(
            f"{entry} = {name!r}: refused, the name leads outside {root}. Fix: index files "
            "name their shards relative to their own directory; re-export the files"
        )
    return root / name
