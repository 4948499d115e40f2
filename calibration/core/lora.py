"""PEFT's LoRA on the one torch GPT (calibration/core/model.py): the module tree get_peft_model
makes (peft 0.21 tuners/lora/layer.py lora.Linear, utils/other.py ModulesToSaveWrapper), for the
targets zsim's workload chose (zsim/workload/lora.py is the one home of the matching rules), and
requires_grad as the workload's Param.trainable. The training core runs it segment by segment
(its adapters are leaves like any Linear); the DeepSpeed reference wraps the GPT with PEFT
itself (calibration/core/peers.py) and checks it gets the same tree.
"""
from __future__ import annotations

import copy

import torch.nn as nn

from calibration.core.model import GPT, Graph, Linear


class LoraB(Linear):
    """PEFT's lora_B: its output, scaled by alpha/r, is added to the base layer's (peft
    tuners/lora/layer.py Linear.forward: result + lora_B(lora_A(dropout(x))) * scaling)."""

    def __init__(self, n_in: int, n_out: int, scaling: float):
        super().__init__(n_in, n_out, False)
        self.scaling = scaling

    def run(self, ws, linear, a, base_out):
        return base_out + linear(a, ws[0]) * self.scaling


class LoraLinear(Graph):
    """PEFT's lora.Linear around a target: base_layer, then lora_A.default and lora_B.default
    (ModuleDicts keyed by adapter name), registered and run in that order."""

    def __init__(self, base: Linear, rank: int, scaling: float, inputs: tuple[str, ...]):
        super().__init__(inputs, "out")
        n_out, n_in = base.weight.shape
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": Linear(n_in, rank, False)})
        self.lora_B = nn.ModuleDict({"default": LoraB(rank, n_out, scaling)})
        self.steps = [("base_layer", inputs, "y"), ("lora_A.default", inputs[:1], "a"),
                      ("lora_B.default", ("a", "y"), "out")]


class SavedCopy(Graph):
    """PEFT's ModulesToSaveWrapper: the frozen original_module stays registered, the trainable
    copy modules_to_save.default runs: a deepcopy, as PEFT makes it (so a tied weight's copy is
    its own)."""

    def __init__(self, original: nn.Module, inputs: tuple[str, ...]):
        super().__init__(inputs, "out")
        self.original_module = original
        self.modules_to_save = nn.ModuleDict({"default": copy.deepcopy(original)})
        self.steps = [("modules_to_save.default", inputs, "out")]


def peft_wrap(gpt: GPT, wl, lora) -> GPT:
    """`gpt` rewritten as get_peft_model rewrites an HF model, for the targets and saved modules
    zsim's workload chose (zsim/workload/lora.py is the one home of the matching rules)."""
    names = [m.name for m in wl.modules]
    wrap = {n.rsplit(".lora_A.default", 1)[0]: "lora" for n in names if n.endswith(".lora_A.default")}
    wrap.update({n.rsplit(".modules_to_save.default", 1)[0]: "save" for n in names
                 if n.endswith(".modules_to_save.default")})
    for path, how in wrap.items():
        parent_path, _, leaf = path.rpartition(".")
        parent = gpt.get_submodule(parent_path) if parent_path else gpt
        inputs = next(ins for name, ins, _ in parent.steps if name == leaf)
        inputs = tuple(f"in{i}" for i in range(len(inputs)))
        base = getattr(parent, leaf)
        setattr(parent, leaf, LoraLinear(base, lora.rank, lora.alpha / lora.rank, inputs) if how == "lora"
                else SavedCopy(base, inputs))
    return gpt


def for_training(gpt: GPT, sc, wl) -> GPT:
    """`gpt` as the scenario trains it: PEFT's LoRA modules (training.lora) and requires_grad off
    for frozen params; its parameters are then the workload's, name for name."""
    if sc.training.lora is not None:
        peft_wrap(gpt, wl, sc.training.lora)
    named = list(gpt.named_parameters())
    if [n for n, _ in named] != [p.name for p in wl.params]:
        raise ValueError("the GPT's parameters do not mirror the workload's")
    for (_, p), wp in zip(named, wl.params):
        p.requires_grad_(wp.trainable)
    return gpt
