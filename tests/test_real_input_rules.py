"""Issue 46: odd but real inputs read as DeepSpeed 0.19.8, the HF Trainer and their launchers read them
(1-bit optimizers, trailing commas, QLoRA, reward models, bf16 defaults, tune's answer in the user's format)."""
from __future__ import annotations

import pytest

from tests.helpers import scenario


@pytest.mark.parametrize("name, instead", [("OneBitAdam", "use Adam"), ("zerooneadam", "use Adam"),
                                           ("OneBitLamb", "use Lamb")])
def test_the_1bit_optimizers_deepspeed_removed_are_refused_as_its_engine_refuses_them(name, instead):
    """DeepSpeed 0.19.7 removed them (deepspeedai/DeepSpeed#8490); 0.19.8's deepspeed.initialize
    asserts '<name> is not a supported DeepSpeed Optimizer' (measured: engine.py _do_sanity_check)."""
    with pytest.raises(Exception) as exc:
        scenario(**{"deepspeed.optimizer": {"type": name, "params": {"freeze_step": 400}},
                    "deepspeed.zero_optimization.stage": 0})
    text = str(exc.value)
    assert "deepspeed.optimizer.type" in text and "0.19.7 removed" in text and instead in text
