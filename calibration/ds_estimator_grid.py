"""Record DeepSpeed's model-state memory estimators over a grid, for tests/workload/test_memory_estimate.py.

Run with the DeepSpeed environment (CI has no deepspeed, so the outputs are committed):
    DS_ACCELERATOR=cpu /work/venv-ds/bin/python calibration/ds_estimator_grid.py tests/fixtures/ds_estimator_grid.json

Records (1) estimate_zero2_model_states_mem_needs and estimate_zero3_model_states_mem_needs
(deepspeed 0.19.8, runtime/zero/stage_1_and_2.py:4017, stage3.py:4016) over a grid of inputs and
(2) model_to_params (the "live" wrappers' counting) on small torch models with the module tree
zsim's workload builder assumes (GPT-2 style and Llama style).
"""
import itertools
import json
import sys

import torch
from torch import nn

import deepspeed
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage3 import model_to_params as zero3_model_to_params
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import model_to_params as zero2_model_to_params

TOTALS = [(1, 1), (124_439_808, 38_597_376), (999_999_937, 12_345_677), (1_557_611_200, 80_411_200),
          (6_738_415_616, 131_072_000), (13_015_864_320, 163_840_000), (70_553_706_496, 1_050_673_152),
          (176_247_271_424, 3_596_615_680)]


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, f, kv = c["hidden"], c.get("ffn_hidden") or 4 * c["hidden"], c.get("kv_heads") or c["heads"]
        kvd = kv * h // c["heads"]
        bias = c.get("bias", True)
        norm = (lambda: nn.LayerNorm(h)) if c.get("norm", "layernorm") == "layernorm" else (lambda: nn.RMSNorm(h))
        self.ln_1, self.ln_2 = norm(), norm()
        if c.get("fused_qkv", True):
            self.qkv = nn.Linear(h, h + 2 * kvd, bias=bias)
        else:
            self.q_proj, self.k_proj = nn.Linear(h, h, bias=bias), nn.Linear(h, kvd, bias=bias)
            self.v_proj = nn.Linear(h, kvd, bias=bias)
        self.o_proj = nn.Linear(h, h, bias=bias)
        if c.get("glu", False):
            self.gate_proj, self.up_proj = nn.Linear(h, f, bias=bias), nn.Linear(h, f, bias=bias)
        else:
            self.fc_in = nn.Linear(h, f, bias=bias)
        self.fc_out = nn.Linear(f, h, bias=bias)


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        h = c["hidden"]
        self.wte = nn.Embedding(c["vocab"], h)
        if c.get("position", "learned") == "learned":
            self.wpe = nn.Embedding(c["seq_len"], h)
        self.layers = nn.ModuleList(Block(c) for _ in range(c["layers"]))
        self.ln_f = nn.LayerNorm(h) if c.get("norm", "layernorm") == "layernorm" else nn.RMSNorm(h)
        self.lm_head = nn.Linear(h, c["vocab"], bias=False)
        if c.get("tied_embeddings", True):
            self.lm_head.weight = self.wte.weight


MODELS = [
    dict(layers=2, hidden=64, heads=4, vocab=1000, seq_len=128),
    dict(layers=3, hidden=96, heads=6, vocab=50, seq_len=4096),            # position table is the largest layer
    dict(layers=2, hidden=64, heads=4, vocab=500, seq_len=128, tied_embeddings=False),
    dict(layers=2, hidden=128, heads=8, kv_heads=2, vocab=300, seq_len=256, position="rope", norm="rmsnorm",
         bias=False, glu=True, fused_qkv=False, tied_embeddings=False, ffn_hidden=352),
    dict(layers=1, hidden=256, heads=4, vocab=64, seq_len=64, ffn_hidden=2048),  # an MLP projection is the largest
]


def main(out: str) -> int:
    zero2 = []
    for (total, _), gpn, nodes, off, factor in itertools.product(TOTALS, (1, 8, 16), (1, 4), (True, False), (1.5, 1.0)):
        cpu, gpu = estimate_zero2_model_states_mem_needs(total, gpn, nodes, off, factor)
        zero2.append(dict(total_params=total, num_gpus_per_node=gpn, num_nodes=nodes, cpu_offload=off,
                          additional_buffer_factor=factor, cpu_bytes=cpu, gpu_bytes=gpu))
    zero3 = []
    for (total, largest), gpn, nodes, off, off_p, zinit in itertools.product(
            TOTALS, (1, 8), (1, 4), (True, False), (True, False), (True, False)):
        cpu, gpu, llm = estimate_zero3_model_states_mem_needs(total, largest, gpn, nodes, off, off_p, zinit, 1.5)
        zero3.append(dict(total_params=total, largest_layer_params=largest, num_gpus_per_node=gpn, num_nodes=nodes,
                          cpu_offload=off, cpu_offload_params=off_p, zero_init=zinit, additional_buffer_factor=1.5,
                          cpu_bytes=cpu, gpu_bytes=gpu, largest_layer_bytes=llm))
    live = []
    torch.manual_seed(0)
    for c in MODELS:
        m = Model(c)
        total3, largest = zero3_model_to_params(m)
        live.append(dict(model=c, total_params=total3, largest_layer_params=largest,
                         zero2_total_params=zero2_model_to_params(m)))
    data = {"deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__,
            "zero2": zero2, "zero3": zero3, "live": live}
    with open(out, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {out}: {len(zero2)} zero2 + {len(zero3)} zero3 cases, {len(live)} live models")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/ds_estimator_grid.json"))
