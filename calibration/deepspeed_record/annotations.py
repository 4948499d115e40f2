"""Annotations from DeepSpeed internals: which parameters a reduced bucket or a gather holds,
which submodule triggered a ZeRO-3 fetch; merged into the records taken meanwhile."""
from __future__ import annotations

import functools
import sys

from calibration.deepspeed_record.recorder import ANNOT, MODULE_NAME, PARAM_INDEX


def _pidx(params):
    return [PARAM_INDEX.get(id(p), -1) for p in params]


def _wrap_method(cls, attr, ctx_fn):
    orig = cls.__dict__.get(attr)
    if orig is None:
        raise AttributeError(f"{cls.__name__}.{attr} not found (DeepSpeed version changed?)")

    @functools.wraps(orig)
    def wrapper(self, *args, **kwargs):
        ann = ctx_fn(self, sys._getframe(1), *args, **kwargs)
        if ann is None:
            return orig(self, *args, **kwargs)
        ANNOT.append(ann)
        try:
            return orig(self, *args, **kwargs)
        finally:
            ANNOT.pop()

    setattr(cls, attr, wrapper)


def install_annotations():
    import linecache

    from deepspeed.runtime.zero import stage_1_and_2, stage3
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as PPC

    Z12 = stage_1_and_2.DeepSpeedZeroOptimizer
    Z3 = stage3.DeepSpeedZeroOptimizer_Stage3

    # ZeRO-1/2: the IPG bucket being reduced.  bucket.params holds (group, idx_in_group, param_id).
    def z12_reduce_ipg(self, frame, comm_dtype=None):
        dts = [comm_dtype] if comm_dtype is not None else list(self.ipg_buckets.keys())
        params = []
        for dt in dts:
            for g, j, _pid in self.ipg_buckets[dt].params:
                params.append(self.bit16_groups[g][j])
        return {"bucket_params": _pidx(params)}

    _wrap_method(Z12, "reduce_ipg_grads", z12_reduce_ipg)

    # ZeRO-3: the IPG bucket being reduce-scattered (insertion order).
    def z3_reduce_ipg(self, frame, communication_data_type):
        return {"bucket_params": _pidx(self.ipg_buckets[communication_data_type].params)}

    _wrap_method(Z3, "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads", z3_reduce_ipg)

    # ZeRO-3: persistent-parameter gather after the optimizer step.
    def z3_post_step(self, frame, *a, **k):
        return {"gather": "persistent_post_step"}

    _wrap_method(Z3, "_post_step", z3_post_step)

    # ZeRO-3: submodule whose pre-forward/pre-backward hook triggered a fetch.
    def ppc_fetch(self, frame, current_submodule, forward):
        return {"module": MODULE_NAME.get(id(current_submodule), type(current_submodule).__name__)}

    _wrap_method(PPC, "fetch_sub_module", ppc_fetch)

    # ZeRO-3: the parameter set handed to one all_gather_coalesced (fetch vs prefetch).
    def ppc_all_gather(self, frame, params, forward):
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        kind = "prefetch" if "prefetch" in line else ("fetch" if "fetch" in line else frame.f_code.co_name)
        return {"gather": kind, "gather_params": sorted(_pidx(params))}

    _wrap_method(PPC, "_PartitionedParameterCoordinator__all_gather_params", ppc_all_gather)
