"""scenario -> (workload, schedule): picks the stage builder."""
from __future__ import annotations

from zsim.specs.scenario import Scenario
from zsim.schedule import offload, stage3, stage012
from zsim.schedule.builder import Builder
from zsim.schedule.context import StepContext
from zsim.schedule.ir import Schedule
from zsim.workload.transformer import DTYPE_BYTES, Workload, build_workload


def workload_for(sc: Scenario) -> Workload:
    return build_workload(sc.model, micro_batch_size=sc.micro_batch_size, seq_len=sc.seq_len,
                          precision=sc.precision, flash_attention=sc.training.flash_attention,
                          dropout=sc.training.dropout,
                          fused_cross_entropy=sc.training.fused_cross_entropy)


def build_schedule(sc: Scenario, wl: Workload | None = None) -> tuple[Workload, Schedule]:
    wl = wl or workload_for(sc)
    ctx = StepContext(sc=sc, wl=wl, b=Builder(), param_bytes=DTYPE_BYTES[sc.precision], world=sc.cluster.world_size)
    if sc.zero.stage == 3:
        stage3.build(ctx)
    else:
        stage012.build(ctx)
    return wl, ctx.b.build(sc.zero.stage, ctx.world, offload.host_settings(ctx))
