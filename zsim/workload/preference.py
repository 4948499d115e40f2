"""Preference training (training.preference: DPO, IPO, ORPO, SimPO): the workload of one micro-step
of TRL's trainers, which axolotl (rl:) and LLaMA-Factory (stage: dpo) run.

[Note: preference training]
TRL's DPOTrainer (trl/trainer/dpo_trainer.py) takes a micro-batch of per_device_train_batch_size
examples, each a chosen and a rejected completion of one prompt:
- concatenated_forward runs the trained model once on the chosen and rejected sequences
  concatenated along the batch: 2 x micro-batch sequences, padded to one length (zsim: seq_len),
  with autograd recording as in supervised training;
- get_batch_loss_metrics then calls compute_ref_log_probs, under torch.no_grad: the reference
  model's forward on the same 2 x micro-batch sequences. With PEFT and no ref_model the
  reference is the trained model itself inside null_ref_context (model.disable_adapter()): the
  same base weights, the adapters skipped. Otherwise it is a frozen copy of the model
  (create_reference_model), which TRL's prepare_deepspeed wraps in an inference engine: ZeRO-3
  (partitioned, gathered module by module) when the run is at stage 3, else stage 0 (a whole
  16-bit copy on every GPU);
- the loss (a few ops on 2 x micro-batch scalars) and one backward through the trained model.
So the reference forward runs after the trained model's forward, while that forward's
activations are kept: its transients sit on top of them. It keeps nothing itself and has no
backward. ORPO (ORPOTrainer) and SimPO (CPOTrainer, loss_type simpo) concatenate the pair the
same way and have no reference model; DPO with precompute_ref_log_probs reads the reference
log-probs computed before training (training.preference.reference: false).

zsim appends the reference's modules after the trained model's (layer -2: after the blocks,
outside the layer machinery, never checkpointed), marked no_grad: each keeps its output only
while it runs (as forward workspace), and the backward skips it. A PEFT reference names the
trained model's parameter ids (ZeRO-3 gathers them a second time, as the hooks of the same
nn.Modules do); a copy has its own frozen parameters, which ZeRO-3 partitions and ZeRO-0/1/2
keep whole in 16 bits (frozen parameters are in no optimizer group), as TRL's stage-0 engine does.
"""
from __future__ import annotations

from dataclasses import replace

from zsim.specs.scenario import TrainingSpec
from zsim.workload.module import Module, Param, Workload

REFERENCE = "reference"     # the prefix of the reference model's module and parameter names


def sequences_per_example(training: TrainingSpec) -> int:
    """Sequences each example puts through a forward: 2 (chosen and rejected) under preference
    training that concatenates the pair along the batch, else 1."""
    return 2 if training.preference is not None and training.preference.pair == "batch" else 1


def reward_head_of(training: TrainingSpec) -> str:
    """The head build_workload puts after the final norm: lm, or a reward model's
    (see [Note: reward model heads])."""
    pref = training.preference
    return pref.reward_head if pref is not None and pref.method == "reward" else "lm"


def with_reference(wl: Workload, training: TrainingSpec) -> Workload:
    """`wl` (the trained model, before training.lora and training.frozen apply) with the
    reference model's forward appended when the preference method runs one (see [Note:
    preference training]); the PEFT reference shares the trained model's base parameters."""
    pref = training.preference
    if pref is None or not pref.runs_reference:
        return wl
    params = list(wl.params)
    shared = training.lora is not None
    own: dict[int, int] = {}

    def ref_param(pid: int) -> int:
        if shared:
            return pid
        if pid not in own:
            p = wl.params[pid]
            params.append(replace(p, name=f"{REFERENCE}.{p.name}", trainable=False))
            own[pid] = len(params) - 1
        return own[pid]

    reference = [_no_grad(m, tuple(ref_param(p) for p in m.params)) for m in wl.modules]
    if not shared:    # params no module uses (a model's registered extras) have their copy too
        for pid in range(len(wl.params)):
            ref_param(pid)
    return replace(wl, params=tuple(params), modules=wl.modules + tuple(reference))


def _no_grad(m: Module, params: tuple[int, ...]) -> Module:
    """`m` as the reference runs it: under no_grad, after the blocks (layer -2), its outputs held
    only while it runs."""
    return replace(m, name=f"{REFERENCE}.{m.name}", layer=-2, params=params,
                   containers=tuple(f"{REFERENCE}.{c}" for c in m.containers),
                   no_grad=True, input_grad=False, weight_grad=False,
                   fwd_workspace_bytes=m.fwd_workspace_bytes + m.act_bytes,
                   act_bytes=0.0, act_bytes_s2=0.0, bwd_flops=0.0, bwd_mem_bytes=0.0, fp32_bwd_mem_bytes=0.0,
                   kernels_bwd=0, bwd_workspace_bytes=0.0)


def reference_engine(wl: Workload) -> frozenset[str]:
    """The modules of the reference copy's own DeepSpeed engine (its own ZeRO-3 coordinator; see
    [Note: a reference engine under ZeRO-3] in zsim/schedule/stage3.py); none for a PEFT reference
    (the trained engine's own modules) or no reference."""
    if not any(is_reference(p) for p in wl.params):
        return frozenset()
    return frozenset(m.name for m in wl.modules if m.no_grad)


def runs_peft_reference(wl: Workload) -> bool:
    """The reference forward runs the trained model's own modules (PEFT, adapters disabled)."""
    return any(m.no_grad for m in wl.modules) and not any(is_reference(p) for p in wl.params)


def is_reference(p: Param) -> bool:
    """A parameter of the reference model's own copy."""
    return p.name.startswith(REFERENCE + ".")


def reference_params(wl: Workload) -> int:
    """Elements of the reference model's own copy (0 for a PEFT reference or none)."""
    return sum(p.numel for p in wl.params if is_reference(p))

