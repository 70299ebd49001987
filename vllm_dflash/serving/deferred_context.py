"""Context K/V rows held back while a request does not draft (runner V1 on CPU, the draft
policy's home).

Every token the target computes needs its fused features projected into the drafter's
paged cache before the drafter next reads that request's context. A request that does
not draft reads nothing, so its rows can wait, and be written together, in one
projection, when it drafts again. Waiting is bounded by the cache block: the row that
fills a block is written at once with everything held for it, so a full block always
holds its context K/V, and prefix-cache hits on it (which keep it, see ``activate.py``)
read complete context. At most ``block_size - 1`` rows per request wait.

A request that leaves the batch has its rows written if it still holds its blocks (not
scheduled this step) and dropped if it does not (finished or preempted: its blocks are
freed, and a preempted request recomputes everything when it resumes). Only rows a
request computes alone in a step (one token) wait; prefill chunks and verified drafts
are written at once.

On a GPU nothing waits: selecting rows needs their count on the host, a device sync, and
the projection of a few rows costs little there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class _Held:
    features: list[torch.Tensor] = field(default_factory=list)  # each [layers * hidden]
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


class DeferredContext:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.held: dict[str, _Held] = {}

    def rows_to_write(
        self,
        req_ids: list[str],  # [b] the batch's request ids
        counts: list[int],  # [b] rows of each request in the inputs, in batch order
        drafting: set[int] | None,  # batch rows that draft this step; None: all
        gone: set[str],  # requests finished or preempted since the last step
        features: torch.Tensor,  # [n, layers * hidden]
        positions: torch.Tensor,  # [n]
        slots: torch.Tensor,  # [n]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows to project now: held rows that are due, then this step's rows that do
        not wait. The others are held."""
        if not self.held and drafting is None:
            return features, positions, slots
        pos, slot = positions.tolist(), slots.tolist()
        now: list[int] = []  # this step's rows written now
        wait: list[tuple[int, str]] = []  # this step's rows held, and their requests
        due: list[_Held] = []  # held rows written now
        batch = set(req_ids)
        for rid in [r for r in self.held if r not in batch]:
            held = self.held.pop(rid)
            if rid not in gone:  # not scheduled this step: its blocks are still its own
                due.append(held)
        start = 0
        for j, (rid, n) in enumerate(zip(req_ids, counts, strict=True)):
            if n == 0:
                continue
            last = start + n - 1
            idle = drafting is not None and j not in drafting
            if idle and n == 1 and (pos[last] + 1) % self.block_size:
                wait.append((last, rid))
            else:
                if rid in self.held:
                    due.append(self.held.pop(rid))
                now.extend(range(start, start + n))
            start += n
        if wait:
            rows = [row for row, _ in wait]
            # A copy: the step's own tensor (a prefill's can be large) is not kept alive.
            kept = features.clone() if len(rows) == len(pos) else features[rows]
            for i, (row, rid) in enumerate(wait):
                held = self.held.get(rid)
                if held is None:
                    held = self.held[rid] = _Held()
                held.features.append(kept[i])
                held.positions.append(pos[row])
                held.slots.append(slot[row])
        if not due:
            if not wait:
                return features, positions, slots
            if not now:
                return features[:0], positions[:0], slots[:0]
        index = torch.tensor(now, dtype=torch.int64)
        return (
            torch.cat([*(torch.stack(h.features) for h in due), features[index]]),
            torch.tensor([p for h in due for p in h.positions] + [pos[i] for i in now]).to(
                positions.dtype
            ),
            torch.tensor([s for h in due for s in h.slots] + [slot[i] for i in now]).to(
                slots.dtype
            ),
        )
