"""Fetch the python sources of GPU vLLM releases for the contract tests:
``python tools/vllm_sources.py DEST VERSION...`` (``make vllm-sources``).

Each release's wheel is downloaded without dependencies and only ``vllm/**/*.py`` and its
``.dist-info`` are unpacked, into ``DEST/vllm-VERSION`` (about 60 MB each); a release already
there is skipped. Put that folder first on ``PYTHONPATH`` and ``import vllm`` is that
release's python, next to this machine's torch: enough to check every seam
(``vllm_dflash/serving/seams/contract.py``), not to run an engine.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

STAMP = ".complete"


def fetch(dest: Path, version: str) -> Path:
    out = dest / f"vllm-{version}"
    if (out / STAMP).is_file():
        print(f"vllm {version}: {out} (cached)", flush=True)
        return out
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
            + ["--only-binary=:all:", "--dest", tmp, f"vllm=={version}"],
            check=True,
        )
        (wheel,) = Path(tmp).glob("vllm-*.whl")
        with zipfile.ZipFile(wheel) as z:
            names = [
                n
                for n in z.namelist()
                if (n.startswith("vllm/") and n.endswith(".py")) or ".dist-info/" in n
            ]
            z.extractall(out, names)
    (out / STAMP).write_text(version)
    print(f"vllm {version}: {len(names)} files in {out} ({time.monotonic() - t0:.0f} s)")
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    dest = Path(argv[0])
    for version in argv[1:]:
        fetch(dest, version)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
