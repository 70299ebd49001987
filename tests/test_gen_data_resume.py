"""`gen-data` resume without vLLM: the output's cut-short last line is dropped by replacing
the file whole, so a kill during that rewrite loses no finished sample."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_dflash.train.gen_data import _done_ids

SAMPLING = {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}


def _lines(n: int) -> str:
    return "".join(json.dumps({"id": f"s{i}", "sampling": SAMPLING}) + "\n" for i in range(n))


def _killed_mid_write(monkeypatch) -> None:
    """Every file opened for writing dies after writing half of what it was given, as a
    process killed in the middle of the write would leave it."""
    real_open = Path.open

    class Dying:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise SystemExit("killed")

        def flush(self):
            self.f.flush()

        def fileno(self):
            return self.f.fileno()

    def dying_open(self, mode="r", *args, **kwargs):
        f = real_open(self, mode, *args, **kwargs)
        return Dying(f) if "w" in mode else f

    monkeypatch.setattr(Path, "open", dying_open)


def test_a_kill_while_resuming_loses_no_finished_sample(tmp_path, monkeypatch):
    out = tmp_path / "samples.jsonl"
    finished = _lines(40)
    out.write_text(finished + '{"id": "s40", "sampl')  # the last write was cut short
    with monkeypatch.context() as m:
        _killed_mid_write(m)
        with pytest.raises(SystemExit):
            _done_ids(out, SAMPLING, None)
    assert out.read_text().startswith(finished)  # every finished sample is still there
    assert _done_ids(out, SAMPLING, None) == {f"s{i}" for i in range(40)}
    assert out.read_text() == finished  # the cut line is gone, nothing else
    assert not out.with_name(out.name + ".tmp").exists()
