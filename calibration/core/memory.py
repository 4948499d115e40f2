"""Peak tensor memory of one rank: every storage allocated by a torch op is counted until it is
freed (a TorchDispatchMode plus weakref finalizers on storages), on top of the storages alive
when tracking starts (found through the garbage collector). On CUDA the core uses
torch.cuda.max_memory_allocated instead. Gloo's internal buffers are not tensors and are not
counted (as NCCL's are not counted by the CUDA caching allocator's statistics).
"""
from __future__ import annotations

import gc
import warnings
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorMemoryTracker(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}       # storage id -> bytes
        self.current = 0
        self.peak = 0

    def _track(self, t: torch.Tensor):
        if t.device.type == "meta":
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = id(st)
        if key in self.live or st.nbytes() == 0:
            return
        n = st.nbytes()
        self.live[key] = n
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(st, self._free, key)

    def _free(self, key):
        n = self.live.pop(key, 0)
        self.current -= n

    def start(self):
        """Count the storages alive now, then track new ones."""
        gc.collect()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            objs = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        for obj in objs:
            try:
                if not obj.is_meta:
                    self._track(obj)
            except (ReferenceError, RuntimeError):
                pass
        self.peak = self.current
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def model_state_bytes(core) -> dict[str, int]:
    """The model states this rank holds between steps, by zsim's categories: 16-bit params
    (the flat group and the frozen params whole, or the ZeRO-3 shard), the gradient buffers
    that outlive a step (stage 0's flat gradients, stage 3's partition) and the fp32 master
    with its AdamW moments."""
    if core.stage < 3:
        params = core.flat16.nbytes + sum(core.params[p].nbytes for p, t in enumerate(core.trainable) if not t)
        grads = core.flatgrad.nbytes if core.stage == 0 else 0
    else:
        params, grads = core.shard16.nbytes, core.grads.gpart.nbytes
    moments = sum(v.nbytes for master, opt in core.opts for v in opt.state[master].values()
                  if torch.is_tensor(v) and v.numel() == master.numel())
    return {"parameters": params, "gradients": grads, "optimizer states": core.master.nbytes + moments}
