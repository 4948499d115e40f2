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
from itertools import repeat
from operator import mul, sub, truediv

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


def _link_facts(links: tuple[str, ...]) -> tuple[bool, int, tuple[int, ...]]:
    """(compute job?, its rank, the ranks whose SMs an NCCL kernel of it occupies)."""
    compute = len(links) == 1 and base_link(links[0]) == "compute"
    return compute, link_rank(links[0]), tuple(sorted({link_rank(x) for x in links if base_link(x) in COMM_LINKS}))


class _Job:
    __slots__ = ("resume", "links", "compute", "nccl", "rank")

    def __init__(self, resume, links: tuple[str, ...], facts):
        self.resume, self.links = resume, links
        self.compute, self.rank, self.nccl = facts


class Fluid:
    """Processor sharing over all resource-bound work in flight. Driven by timer callbacks
    rather than a process: each change of the job set schedules one timer for the next
    completion, and timers made stale by a later change are ignored (cheaper than waiting on
    a condition of two events). Jobs per link are counted as jobs come and go, and rates are
    recomputed only where a count they depend on changed.

    The remaining work of every job is advanced at every change of the job set by one float
    operation per job (remaining -= dt * rate): the step's times depend on that arithmetic, so
    it is kept as it is rather than advanced lazily."""

    def __init__(self, clock: Clock, compute_slowdown: float):
        self.clock = clock
        self.compute_rate = 1.0 / (1.0 + compute_slowdown)
        self.jobs: list[_Job] = []              # in submission order: completions are signalled in it
        self.remaining_s: list[float] = []      # per job, parallel to jobs
        self.rate: list[float] = []             # per job: 1 / sharers, or the compute stream's share
        self.count: dict[str, int] = {}         # jobs per link
        self.nccl_jobs: dict[int, int] = {}     # per rank (pipeline stage)
        self.last_s = 0.0
        self.timer: Event | None = None         # the live timer, not yet due; earlier ones are stale
        self.facts: dict[tuple[str, ...], tuple] = {}

    def submit(self, links: tuple[str, ...], work_s: float, resume):
        """Serve `work_s` over `links`, then call `resume(None)`."""
        if work_s <= 0:
            self.clock.soon(resume)
            return
        self._advance()
        facts = self.facts.get(links)
        if facts is None:
            facts = self.facts[links] = _link_facts(links)
        job = _Job(resume, links, facts)
        toggled = []
        nccl = self.nccl_jobs
        for rank in job.nccl:
            n = nccl.get(rank, 0)
            nccl[rank] = n + 1
            if not n:
                toggled.append(rank)
        count = self.count
        for link in links:
            count[link] = count.get(link, 0) + 1
        self.jobs.append(job)
        self.remaining_s.append(work_s)
        # NCCL kernels occupy SMs; copy engines (PCIe), NVMe and the host do not slow the GPU
        self.rate.append(self.compute_rate if job.compute and nccl.get(job.rank) else 1.0)
        if toggled or not job.compute:
            self._rates(toggled)
        self._schedule()

    def _advance(self):
        now = self.clock.env.now
        dt = now - self.last_s
        if dt > 0:
            self.remaining_s = list(map(sub, self.remaining_s, map(mul, repeat(dt), self.rate)))
        self.last_s = now

    def _rates(self, toggled: list[int]):
        """New shares after a change of the job set: every job crossing a link (a link's count
        may have changed), and the compute jobs of the ranks whose NCCL kernels started or all ended."""
        count, nccl, rate = self.count, self.nccl_jobs, self.rate
        compute_rate = self.compute_rate
        for i, job in enumerate(self.jobs):
            if job.compute:
                if job.rank in toggled:
                    rate[i] = compute_rate if nccl.get(job.rank) else 1.0
            else:
                links = job.links
                rate[i] = 1.0 / (count[links[0]] if len(links) == 1 else max(map(count.__getitem__, links)))

    def _schedule(self):
        """One timer for the next completion. The live timer is kept when it is already due
        then and nothing else due then was scheduled after it: a new one would run at the same
        point (most changes of the job set leave the next completion where it was)."""
        clock = self.clock
        if not self.jobs:
            self.timer = clock.watch_s = None
            return
        dt = min(map(truediv, self.remaining_s, self.rate))
        delay_s = dt if dt > 0 else 0.0
        if self.timer is not None and clock.env.now + delay_s == clock.watch_s and not clock.tainted:
            return
        clock.watch_s = None
        self.timer = clock.after(delay_s, self._fire)
        clock.watch_s, clock.tainted = clock.env.now + delay_s, False

    def _fire(self, timer: Event):
        if timer is not self.timer:
            return
        self.timer = self.clock.watch_s = None
        self._advance()
        limit = _EPS_S * max(1.0, self.clock.env.now)
        remaining = self.remaining_s
        if min(remaining) <= limit:
            done = [i for i, left in enumerate(remaining) if left <= limit]
            count, nccl, soon = self.count, self.nccl_jobs, self.clock.soon
            jobs, rate = self.jobs, self.rate
            toggled: list[int] = []
            shared = False
            for i in done:
                job = jobs[i]
                for link in job.links:
                    count[link] -= 1
                for rank in job.nccl:
                    nccl[rank] -= 1
                    if not nccl[rank]:
                        toggled.append(rank)
                shared = shared or not job.compute
                soon(job.resume)
            for i in reversed(done):
                del jobs[i], remaining[i], rate[i]
            if shared or toggled:
                self._rates(toggled)
        self._schedule()
