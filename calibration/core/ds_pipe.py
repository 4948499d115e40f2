"""A pipelined scenario on DeepSpeed 0.19.8's own PipelineEngine (`zsim validate --engine
deepspeed` with parallelism.pipeline > 1), measured as calibration/core/run.py measures the own
core: one `train_batch` per optimizer step (its 1F1B TrainSchedule over the scenario's GAS
micro-batches), the sends, recvs and collectives of the last timed step per rank, peak tensor
memory per rank.

The model is calibration/core/model.py's GPT with the own core's initial values and data,
handed to PipelineModule as its layers as calibration/deepspeed_record/pipeline.py does (the
embedding with the positions, the blocks, the final norm, the head; the loss as loss_fn), cut
by the scenario's partition_method. Each rank keeps only its stage's parameters (the other
layers' storage is dropped after the build, as LayerSpec would never have built them).
"""
from __future__ import annotations


def unsupported(sc) -> str | None:
    """Why this module cannot build the scenario's model as a PipelineModule (None when it can)."""
    m = sc.model
    if m.tied_embeddings:
        return "model.tied_embeddings (the PipelineModule here is untied; set model.tied_embeddings=false)"
    if m.position != "learned" or m.embed_proj_dim or m.post_layernorm or m.moe is not None \
            or sc.training.lora is not None:
        return "this model (a pre-LN GPT with learned positions, no MoE or LoRA, is built as a PipelineModule)"
    return None


def main(args, sc) -> int:
    from calibration.core.peers import RECORD, _optimizer, ds_config, install_recorder

    install_recorder()
    import torch

    import deepspeed
    from deepspeed.pipe import PipelineModule

    from calibration.core.measured import measure_steps
    from calibration.core.model import GPT, batch, cross_entropy, pipeline_layers

    why = unsupported(sc)
    if why:
        raise SystemExit(f"--engine deepspeed with a pipeline does not run {why}")
    deepspeed.init_distributed(dist_backend="gloo")
    gpt = GPT(sc.model).initialized(args.seed)
    module = PipelineModule(layers=pipeline_layers(gpt), loss_fn=cross_entropy, num_stages=sc.pipeline_stages,
                            partition_method=sc.parallelism.partition_method)
    mine = {id(p) for p in module.parameters()}
    with torch.no_grad():
        for p in gpt.parameters():
            if id(p) not in mine:
                p.data = torch.empty(0)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=_optimizer(sc, list(module.parameters())),
                                           config=ds_config(sc))
    _log_instruction_phases(engine, RECORD)
    dp_rank = engine.grid.get_data_parallel_rank()
    gas = sc.gradient_accumulation_steps

    def train_step(step: int, phases=None) -> list[float]:
        """One train_batch (its passes interleave: no phase times)."""
        data = iter([batch(sc, step, micro, dp_rank, args.seed) for micro in range(gas)])
        return [float(engine.train_batch(data_iter=data))]

    measure_steps(args, sc, args.engine, train_step, RECORD)


# the pass each TrainSchedule instruction counts in, as zsim's ops of it (ir.MEASURED_PASS):
# ReduceTiedGrads and ReduceGrads are the backward's, OptimizerStep (with the gradient norm's
# all-reduces) and the loss aggregation after it the step's
_PHASE = {"LoadMicroBatch": "forward", "ForwardPass": "forward", "SendActivation": "forward",
          "RecvActivation": "forward", "BackwardPass": "backward", "SendGrad": "backward", "RecvGrad": "backward",
          "ReduceTiedGrads": "backward", "ReduceGrads": "backward", "OptimizerStep": "step"}


def _log_instruction_phases(engine, record):
    """Tag each logged call with the pass of the instruction that issues it: the engine looks its
    instructions up in self._INSTRUCTION_MAP (pipe/engine.py _exec_schedule), so an instance
    attribute of wrapped functions sets the phase first."""
    def tagged(fn, phase):
        def run(self, *args, **kwargs):
            record["phase"] = phase
            return fn(self, *args, **kwargs)
        return run

    engine._INSTRUCTION_MAP = {cls: tagged(fn, _PHASE[cls.__name__]) for cls, fn in type(engine)._INSTRUCTION_MAP.items()}
