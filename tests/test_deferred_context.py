"""Context K/V rows held back while a request does not draft (serving/deferred_context.py),
without vLLM: a simulated batch whose requests decode, draft, verify drafts, leave and get
preempted, against a paged cache that records what was written where."""

from __future__ import annotations

import random

import torch

from vllm_dflash.serving.deferred_context import DeferredContext

BS = 4  # cache block size
F = 3  # feature width


class Request:
    def __init__(self, rid: str, first_slot: int) -> None:
        self.rid, self.pos, self.first_slot = rid, 0, first_slot

    def slot(self, pos: int) -> int:
        return self.first_slot + pos  # one contiguous run of blocks per request


def _run(seed: int) -> None:
    rng = random.Random(seed)
    ctx = DeferredContext(BS)
    written: dict[int, tuple[str, int]] = {}  # slot -> (request, position) written there
    freed: set[int] = set()  # slots of requests whose blocks were freed
    live: list[Request] = []
    gone: set[str] = set()
    next_id = 0
    for _ in range(300):
        while len(live) < 5:  # new requests: a prefill of 1..9 tokens
            live.append(Request(f"r{next_id}", next_id * 1000))
            next_id += 1
        step = [r for r in live if rng.random() < 0.9]  # some are not scheduled
        counts = []
        feats, pos, slots = [], [], []
        for r in step:
            n = rng.randint(1, 9) if r.pos == 0 else rng.choice([1, 1, 1, 3])
            counts.append(n)
            for p in range(r.pos, r.pos + n):
                feats.append([hash((r.rid, p)) % 997, p, 0])
                pos.append(p)
                slots.append(r.slot(p))
            r.pos += n
        drafting = {j for j in range(len(step)) if rng.random() < 0.3}
        f, p, s = ctx.rows_to_write(
            [r.rid for r in step],
            counts,
            drafting,
            gone,
            torch.tensor(feats, dtype=torch.float32).view(-1, F),
            torch.tensor(pos, dtype=torch.int64),
            torch.tensor(slots, dtype=torch.int64),
        )
        for row, position, slot in zip(f.tolist(), p.tolist(), s.tolist(), strict=True):
            assert slot not in freed, "a row was written into blocks its request gave up"
            assert row[1] == position
            written[slot] = (f"{row[0]:.0f}", position)
        gone = set()
        for j, r in enumerate(step):
            complete = r.pos - r.pos % BS  # positions in full blocks
            need = r.pos if j in drafting else complete
            for q in range(need):  # what the drafter (or a prefix-cache hit) reads
                assert written.get(r.slot(q)) == (f"{hash((r.rid, q)) % 997}", q), (r.rid, q)
        for r in list(live):
            if rng.random() < 0.05:  # finished, or preempted: its blocks are freed
                live.remove(r)
                gone.add(r.rid)
                freed.update(r.slot(q) for q in range(r.pos + 1))
    assert len(ctx.held) <= 5
    assert all(len(h.positions) < BS for h in ctx.held.values())


def test_drafting_requests_and_full_blocks_always_hold_their_context():
    for seed in range(20):
        _run(seed)


def test_requests_that_do_not_draft_are_written_a_block_at_a_time():
    ctx = DeferredContext(BS)
    writes = []
    for p in range(12):  # one request, one token per step, never drafting
        f, pos, _ = ctx.rows_to_write(
            ["a"],
            [1],
            set(),
            set(),
            torch.full((1, F), float(p)),
            torch.tensor([p]),
            torch.tensor([p]),
        )
        writes.append(pos.tolist())
    blocks = [[], [], [], [0, 1, 2, 3], [], [], [], [4, 5, 6, 7], [], [], [], [8, 9, 10, 11]]
    assert writes == blocks


def test_without_a_plan_every_row_is_written_at_once():
    ctx = DeferredContext(BS)
    feats = torch.arange(6.0).view(2, F)
    f, p, s = ctx.rows_to_write(
        ["a", "b"], [1, 1], None, set(), feats, torch.tensor([5, 9]), torch.tensor([5, 9])
    )
    assert f is feats and p.tolist() == [5, 9]
