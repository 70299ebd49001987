"""Put the command-line tools the tests use into a project folder, without root:
``python tools/local_tools.py DEST`` (``make test`` runs it with DEST = .tools).

The metrics tests run a real Prometheus server and promtool; the deployment tests render the
Kubernetes overlays with ``kubectl kustomize``. A tool already on PATH is used as it is.
Otherwise its Debian package is downloaded from deb.debian.org over HTTPS, checked against the
SHA256 that the suite's package index gives for it, and unpacked (not installed: no root, no
dpkg database) so that only its binaries land in DEST/bin, which the Makefile puts first on
PATH. Standard library only, so it runs before any virtual environment exists.
"""

from __future__ import annotations

import hashlib
import io
import lzma
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

MIRROR = "https://deb.debian.org/debian"


@dataclass(frozen=True)
class DebianTool:
    package: str
    # Debian 12's prometheus matches what `apt-get install prometheus` gives on Debian 12.
    # kubectl comes from Debian 13: Debian 12's kubectl 1.20 embeds kustomize 2, too old for
    # deploy/k8s. Both are Go programs without C dependencies, so either runs on either.
    suite: str
    binaries: tuple[str, ...]  # paths inside the package, e.g. "usr/bin/promtool"


TOOLS = (
    DebianTool("prometheus", "bookworm", ("usr/bin/prometheus", "usr/bin/promtool")),
    DebianTool("kubectl", "trixie", ("usr/bin/kubectl",)),
)


@dataclass(frozen=True)
class IndexEntry:
    filename: str  # path below the mirror, e.g. pool/main/p/prometheus/prometheus_..._amd64.deb
    sha256: str
    size: int


def debian_arch() -> str:
    machine = platform.machine().lower()
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(machine)
    if arch is None:
        raise SystemExit(f"local_tools: no Debian packages for machine {machine!r}")
    return arch


def parse_index(text: str, package: str) -> IndexEntry:
    """The entry for ``package`` in a Debian ``Packages`` index (RFC 822-style stanzas)."""
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line and not line[0].isspace() and ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if fields.get("Package") == package:
            return IndexEntry(fields["Filename"], fields["SHA256"], int(fields["Size"]))
    raise SystemExit(f"local_tools: package {package!r} is not in the index")


def debian_data_member(deb: bytes, wanted: tuple[str, ...]) -> dict[str, bytes]:
    """The files ``wanted`` (paths without a leading ./) from a .deb's data archive.

    A .deb is an ar archive of debian-binary, control.tar.* and data.tar.*; the ar format is a
    global magic line, then per member a 60-byte header and the data padded to an even size.
    """
    if not deb.startswith(b"!<arch>\n"):
        raise SystemExit("local_tools: not a Debian package (no ar magic)")
    pos = 8
    while pos + 60 <= len(deb):
        header = deb[pos : pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        body = deb[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)
        if not name.startswith("data.tar"):
            continue
        if name.endswith(".zst"):
            raise SystemExit("local_tools: data.tar.zst needs zstd, which Python 3.11 lacks")
        out: dict[str, bytes] = {}
        with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as tar:
            for member in tar.getmembers():
                path = member.name.removeprefix("./")
                if path in wanted and member.isfile():
                    out[path] = tar.extractfile(member).read()  # type: ignore[union-attr]
        missing = sorted(set(wanted) - set(out))
        if missing:
            raise SystemExit(f"local_tools: the package lacks {', '.join(missing)}")
        return out
    raise SystemExit("local_tools: the package has no data.tar member")


def fetch(url: str, what: str, size: int | None = None) -> bytes:
    chunks: list[bytes] = []
    done = 0
    with urllib.request.urlopen(url, timeout=60) as response:
        while chunk := response.read(1 << 20):
            chunks.append(chunk)
            done += len(chunk)
            if size:
                print(
                    f"\r  {what}: {done / 2**20:.1f} / {size / 2**20:.1f} MiB", end="", flush=True
                )
    if size:
        print(flush=True)
    return b"".join(chunks)


def install(tool: DebianTool, bin_dir: Path, arch: str) -> None:
    index_url = f"{MIRROR}/dists/{tool.suite}/main/binary-{arch}/Packages.xz"
    print(f"local_tools: {tool.package} from Debian {tool.suite} ({index_url})", flush=True)
    index = lzma.decompress(fetch(index_url, "index")).decode()
    entry = parse_index(index, tool.package)
    deb = fetch(f"{MIRROR}/{entry.filename}", Path(entry.filename).name, entry.size)
    digest = hashlib.sha256(deb).hexdigest()
    if digest != entry.sha256:
        raise SystemExit(
            f"local_tools: {entry.filename} has SHA256 {digest}, the index says {entry.sha256}"
        )
    for path, data in debian_data_member(deb, tool.binaries).items():
        target = bin_dir / Path(path).name
        target.write_bytes(data)
        target.chmod(0o755)
        version = subprocess.run(
            [str(target), "--version"]
            if target.name != "kubectl"
            else [str(target), "version", "--client"],
            capture_output=True,
            text=True,
        )
        first_line = (version.stdout or version.stderr).strip().splitlines()[:1]
        print(f"  {target}: {first_line[0] if first_line else 'installed'}", flush=True)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    bin_dir = Path(argv[0]).resolve() / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    # DEST/bin itself is on PATH under make; a tool counts as present only outside it.
    path = os.pathsep.join(
        p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p).resolve() != bin_dir
    )
    arch = None
    for tool in TOOLS:
        names = [Path(b).name for b in tool.binaries]
        if all(shutil.which(n, path=path) or (bin_dir / n).is_file() for n in names):
            print(f"local_tools: {', '.join(names)}: present", flush=True)
            continue
        install(tool, bin_dir, arch := arch or debian_arch())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
