"""Fixed V-shaped schedules: zbv (ZB-V) and dualpipev (DualPipeV).

Both put two stages on every rank in a V: rank r holds stage r ("chunk 0", going down) and
stage 2p-1-r ("chunk 1", coming back up), so the first and the last stage share rank 0 and the
loss gradient turns around without a hop. Both need m >= 2p microbatches to fill the V.
"""
from __future__ import annotations

from collections import deque

from autopar.schedules.ir import Action, B, F, I, Schedule, W, make_schedule, v_layout


class _RankProgram:
    """Builds one rank's action list, numbering microbatches per (stage, kind) in order."""

    def __init__(self, chunks: tuple[int, int]):
        self.chunks = chunks
        self.out: list[Action] = []
        self.overlap: list[int] = []
        self.next_f = {s: 0 for s in chunks}
        self.next_bwd = {s: 0 for s in chunks}
        self.pending_w: deque[Action] = deque()
        self.pending_w_by_stage = {s: deque() for s in chunks}

    def f(self, c: int) -> None:
        s = self.chunks[c]
        self.out.append(Action(s, F, self.next_f[s]))
        self.next_f[s] += 1

    def bwd(self, c: int, split: bool) -> None:
        """Backward of chunk c: an I (W queued) when ``split``, else a fused B."""
        s = self.chunks[c]
        k = self.next_bwd[s]
        self.next_bwd[s] += 1
        if split:
            self.out.append(Action(s, I, k))
            w = Action(s, W, k)
            self.pending_w.append(w)
            self.pending_w_by_stage[s].append(w)
        else:
            self.out.append(Action(s, B, k))

    def w_oldest(self) -> None:
        """The oldest queued W of either chunk, if any."""
        if self.pending_w:
            w = self.pending_w.popleft()
            self.pending_w_by_stage[w.stage].remove(w)
            self.out.append(w)

    def w_of(self, c: int) -> None:
        """The oldest queued W of chunk c."""
        q = self.pending_w_by_stage[self.chunks[c]]
        if q:
            w = q.popleft()
            self.pending_w.remove(w)
            self.out.append(w)

    def f_and_b(self, f_chunk: int, b_chunk: int) -> None:
        """An F of one chunk overlapped with a fused B of the other (one F&B unit)."""
        self.overlap.append(len(self.out))
        self.f(f_chunk)
        self.bwd(b_chunk, split=False)


def zbv(pp: int, m: int) -> Schedule:
    """ZB-V (arXiv 2401.10241 §6): zero bubble at F=I=W with pp * M_B peak.

    Rank r: 2(p-r)-1 chunk-0 forwards; r pairs (F1, F0); p-r rounds of (F1, I1, W1); then the
    steady (F0, I0, W0, F1, I1, W1) until all forwards ran; the cooldown runs I0/I1 with W
    deferred into the tail where the upstream ranks still work.
    """
    acts = []
    for r in range(pp):
        g = _RankProgram((r, 2 * pp - 1 - r))
        for _ in range(2 * (pp - r) - 1):
            g.f(0)
        for _ in range(r):
            g.f(1)
            g.f(0)
        for _ in range(pp - r):
            g.f(1)
            g.bwd(1, split=True)
            g.w_of(1)
        s0, s1 = g.chunks
        while g.next_f[s1] < g.next_f[s0] or g.next_f[s0] < m:
            if g.next_f[s0] < m:
                g.f(0)
            g.bwd(0, split=True)
            g.w_of(0)
            g.f(1)
            g.bwd(1, split=True)
            g.w_of(1)
        for _ in range(r):
            g.bwd(0, split=True)
            g.bwd(1, split=True)
        # The last p-r chunk-0 backwards each take one deferred chunk-0 W along.
        for _ in range(pp - r):
            g.bwd(0, split=True)
            g.w_of(0)
        while g.pending_w_by_stage[s1]:
            g.w_of(1)
        while g.pending_w_by_stage[s0]:
            g.w_of(0)
        assert g.next_f[s0] == g.next_f[s1] == g.next_bwd[s0] == g.next_bwd[s1] == m, (r, g.next_f, g.next_bwd)
        acts.append(g.out)
    return make_schedule("zbv", pp, v_layout(pp), m, acts)


def dualpipev(pp: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek-V3 report; the "cut-in-half" DualPipe): F&B overlap, (p + 1/2) * M_B.

    Eight phases per rank r: 2(p-r-1) chunk-0 F; r+1 pairs (F0, F1); p-r-1 rounds of
    (I1, W, F1); m-2p+r+1 rounds of two overlapped F&B units (F0 with B1, F1 with B0; the last
    rank runs its very first pair back to back); p-r-1 rounds of (B1, F1&B0); r+1 pairs of
    backwards whose second half switches to split I/W; p-r-1 rounds of (W, backward of chunk
    0); the remaining W. The backward is fused (B) while F&B overlap hides it and split (I+W)
    where W can fill the drain.
    """
    acts, overlaps = [], []
    for r in range(pp):
        g = _RankProgram((r, 2 * pp - 1 - r))
        for _ in range(2 * (pp - r - 1)):
            g.f(0)
        for _ in range(r + 1):
            g.f(0)
            g.f(1)
        for _ in range(pp - r - 1):
            g.bwd(1, split=True)
            g.w_oldest()
            g.f(1)
        for i in range(m - 2 * pp + r + 1):
            if i == 0 and r == pp - 1:
                g.f(0)
                g.bwd(1, split=False)
            else:
                g.f_and_b(0, 1)
            g.f_and_b(1, 0)
        for _ in range(pp - r - 1):
            g.bwd(1, split=False)
            g.f_and_b(1, 0)
        split = False
        n6 = r + 1
        for i in range(n6):
            if i == n6 // 2 and r % 2 == 1:
                split = True
            g.bwd(1, split=split)
            if i == n6 // 2 and r % 2 == 0:
                split = True
            g.bwd(0, split=split)
        for _ in range(pp - r - 1):
            g.w_oldest()
            g.bwd(0, split=split)
        while g.pending_w:
            g.w_oldest()
        s0, s1 = g.chunks
        assert g.next_f[s0] == g.next_f[s1] == g.next_bwd[s0] == g.next_bwd[s1] == m, (r, g.next_f, g.next_bwd)
        acts.append(g.out)
        overlaps.append(g.overlap)
    return make_schedule("dualpipev", pp, v_layout(pp), m, acts, overlaps)
