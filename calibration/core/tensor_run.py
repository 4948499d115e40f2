"""Train a scenario's GPT with Megatron tensor parallelism (calibration/core/tensor.py), optionally
with sequence parallelism, data parallelism and DeepSpeed's 1F1B pipeline, under torchrun on
gloo; rank 0 writes the losses and every rank's calls as JSON.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 -m calibration.core.tensor_run \
        --scenario S.yaml --tp 2 [--pp 2] [--sp] --steps 3 --out tp.json

Ranks as DeepSpeed's PipeModelDataParallelTopology places them (runtime/pipe/topology.py, axes
pipe, data, model; Megatron's default order too): rank = (stage * dp + dp_rank) * tp + tp_rank.
The pipeline runs zsim's port of TrainSchedule (zsim/schedule/pipeline.py train_schedule) with
blocking send/recv of the stage boundary's hidden states (sequence shards under SP) between the
same tp_rank of neighbouring stages; the blocks split uniformly, the embedding on the first
stage and the head on the last. Without SP, as DeepSpeed's PipelineEngine does on a
model-parallel grid (ds_config pipeline.pipe_partitioned / grad_partitioned, on by default;
`PipeWire`), each tp_rank sends a PartitionedTensor's meta and its 1/t part, and the TP group
all-gathers it where it is used (see [Note: partitioned pipeline sends]). After the step's
micro-batches: the gradients all-reduced over the data-parallel group as DeepSpeed's ZeRO-0
engine does it (`_allreduce_gradients`: flattened chunks, averaged), with SP the
sequence-parallel parameters' over the TP group in one flattened call, the norm's squares over the
model-parallel group (TP x PP; a duplicate counted on tp_rank 0 only, as Megatron's
param_is_not_tensor_parallel_duplicate), clipping, AdamW.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--tp", type=int, help="tensor parallel size (default: the scenario's parallelism.tensor)")
    p.add_argument("--pp", type=int, help="pipeline stages (default: the scenario's parallelism.pipeline)")
    p.add_argument("--sp", action="store_true", help="Megatron sequence parallelism (default: the scenario's)")
    p.add_argument("--steps", type=int, default=3, help="timed steps (the last one's calls are logged)")
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--no-memory", action="store_true", help="skip the step under the tensor memory tracker")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


class Layout:
    """This rank's coordinates and process groups (created in the same order on every rank)."""

    def __init__(self, world: int, tp: int, pp: int):
        if world % (tp * pp):
            raise SystemExit(f"world {world} is not divisible by tp {tp} x pp {pp}")
        self.tp, self.pp, self.dp = tp, pp, world // (tp * pp)
        rank = dist.get_rank()
        self.stage, rest = divmod(rank, self.dp * tp)
        self.dp_rank, self.tp_rank = divmod(rest, tp)

        def mine(groups):
            out = None
            for ranks in groups:
                g = dist.new_group(ranks)
                if rank in ranks:
                    out = g
            return out
        at = self.rank_of
        self.tp_group = mine([[at(s, d, t) for t in range(tp)] for s in range(pp) for d in range(self.dp)])
        self.dp_group = mine([[at(s, d, t) for d in range(self.dp)] for s in range(pp) for t in range(tp)])
        self.mp_group = mine([[at(s, d, t) for s in range(pp) for t in range(tp)] for d in range(self.dp)])

    def rank_of(self, stage: int, dp_rank: int, tp_rank: int) -> int:
        return (stage * self.dp + dp_rank) * self.tp + tp_rank


class _Log:
    """Calls outside the TP group (data, model-parallel, pipe), logged beside the TP ones."""

    def __init__(self, tp_comm):
        self.tp = tp_comm

    def call(self, kind: str, t: torch.Tensor, group: str):
        if self.tp.log is not None:
            self.tp.log.append((self.tp.phase, kind, int(t.numel()), int(t.numel() * t.element_size()), group))


class PipeWire:
    """DeepSpeed 0.19.8's partitioned pipeline tensors (pipe/engine.py, runtime/utils.py
    PartitionedTensor) over the TP group: `parts` sends the meta (to_meta: ndims, shape,
    num_parts, rank, partition_uniform's offsets; int64) and this rank's 1/t of the flattened
    tensor; `full` all-gathers the parts (PartitionedTensor.full()). Activations are partitioned
    when `acts`, gradients when `grads` (see [Note: partitioned pipeline sends])."""

    def __init__(self, comm, log, sc, sp: bool, dtype):
        from zsim.schedule.pipe_partition import partition_uniform

        keys, partitioned = sc.deepspeed.pipeline, comm.size > 1 and not sp
        self.acts, self.grads = partitioned and keys.pipe_partitioned, partitioned and keys.grad_partitioned
        self.comm, self.log, self.dtype = comm, log, dtype
        self.shape = (sc.micro_batch_size, sc.seq_len // comm.size if sp else sc.seq_len, sc.model.hidden)
        numel = self.shape[0] * self.shape[1] * self.shape[2]
        self.bounds = partition_uniform(numel, comm.size)
        self.meta = torch.tensor([len(self.shape), *self.shape, comm.size, comm.rank, *self.bounds], dtype=torch.long)

    def parts(self, t: torch.Tensor, partitioned: bool) -> list[torch.Tensor]:
        if not partitioned:
            return [t.detach().contiguous()]
        r = self.comm.rank
        return [self.meta, t.detach().reshape(-1)[self.bounds[r]:self.bounds[r + 1]].clone()]

    def buffers(self, partitioned: bool) -> list[torch.Tensor]:
        if not partitioned:
            return [torch.empty(self.shape, dtype=self.dtype)]
        r = self.comm.rank
        return [torch.empty_like(self.meta), torch.empty(self.bounds[r + 1] - self.bounds[r], dtype=self.dtype)]

    def full(self, part: torch.Tensor) -> torch.Tensor:
        """all_gather_into_tensor over the TP group (gloo: all_gather into the flat tensor's pieces)."""
        flat = torch.empty(self.bounds[-1], dtype=part.dtype)
        pieces = [flat[a:b] for a, b in zip(self.bounds, self.bounds[1:])]
        self.log.call("all_gather", flat, "tensor")
        gathered = [torch.empty_like(x) for x in pieces]
        dist.all_gather(gathered, part, group=self.comm.group)
        for x, g in zip(pieces, gathered):
            x.copy_(g)
        return flat.view(self.shape)


def train(args, sc, lay: Layout, record: dict):
    """This rank's `train_step(step, phases)` (measured.measure_steps' contract): one optimizer
    step of GAS micro-batches, its losses returned; the calls go to record["log"] when it is a list."""
    from calibration.core.model import DTYPES, batch
    from calibration.core.tensor import TPComm, TPModel, supported
    from zsim.schedule.pipe_partition import partition_uniform
    from zsim.schedule.pipeline import Cmd, train_schedule

    why = supported(sc.model)
    if why:
        raise SystemExit(f"the TP core runs {why}")
    dtype = DTYPES[sc.precision]
    comm = TPComm(lay.tp_group, lay.tp, lay.tp_rank)
    log = _Log(comm)
    model = TPModel(sc, comm, args.sp, args.seed, dtype)
    bounds = partition_uniform(sc.model.layers, lay.pp)
    blocks = range(bounds[lay.stage], bounds[lay.stage + 1])
    first, last = lay.stage == 0, lay.stage == lay.pp - 1
    names = [n for n in model.params if (n.startswith("layers.") and int(n.split(".")[1]) in blocks)
             or (first and n.split(".")[0] in ("wte", "wpe")) or (last and n.split(".")[0] in ("ln_f", "lm_head"))]
    params = [model.params[n] for n in names]
    o = sc.deepspeed.optimizer.params or {}
    opt = torch.optim.AdamW(params, lr=float(o.get("lr", 1e-3)), betas=tuple(o.get("betas", (0.9, 0.999))),
                            eps=float(o.get("eps", 1e-8)), weight_decay=float(o.get("weight_decay", 0.01)))
    gas, clip = sc.gradient_accumulation_steps, sc.deepspeed.gradient_clipping
    wire = PipeWire(comm, log, sc, args.sp, dtype)
    prev, nxt = (lay.rank_of(lay.stage + d, lay.dp_rank, lay.tp_rank) for d in (-1, 1))
    if lay.pp == 1:
        program = [(c, m) for m in range(gas) for c in (Cmd.FORWARD, Cmd.BACKWARD)]
    else:
        program = train_schedule(lay.pp, lay.stage, gas)

    def send(tensors, peer):
        for t in tensors:
            log.call("send", t, "pipe")
            dist.send(t, peer)

    def recv(tensors, peer):
        for t in tensors:
            log.call("recv", t, "pipe")
            dist.recv(t, peer)
        return tensors

    def train_step(step: int, phases) -> list[float]:
        comm.log = record["log"]
        losses: list[float] = []
        state: dict[int, dict] = {}
        for cmd, micro in program:
            s = state.setdefault(micro, {})
            comm.phase = "forward" if cmd in (Cmd.FORWARD, Cmd.SEND_ACTIVATION, Cmd.RECV_ACTIVATION) else "backward"
            if cmd == Cmd.FORWARD:
                ids, labels = batch(sc, step, micro, lay.dp_rank, args.seed)
                if not first:   # _exec_forward_pass: the received part made whole
                    s["in"] = (wire.full(s.pop("in_part")) if wire.acts else s["in"]).requires_grad_(True)
                x = model.embed(ids) if first else s["in"]
                for i in blocks:
                    x = model.block(i, x)
                if last:
                    loss = model.head_loss(x, labels)
                    losses.append(float(loss.detach()))
                    x = loss / gas
                elif wire.acts:   # keep the part only: the output's data dropped (engine.py:745-750)
                    s["out_part"] = wire.parts(x, True)[1]
                    x.data = torch.zeros(1, dtype=x.dtype)
                s["out"] = x
            elif cmd == Cmd.BACKWARD:
                if not last and wire.grads:   # _exec_backward_pass: the output, then the gradient, made whole
                    s["out"].data = wire.full(s.pop("out_part"))
                    s["grad"] = wire.full(s.pop("grad_part"))
                torch.autograd.backward(s.pop("out"), None if last else s.pop("grad"))
            elif cmd == Cmd.SEND_ACTIVATION:
                send([wire.meta, s["out_part"]] if wire.acts else wire.parts(s["out"], False), nxt)
            elif cmd == Cmd.RECV_ACTIVATION:
                got = recv(wire.buffers(wire.acts), prev)
                s["in_part" if wire.acts else "in"] = got[-1]
            elif cmd == Cmd.SEND_GRAD:
                send(wire.parts(state.pop(micro)["in"].grad, wire.grads), prev)
            elif cmd == Cmd.RECV_GRAD:
                if wire.acts and not wire.grads:   # _exec_recv_grads: the output made whole first
                    s["out"].data = wire.full(s.pop("out_part"))
                got = recv(wire.buffers(wire.grads), nxt)
                s["grad_part" if wire.grads else "grad"] = got[-1]
        _finalize_grads(model, names, lay, clip, log)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return losses
    return train_step


def _finalize_grads(model, names, lay: Layout, clip: float, log: _Log):
    comm = model.comm
    comm.phase = "backward"
    # issued on a one-rank data-parallel group too, as DeepSpeed does (engine.allreduce_gradients
    # runs whenever enable_backward_allreduce; the PipelineEngine's ReduceGrads likewise)
    _allreduce_gradients([model.params[n].grad for n in names], lay, log)
    # _allreduce_non_tensor_model_parallel_grads (finalize_model_grads.py): the partial gradients
    # of the sequence-parallel params, flattened into one all-reduce over the TP group
    partial = [model.params[n].grad for n in names if model.partial_grad[n]]
    if partial:
        flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in partial]))
        for g, synced in zip(partial, flat.split([g.numel() for g in partial])):
            g.copy_(synced.view_as(g))
    if clip <= 0:
        return
    comm.phase = "step"
    # runtime/utils.py clip_grad_norm_ (DeepSpeed's stage-0 clip, engine.py:3510): fp32 squared
    # norms of the rank's own parameters, summed over the model-parallel group (utils.py:410)
    sq = sum(model.params[n].grad.float().norm().square() for n in names
             if model.partitioned[n] or lay.tp_rank == 0).reshape(1).float()
    if lay.tp * lay.pp > 1:
        log.call("all_reduce", sq, "tensor" if lay.pp == 1 else "pipe" if lay.tp == 1 else "model")
        dist.all_reduce(sq, group=lay.mp_group)
    coef = clip / (float(sq.sqrt()) + 1e-6)
    if coef < 1.0:
        for n in names:
            model.params[n].grad.mul_(coef)


def _allreduce_gradients(grads, lay: Layout, log: _Log):
    """DeepSpeed ZeRO-0's data-parallel reduction at the boundary (engine.allreduce_gradients ->
    buffered_allreduce_fallback -> allreduce_no_retain): the gradients in chunks closed once
    they pass MEMORY_OPT_ALLREDUCE_SIZE elements (zsim's constant for engine.py's), each flattened into a new buffer, averaged
    (postscale: all-reduce, then 1 / dp) over the rank's data-parallel group and copied back
    (allreduce_and_copy). The runner is fp32, the communication dtype too (no cast copy)."""
    from zsim.schedule.stage012 import MEMORY_OPT_ALLREDUCE_SIZE

    chunk, numel = [], 0
    for g in grads:
        chunk.append(g)
        numel += g.numel()
        if numel > MEMORY_OPT_ALLREDUCE_SIZE:
            _allreduce_and_copy(chunk, lay, log)
            chunk, numel = [], 0
    if chunk:
        _allreduce_and_copy(chunk, lay, log)


def _allreduce_and_copy(chunk, lay: Layout, log: _Log):
    flat = torch.cat([g.reshape(-1) for g in chunk])
    log.call("all_reduce", flat, "data")
    dist.all_reduce(flat, group=lay.dp_group)
    if lay.dp > 1:
        flat.mul_(1.0 / lay.dp)
    for g, synced in zip(chunk, flat.split([g.numel() for g in chunk])):
        g.copy_(synced.view_as(g))


def write_tensor_measurement(path: str, engine: str, sc, args, step_times, phase_times, peak_bytes: int,
                             collectives, losses: list[float], lay: Layout) -> None:
    """measured.write_measurement's figures (rank 0's step times, the peak over ranks), plus what a
    tensor/pipeline grid needs: the loss as the last stage's first TP rank reports it (averaged
    over data-parallel ranks) and every rank's calls with their group (all ranks call)."""
    from calibration.core.measured import summarize_times

    world = dist.get_world_size()
    every = [None] * world
    dist.all_gather_object(every, {"losses": losses, "calls": [list(c) for c in collectives or []], "peak": peak_bytes,
                                   "stage": lay.stage, "dp_rank": lay.dp_rank, "tp_rank": lay.tp_rank})
    if dist.get_rank() == 0:
        reporting = [r["losses"] for r in every if r["stage"] == lay.pp - 1 and r["tp_rank"] == 0]
        peaks = [r["peak"] for r in every]
        out = {"engine": engine, "scenario": sc.name, "world_size": world, "steps": args.steps, "warmup": args.warmup,
               "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "sequence_parallel": args.sp,
               **summarize_times(step_times, phase_times), "peak_bytes": max(peaks), "peak_bytes_per_rank": peaks,
               "losses": [sum(v) / len(reporting) for v in zip(*reporting)],
               "losses_per_rank": [r["losses"] for r in every],
               "collectives": every[0]["calls"], "collectives_per_rank": [r["calls"] for r in every]}
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def main(argv=None) -> int:
    args = parse(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from calibration.core.measured import measure_steps
    from zsim.config.scenario import load_scenario

    dist.init_process_group("gloo")
    sc = load_scenario(args.scenario, tuple(args.set))
    args.tp = args.tp or sc.tensor_parallel_size
    args.pp = args.pp or sc.pipeline_stages
    args.sp = args.sp or sc.parallelism.sequence_parallel
    lay = Layout(dist.get_world_size(), args.tp, args.pp)
    record = {"log": None}
    measure_steps(args, sc, "own", train(args, sc, lay, record), record,
                  write=lambda *a: write_tensor_measurement(*a, lay=lay))
    return 0


if __name__ == "__main__":
    sys.exit(main())
