"""One recorded case under torchrun, or every case one after another."""
from __future__ import annotations

import copy
import os
import subprocess
import sys

from calibration.core.measured import exit_without_teardown
from calibration.core.model import GPT
from calibration.deepspeed_record.annotations import install_annotations
from calibration.deepspeed_record.launch import write_fixture
from calibration.deepspeed_record.cases import CASES, MICRO_BATCH, MODEL, OPT_STEPS, WORLD_SIZE
from calibration.deepspeed_record.recorder import MODULE_NAME, PARAM_INDEX, RECORDS, STATE, install_recorder

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ranks_identical() -> bool:
    """Number the records, then compare every rank's trace (identical apart from per-rank
    content); the comparison's own collective is not kept."""
    import torch.distributed as td

    for i, r in enumerate(RECORDS):
        r["idx"] = i

    def _key(r):
        return (r["op"], r["fn"], r["numel"], r["dtype"], r["phase"], r["micro_step"], r["opt_step"])

    mine = [list(_key(r)) for r in RECORDS]
    gathered = [None] * td.get_world_size()
    STATE["phase"] = "post"
    n_before = len(RECORDS)
    td.all_gather_object(gathered, mine)
    del RECORDS[n_before:]
    return all(x == gathered[0] for x in gathered)


def train_steps(engine, gas: int, rows: int, forward, rank: int) -> list[float]:
    """OPT_STEPS optimizer steps of `gas` micro-steps, each `rows` random sequences through
    `forward(idx, tgt) -> loss` (the engine, or a step built on it), the recorder's phases set."""
    import torch

    g = torch.Generator().manual_seed(4321 + rank)
    losses = []
    for s in range(OPT_STEPS):
        for m in range(gas):
            idx = torch.randint(0, MODEL.vocab, (rows, MODEL.seq_len), generator=g)
            tgt = torch.randint(0, MODEL.vocab, (rows, MODEL.seq_len), generator=g)
            STATE.update(opt_step=s, micro_step=m, phase="forward")
            loss = forward(idx, tgt)
            STATE["phase"] = "backward"
            engine.backward(loss)
            STATE["phase"] = "step"
            engine.step()
            STATE.update(phase="post", micro_step=None, opt_step=None)
            losses.append(float(loss.detach().float()))
    return losses


def fixture_doc(name: str, cfg: dict, engine, param_list: list, total_params: int, losses: list[float],
                identical: bool, **extra) -> dict:
    """A recorded case's fixture document (its collectives: RECORDS)."""
    import deepspeed
    import torch
    import torch.distributed as td

    return {
        "case": name,
        "world_size": td.get_world_size(),
        "backend": td.get_backend(),
        "versions": {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                     "python": sys.version.split()[0]},
        "accelerator": type(deepspeed.get_accelerator()).__name__,
        "ds_config": cfg,
        **extra,
        "model": {"vocab": MODEL.vocab, "seq_len": MODEL.seq_len, "layers": MODEL.layers,
                  "hidden": MODEL.hidden, "heads": MODEL.heads, "ffn": MODEL.ffn,
                  "tied_lm_head": MODEL.tied_embeddings, "total_params": total_params},
        "params": param_list,
        "optimizer": {"class": type(engine.optimizer).__name__, "client": "torch.optim.AdamW(lr=1e-3)"},
        "gradient_accumulation_steps": cfg["gradient_accumulation_steps"],
        "optimizer_steps": OPT_STEPS,
        "losses": losses,
        "final_loss": losses[-1],
        "ranks_identical_trace": identical,
        "collectives": RECORDS,
    }


def run_case(name, out_dir):
    install_recorder()

    import torch
    import torch.distributed as td

    rank = int(os.environ["RANK"])
    td.init_process_group("gloo")

    import deepspeed  # noqa: E402  (after the wrappers are installed)

    deepspeed.init_distributed(dist_backend="gloo")

    cfg = copy.deepcopy(CASES[name])
    gas = cfg["gradient_accumulation_steps"]
    model = GPT(MODEL).initialized(seed=1234)
    param_list = [{"index": i, "name": n, "numel": int(p.numel()), "shape": list(p.shape)}
                  for i, (n, p) in enumerate(model.named_parameters())]
    for i, (n, p) in enumerate(model.named_parameters()):
        PARAM_INDEX[id(p)] = i
    for n, m in model.named_modules():
        MODULE_NAME[id(m)] = n or "<root>"
    install_annotations()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    STATE["phase"] = "init"
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    engine.train()

    losses = train_steps(engine, gas, MICRO_BATCH, engine, rank)
    identical = ranks_identical()

    if rank == 0:
        doc = fixture_doc(name, cfg, engine, param_list, sum(p["numel"] for p in param_list), losses, identical)
        path = write_fixture(doc, out_dir, name)
        print(f"[record] {name}: {len(RECORDS)} collectives, identical={identical}, "
              f"loss={losses[-1]:.4f} -> {path}", flush=True)
    td.barrier()
    td.destroy_process_group()
    # Skip interpreter teardown: with gloo + DeepSpeed's shm comm op a background C++
    # thread occasionally aborts at exit ("terminate called without an active
    # exception") after all work is done, which would make torchrun report a failure.
    exit_without_teardown()


def run_all(names, out_dir):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (REPO_ROOT, env.get("PYTHONPATH"))))
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TORCH_EXTENSIONS_DIR", "/work/.torch_ext")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    failed = []
    for n in names:
        cmd = [torchrun, "--standalone", "--nproc-per-node", str(WORLD_SIZE), "-m", "calibration.deepspeed_record",
               "--case", n, "--out", out_dir]
        print("+", " ".join(cmd), flush=True)
        if subprocess.call(cmd, env=env) != 0:
            failed.append(n)
    if failed:
        print("FAILED:", failed)
        sys.exit(1)
