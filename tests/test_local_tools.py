"""tools/local_tools.py, which `make test` runs to put Prometheus and kubectl into .tools/:
its Debian index parser and its .deb unpacker, on packages built here (no network)."""

from __future__ import annotations

import importlib.util
import io
import sys
import tarfile
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "local_tools", Path(__file__).resolve().parents[1] / "tools" / "local_tools.py"
)
local_tools = importlib.util.module_from_spec(_spec)
sys.modules["local_tools"] = local_tools  # its dataclasses look their module up there
_spec.loader.exec_module(local_tools)


def _ar(members: list[tuple[str, bytes]]) -> bytes:
    out = bytearray(b"!<arch>\n")
    for name, data in members:
        header = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{644:<8}{len(data):<10}`\n"
        assert len(header) == 60
        out += header.encode() + data + (b"\n" if len(data) % 2 else b"")
    return bytes(out)


def _tar_xz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for path, data in files.items():
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _deb(files: dict[str, bytes], data_name: str = "data.tar.xz") -> bytes:
    # An odd-sized first member checks the ar padding.
    return _ar(
        [("debian-binary", b"2.0\n\n"), ("control.tar.xz", b"x"), (data_name, _tar_xz(files))]
    )


def test_unpacks_only_the_wanted_binaries():
    deb = _deb({"./usr/bin/promtool": b"\x7fELF promtool", "./usr/share/doc/x": b"doc"})
    assert local_tools.debian_data_member(deb, ("usr/bin/promtool",)) == {
        "usr/bin/promtool": b"\x7fELF promtool"
    }


def test_a_package_without_the_binary_is_refused_by_name():
    deb = _deb({"./usr/bin/other": b"x"})
    with pytest.raises(SystemExit, match="lacks usr/bin/kubectl"):
        local_tools.debian_data_member(deb, ("usr/bin/kubectl",))


def test_not_a_package_and_zstd_are_refused_clearly():
    with pytest.raises(SystemExit, match="no ar magic"):
        local_tools.debian_data_member(b"<html>proxy error</html>", ("usr/bin/x",))
    with pytest.raises(SystemExit, match="zstd"):
        local_tools.debian_data_member(_deb({}, "data.tar.zst"), ("usr/bin/x",))


def test_parse_index_finds_the_package_stanza():
    index = (
        "Package: prometheus-node-exporter\nVersion: 1\nFilename: pool/a.deb\nSize: 3\n"
        "SHA256: aa\n\n"
        "Package: prometheus\nVersion: 2.42.0\nDepends: libc6,\n  adduser\n"
        "Filename: pool/main/p/prometheus/p.deb\nSize: 19257088\nSHA256: 81d5\n"
    )
    entry = local_tools.parse_index(index, "prometheus")
    assert entry == local_tools.IndexEntry("pool/main/p/prometheus/p.deb", "81d5", 19257088)
    with pytest.raises(SystemExit, match="'kubectl' is not in the index"):
        local_tools.parse_index(index, "kubectl")
