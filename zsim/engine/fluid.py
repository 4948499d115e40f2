"""The engine's clock and its processor-sharing model.

`Clock` is simpy's environment plus a FIFO of the callbacks due at the current instant. A simpy
event triggered now is scheduled at (now, NORMAL, next id): it runs after every entry already
due now and before any scheduled later. When nothing is due now in simpy's queue, the FIFO
gives that same order without a pass of simpy's loop: the FIFO is drained before simpy's next
entry, and a callback goes to the FIFO only while simpy holds nothing due now (else it joins
simpy's queue behind what is there). Every run therefore processes the same callbacks in the
same order as one event per callback would, so the step's times are the same to the bit.

`Fluid` serves resource-bound work: a job crosses one or more links (NVLink tier, IB rails,
the GPU's PCIe link per direction, the PCIe switch uplink per direction, NVMe, the CPU);
while jobs overlap, each progresses at the smallest share it gets on any link it crosses
(1/jobs on that link), and the compute stream slows by the profile's interference factor
while an NCCL transfer of its rank is active.
"""
from __future__ import annotations

from collections import deque
from heapq import heappop, heappush

import simpy
from simpy.core import EmptySchedule
from simpy.events import Event

from zsim.hardware.cost_model import COMM_LINKS
from zsim.hardware.placement import base_link, link_rank

_EPS_S = 1e-15


class Clock:
    def __init__(self):
        self.env = simpy.Environment()
        self.ready: deque = deque()
        # the time of one watched entry (the fluid's live timer) and whether an entry due at the
        # same time was scheduled after it (then a new timer at that time would run after that entry)
        self.watch_s: float | None = None
        self.tainted = False

    @property
    def now(self) -> float:
        return self.env.now

    def soon(self, callback):
        """Call `callback(None)` at this instant, after everything already due now (see the module doc)."""
        env = self.env
        now = env.now
        if env.peek() > now:
            self.ready.append(callback)
        else:
            if now == self.watch_s:
                self.tainted = True
            env.timeout(0.0).callbacks.append(callback)

    def after(self, delay_s: float, callback) -> Event:
        """Call `callback(event)` `delay_s` from now."""
        env = self.env
        if env.now + delay_s == self.watch_s:
            self.tainted = True
        ev = env.timeout(delay_s)
        ev.callbacks.append(callback)
        return ev

    def run(self):
        ready = self.ready
        popleft, step = ready.popleft, self.env.step
        try:
            while True:
                while ready:
                    popleft()(None)
                step()
        except EmptySchedule:
            return


def _link_facts(links: tuple[str, ...]) -> tuple[bool, int, tuple[int, ...], tuple[int, ...]]:
    """(compute job?, its rank, the ranks whose SMs an NCCL kernel of it occupies, every rank
    whose links it crosses)."""
    compute = len(links) == 1 and base_link(links[0]) == "compute"
    return (compute, link_rank(links[0]), tuple(sorted({link_rank(x) for x in links if base_link(x) in COMM_LINKS})),
            tuple(sorted({link_rank(x) for x in links})))


class _Job:
    __slots__ = ("resume", "links", "compute", "nccl", "rank", "ranks", "seq", "rate", "left_s", "since_s", "version")

    def __init__(self, resume, links: tuple[str, ...], facts, seq: int, work_s: float, now: float):
        self.resume, self.links = resume, links
        self.compute, self.rank, self.nccl, self.ranks = facts
        self.seq, self.left_s, self.since_s = seq, work_s, now
        self.rate, self.version = 1.0, 0

    def end_s(self) -> float:
        return self.since_s + self.left_s / self.rate


class Fluid:
    """Processor sharing over all resource-bound work in flight. Driven by timer callbacks
    rather than a process: each change of the job set keeps one timer for the next completion,
    and timers made stale by a later change are ignored.

    Each job's remaining work is brought up to date only when its rate changes (left -= elapsed
    x rate), and its completion time is kept in a heap: a change of the job set touches only
    the jobs whose share it changes (those crossing a link whose job count changed, and the
    compute jobs of a rank whose NCCL kernels started or all ended), not every job in flight,
    which matters when many pipeline stages run at once. Jobs that complete at the same instant
    are signalled in submission order."""

    def __init__(self, clock: Clock, compute_slowdown: float):
        self.clock = clock
        self.compute_rate = 1.0 / (1.0 + compute_slowdown)
        self.seq = 0                             # submission counter
        self.count: dict[str, int] = {}          # jobs per link
        self.sharing: dict[str, dict] = {}       # per link: its non-compute jobs (seq -> job)
        self.computing: dict[int, dict] = {}     # per rank: its compute jobs (seq -> job)
        self.nccl_jobs: dict[int, int] = {}      # per rank (pipeline stage)
        self.heap: list = []                     # (end_s, seq, version, job); stale entries skipped
        self.timer: Event | None = None          # the live timer, not yet due; earlier ones are stale
        self.facts: dict[tuple[str, ...], tuple] = {}
        self.touching: dict[int, int] = {}       # per rank (pipeline stage): jobs crossing its links

    def _facts(self, links: tuple[str, ...]) -> tuple:
        facts = self.facts.get(links)
        if facts is None:
            facts = self.facts[links] = _link_facts(links)
        return facts

    def is_compute(self, links: tuple[str, ...]) -> bool:
        return self._facts(links)[0]

    def ranks(self, links: tuple[str, ...]) -> tuple[int, ...]:
        """The ranks (pipeline stages) whose links a job over `links` crosses."""
        return self._facts(links)[3]

    def submit(self, links: tuple[str, ...], work_s: float, resume, delay_s: float = 0.0):
        """Serve `work_s` over `links`, then call `resume(None)`. A compute job may start
        `delay_s` from now (its op's fixed host time): a compute job shares nothing with
        others, so joining now and progressing only from then is the same as joining then,
        without an event at its start."""
        if work_s <= 0:
            self.clock.soon(resume)
            return
        now = self.clock.env.now
        facts = self.facts.get(links) or self._facts(links)
        assert delay_s == 0.0 or facts[0], "only a compute job starts later"
        self.seq += 1
        job = _Job(resume, links, facts, self.seq, work_s, now + delay_s)
        toggled = []
        touching = self.touching
        for rank in job.ranks:
            touching[rank] = touching.get(rank, 0) + 1
        nccl = self.nccl_jobs
        for rank in job.nccl:
            n = nccl.get(rank, 0)
            nccl[rank] = n + 1
            if not n:
                toggled.append(rank)
        count = self.count
        for link in links:
            count[link] = count.get(link, 0) + 1
        if job.compute:
            self.computing.setdefault(job.rank, {})[job.seq] = job
            # NCCL kernels occupy SMs; copy engines (PCIe), NVMe and the host do not slow the GPU
            job.rate = self.compute_rate if nccl.get(job.rank) else 1.0
        else:
            sharing = self.sharing
            for link in links:
                sharing.setdefault(link, {})[job.seq] = job
            job.rate = _share(count, links)
        heappush(self.heap, (job.end_s(), job.seq, 0, job))
        self._rerate(now, () if job.compute else links, toggled, job)
        self._schedule()

    def _rerate(self, now: float, links, toggled, skip=None):
        """New shares after a change of the job set on `links` and of the NCCL jobs of the
        `toggled` ranks: each job whose share changes is brought up to `now` at its old rate."""
        count, nccl, compute_rate = self.count, self.nccl_jobs, self.compute_rate
        changed = {}
        for link in links:
            for seq, job in self.sharing.get(link, {}).items():
                if job is not skip:
                    changed[seq] = job
        for seq, job in changed.items():
            rate = _share(count, job.links)
            if rate != job.rate:
                self._set_rate(job, rate, now)
        for rank in toggled:
            rate = compute_rate if nccl.get(rank) else 1.0
            for job in self.computing.get(rank, {}).values():
                if job is not skip and rate != job.rate:
                    self._set_rate(job, rate, now)

    def _set_rate(self, job: _Job, rate: float, now: float):
        if now > job.since_s:   # else it has not started: nothing done yet
            job.left_s -= (now - job.since_s) * job.rate
            job.since_s = now
        job.rate = rate
        job.version += 1
        heappush(self.heap, (job.end_s(), job.seq, job.version, job))

    def _top(self):
        """The heap's first live entry (stale ones dropped), or None."""
        heap = self.heap
        while heap:
            entry = heap[0]
            job = entry[3]
            if job.version == entry[2] and job.left_s is not None:
                return entry
            heappop(heap)
        return None

    def _schedule(self):
        """One timer for the next completion. The live timer is kept when it is already due
        then and nothing else due then was scheduled after it: a new one would run at the same
        point (most changes of the job set leave the next completion where it was)."""
        clock = self.clock
        top = self._top()
        if top is None:
            self.timer = clock.watch_s = None
            return
        now = clock.env.now
        dt = top[0] - now
        delay_s = dt if dt > 0 else 0.0
        if self.timer is not None and now + delay_s == clock.watch_s and not clock.tainted:
            return
        clock.watch_s = None
        self.timer = clock.after(delay_s, self._fire)
        clock.watch_s, clock.tainted = now + delay_s, False

    def _fire(self, timer: Event):
        if timer is not self.timer:
            return
        self.timer = self.clock.watch_s = None
        now = self.clock.env.now
        scale = max(1.0, now)
        limit, horizon = _EPS_S * scale, now + _LOOK_S * scale
        heap = self.heap
        done, later = [], []
        while heap:
            entry = heap[0]
            job = entry[3]
            if job.version != entry[2] or job.left_s is None:
                heappop(heap)      # stale
                continue
            if entry[0] > horizon:
                break
            heappop(heap)
            if job.left_s - max(now - job.since_s, 0.0) * job.rate <= limit:
                done.append(job)
            else:
                later.append(entry)
        for entry in later:
            heappush(heap, entry)
        if done:
            if len(done) > 1:
                done.sort(key=_by_seq)
            count, nccl, soon = self.count, self.nccl_jobs, self.clock.soon
            toggled: list[int] = []
            links: dict[str, None] = {}
            touching = self.touching
            for job in done:
                job.left_s = None     # gone: its heap entries are stale
                for rank in job.ranks:
                    touching[rank] -= 1
                for link in job.links:
                    count[link] -= 1
                if job.compute:
                    del self.computing[job.rank][job.seq]
                else:
                    for link in job.links:
                        del self.sharing[link][job.seq]
                        links[link] = None
                for rank in job.nccl:
                    nccl[rank] -= 1
                    if not nccl[rank]:
                        toggled.append(rank)
                soon(job.resume)
            if links or toggled:
                self._rerate(now, links, toggled)
        self._schedule()


def _share(count: dict[str, int], links: tuple[str, ...]) -> float:
    """A transfer's rate: the smallest share it gets on any link it crosses (1 / its jobs)."""
    return 1.0 / (count[links[0]] if len(links) == 1 else max(map(count.__getitem__, links)))


def _by_seq(job: _Job) -> int:
    return job.seq


# heap entries due this close after the fired instant are checked for completion (a job is done
# when what is left of it is within _EPS_S of the clock, as the remaining work's rounding allows)
_LOOK_S = 1e-9
