"""Record DeepSpeed 0.19.8's collectives for TRL's DPO step (see [Note: preference training] in
zsim/workload/preference.py) on CPU/gloo: the trained model's engine and the reference model's
engine as TRL builds them, run as TRL's DPOTrainer runs them.

Calibration tooling (imports torch and deepspeed; never imported by zsim or its tests). The same
model, recorder and fixture format as calibration/deepspeed_record (cases.MODEL, recorder.py,
annotations.py, record.write_fixture); what TRL 1.16 does, read from its source:
- trl/models/utils.py prepare_deepspeed: the reference engine is deepspeed.initialize(model=ref,
  config=<the trainer's ds_config, deep-copied>) with no optimizer (its dotted
  "zero_optimization.*" updates land as top-level keys DeepSpeed ignores, so the engine runs the
  trainer's ZeRO-3 settings; a stage below 3 becomes 0), then ref.eval();
- trl/trainer/dpo_trainer.py: concatenated_forward runs the trained engine on the chosen and the
  rejected sequences concatenated along the batch (2 x micro-batch rows), then
  compute_ref_log_probs runs the reference engine on the same rows under torch.no_grad, then
  the loss, engine.backward, engine.step.
The DPO loss itself is a few scalar ops on per-sequence log-probs; the recorder's model returns
its cross-entropy, which reads the same modules (the collectives do not depend on the loss).

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR=/tmp/dsext \\
      /tmp/dsvenv/bin/torchrun --standalone --nproc-per-node 2 \\
      -m calibration.deepspeed_record.dpo --case stage3_dpo --out tests/fixtures/deepspeed_dpo
"""
from __future__ import annotations

import argparse
import copy
import os

from calibration.deepspeed_record.cases import CASES, MICRO_BATCH, MODEL

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# case -> the recorded trainer ds_config (a case of cases.py) under DPO with a frozen reference
# copy, or (a _lora case) under PEFT LoRA with the adapters disabled for the reference forward
DPO_CASES = {"stage3_dpo": "stage3_default", "stage3_dpo_prefetch_0_reuse_0": "stage3_prefetch_0_reuse_0",
             "stage3_dpo_lora": "stage3_default", "stage3_dpo_lora_prefetch_0_reuse_0": "stage3_prefetch_0_reuse_0"}
# the LoRA cases' adapters (PEFT LoraConfig; zsim's training.lora reads the same names)
LORA = {"rank": 8, "alpha": 16.0, "target_modules": ["qkv", "o_proj", "fc_in", "fc_out"]}


def run_case(name: str, out_dir: str):
    from calibration.core.measured import exit_without_teardown
    from calibration.core.model import GPT
    from calibration.deepspeed_record.annotations import install_annotations
    from calibration.deepspeed_record.record import fixture_doc, ranks_identical, train_steps, write_fixture
    from calibration.deepspeed_record.recorder import MODULE_NAME, PARAM_INDEX, RECORDS, STATE, install_recorder

    install_recorder()
    import torch
    import torch.distributed as td

    rank = int(os.environ["RANK"])
    td.init_process_group("gloo")
    import deepspeed  # noqa: E402  (after the wrappers are installed)

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = copy.deepcopy(CASES[DPO_CASES[name]])
    lora = name.startswith("stage3_dpo_lora")
    policy = GPT(MODEL).initialized(seed=1234)
    reference = None
    if lora:
        # TRL with a PeftModel and no ref_model: the reference is the same model, adapters disabled
        from peft import LoraConfig, get_peft_model
        policy = get_peft_model(policy, LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"],
                                                   target_modules=LORA["target_modules"]))
        named = [(n.removeprefix("base_model.model."), p) for n, p in policy.named_parameters()]
    else:
        reference = GPT(MODEL).initialized(seed=1234)      # create_reference_model: a frozen copy
        for p in reference.parameters():
            p.requires_grad_(False)
        named = list(policy.named_parameters()) + [(f"reference.{n}", p) for n, p in reference.named_parameters()]
    param_list = [{"index": i, "name": n, "numel": int(p.numel()), "shape": list(p.shape)}
                  for i, (n, p) in enumerate(named)]
    for i, (_, p) in enumerate(named):
        PARAM_INDEX[id(p)] = i
    for n, m in policy.named_modules():
        MODULE_NAME[id(m)] = n or "<root>"
    if reference is not None:
        for n, m in reference.named_modules():
            MODULE_NAME[id(m)] = f"reference.{n}" if n else "reference"
    install_annotations()
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)

    STATE["phase"] = "init"
    engine, _, _, _ = deepspeed.initialize(model=policy, optimizer=opt, config=cfg)
    ref_cfg = copy.deepcopy(cfg)
    if ref_cfg["zero_optimization"]["stage"] != 3:
        ref_cfg["zero_optimization"]["stage"] = 0
    if reference is not None:
        ref_engine, *_ = deepspeed.initialize(model=reference, config=ref_cfg)
        ref_engine.eval()

        def reference_forward(idx, tgt):
            return ref_engine(idx, tgt)
    else:
        def reference_forward(idx, tgt):      # trl null_ref_context: model.disable_adapter()
            with engine.module.disable_adapter():
                return engine(idx, tgt)
    engine.train()

    def dpo_forward(idx, tgt):
        """The trained model on the chosen and rejected rows, then the reference on the same rows
        without grad; the loss reads both (the collectives do not depend on its formula)."""
        loss = engine(idx, tgt)
        with torch.no_grad():
            ref_loss = reference_forward(idx, tgt)
        return loss - ref_loss.detach()

    losses = train_steps(engine, cfg["gradient_accumulation_steps"], 2 * MICRO_BATCH, dpo_forward, rank)
    identical = ranks_identical()
    if rank == 0:
        doc = fixture_doc(name, cfg, engine, param_list, sum(p.numel() for p in GPT(MODEL).parameters()), losses,
                          identical, reference_ds_config=None if lora else ref_cfg, preference={"method": "dpo"},
                          **({"lora": LORA} if lora else {}))
        path = write_fixture(doc, out_dir, name)
        print(f"[record] {name}: {len(RECORDS)} collectives -> {path}", flush=True)
    td.barrier()
    td.destroy_process_group()
    exit_without_teardown()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=sorted(DPO_CASES), required=True)
    ap.add_argument("--out", default=os.path.join(REPO_ROOT, "tests", "fixtures", "deepspeed_dpo"))
    a = ap.parse_args()
    run_case(a.case, os.path.abspath(a.out))


if __name__ == "__main__":
    main()
