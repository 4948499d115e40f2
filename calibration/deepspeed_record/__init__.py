"""Record the torch.distributed collectives that real DeepSpeed issues for a small GPT.

This is calibration tooling, not part of zsim: it imports torch and deepspeed and is never
imported by the simulator or its tests. It produces the JSON fixtures under
tests/fixtures/deepspeed/ that the simulator's tests compare against. The model is
calibration's one GPT (calibration/core/model.py) built from `cases.MODEL`, the ModelSpec the
fixture tests rebuild (tests/helpers.py scenario_for).

Usage, from the repository root (one case, 2 ranks, CPU/gloo):

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR=/work/.torch_ext \
      /work/venv-ds/bin/torchrun --standalone --nproc-per-node 2 \
      -m calibration.deepspeed_record --case stage2_default --out tests/fixtures/deepspeed

All cases, one after another (spawns torchrun per case):

    /work/venv-ds/bin/python -m calibration.deepspeed_record --all --out tests/fixtures/deepspeed

- cases.py: the ds_configs recorded and the model;
- recorder.py: wrappers on torch.distributed's collectives (installed before deepspeed is
  imported, because deepspeed.comm.torch.TorchBackend captures
  torch.distributed.all_gather_into_tensor / reduce_scatter_tensor at construction time);
- annotations.py: wrappers on a few DeepSpeed internals naming the parameters of each bucket
  and gather and the module of each ZeRO-3 fetch;
- record.py: one case under torchrun, or all cases; summary.py: a compact view of a fixture.
"""
