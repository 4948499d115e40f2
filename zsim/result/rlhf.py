"""The typed result of one simulated PPO iteration of DeepSpeed-Chat's step 3 (zsim/rlhf.py)."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class RlhfPhase:
    """One phase of the iteration, as each GPU runs it: `runs` times an iteration, `time_s` each."""
    name: str
    engine: str              # which engine runs it and how (ZeRO stage, hybrid engine, ...)
    runs: float
    time_s: float
    total_s: float           # runs x time_s
    peak_bytes: float        # per GPU: the phase's own peak with every engine's resident states
    fits: bool


@dataclass(frozen=True)
class PipelineStep:
    """One step of DeepSpeed-Chat's pipeline over its share of the data, one epoch."""
    name: str
    samples: int             # rows of its data share (step 2: pairs; step 3: prompts)
    steps: float             # optimizer steps (step 3: PPO iterations)
    step_time_s: float
    total_s: float
    peak_bytes: float
    fits: bool


@dataclass(frozen=True)
class Rlhf:
    scenario: str
    gpus: int
    actor_params: int
    critic_params: int
    generation_batch_size: int        # per GPU
    training_batch_size: int
    prompt_len: int
    answer_len: int
    generation_batches: int
    ppo_epochs: int
    hybrid_engine: bool
    phases: tuple[RlhfPhase, ...]
    iteration_time_s: float
    generation_share: float           # of the iteration, the generation's
    generated_tokens_per_s: float     # all GPUs' answers, over the iteration's generation time
    samples_per_s: float              # prompts (experiences) of all GPUs per second of iteration
    resident_bytes: dict[str, float]  # per GPU, per engine: its states held through the iteration
    host_bytes_per_node: float        # offloaded states and pinned buffers of every engine
    host_capacity_bytes: float
    peak_bytes: float
    capacity_bytes: float
    fits: bool
    suggestions: tuple[str, ...]      # doctor: variants that fit or run faster, as --set assignments
    pipeline: tuple[PipelineStep, ...] = ()   # rlhf.pipeline: steps 1, 2 and 3 over one epoch each
    pipeline_time_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)
