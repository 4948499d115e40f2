"""A launch command as the user runs it -> a Recipe (zsim.config.trainer_args):
`zsim run -- deepspeed --num_gpus 8 train.py --deepspeed ds.json ...` or a shell script holding
one (`zsim run train.sh`).

Launchers read as their own argument parsers read them: DeepSpeed's runner
(deepspeed/launcher/runner.py: --num_gpus/--num_accelerators per node, --num_nodes, --hostfile
"host slots=N" lines), torchrun and `python -m torch.distributed.run|launch`
(torch/distributed/run.py: --nproc_per_node / --nproc-per-node, default 1; --nnodes, default 1),
`accelerate launch` (accelerate/commands/launch.py: --num_processes is the TOTAL over
--num_machines; --config_file; the DeepSpeed plugin flags), and `python train.py` (one process).
After the launcher's options comes the training script and its flags, read as the HF Trainer's
arguments; a YAML/JSON file given to the script is read as HfArgumentParser reads it, or as the
axolotl / LLaMA-Factory recipe it is (`axolotl train x.yml`, `llamafactory-cli train x.yaml`,
`accelerate launch -m axolotl.cli.train x.yml`). Relative paths resolve against the working
directory the launch runs in: the script's folder for a script, the current one for `--`.
"""
from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from zsim.errors import ZsimInputError
from zsim.config.dschat import is_dschat_step3, read_dschat
from zsim.config.trainer_args import Recipe, as_bool, as_int, read_trainer_args

# Launcher options that change nothing zsim prices, with whether each takes a value
DEEPSPEED_OPTS = {"--master_port": 1, "--master_addr": 1, "--launcher": 1, "--launcher_args": 1, "--include": 1,
                  "--exclude": 1, "-i": 1, "-e": 1, "--no_python": 0, "--no_local_rank": 0, "--no_ssh_check": 0,
                  "--force_multi": 0, "--save_pid": 0, "--enable_each_rank_log": 1, "--autotuning": 1,
                  "--elastic_training": 0, "--min_elastic_nodes": 1, "--max_elastic_nodes": 1, "--ssh_port": 1,
                  "--bind_cores_to_rank": 0, "--bind_core_list": 1, "--comment": 1, "--venv_script": 1,
                  "--node_rank": 1, "--no_ssh": 0, "--module": 0, "-m": 0}
TORCHRUN_OPTS = {"--node_rank": 1, "--master_addr": 1, "--master_port": 1, "--rdzv_backend": 1,
                 "--rdzv_endpoint": 1, "--rdzv_id": 1, "--rdzv_conf": 1, "--standalone": 0, "--max_restarts": 1,
                 "--monitor_interval": 1, "--start_method": 1, "--role": 1, "--log_dir": 1, "--redirects": 1,
                 "-r": 1, "--tee": 1, "-t": 1, "--local_addr": 1, "--run_path": 0, "--no_python": 0,
                 "--module": 0, "-m": 0, "--use_env": 0, "--logs_specs": 1, "--local_ranks_filter": 1,
                 "--local-ranks-filter": 1, "--numa_binding": 1, "--signals_to_handle": 1, "--virtual_local_rank": 0}
ACCELERATE_OPTS = {"--multi_gpu": 0, "--machine_rank": 1, "--main_process_ip": 1, "--main_process_port": 1,
                   "--num_cpu_threads_per_process": 1, "--dynamo_backend": 1, "--same_network": 0,
                   "--rdzv_backend": 1, "--module": 0, "-m": 0, "--no_python": 0, "--debug": 0, "--quiet": 0,
                   "-q": 0, "--gpu_ids": 1, "--main_training_function": 1, "--zero3_init_flag": 1,
                   "--zero3_save_16bit_model": 1, "--deepspeed_multinode_launcher": 1, "--deepspeed_hostfile": 1,
                   "--deepspeed_exclusion_filter": 1, "--deepspeed_inclusion_filter": 1, "--max_restarts": 1,
                   "--monitor_interval": 1, "--tee": 1, "--log_dir": 1, "--role": 1, "--enable_cpu_affinity": 0,
                   "--downcast_bf16": 0, "--mixed_precision_no_fp8": 0}
LAUNCHERS = ("deepspeed", "torchrun", "accelerate", "python", "python3", "llamafactory-cli", "axolotl")
# `python -m MODULE` forms that are launchers
LAUNCH_MODULES = {"torch.distributed.run": "torchrun", "torch.distributed.launch": "torchrun",
                  "deepspeed.launcher.runner": "deepspeed", "accelerate.commands.launch": "accelerate"}
# modules and CLIs whose argument is an axolotl or LLaMA-Factory recipe
RECIPE_MODULES = ("axolotl.cli.train", "axolotl.cli.main", "llamafactory.launcher", "llamafactory.cli")
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def is_launch_script(path: Path) -> bool:
    """A shell script: `.sh`/`.bash`, or a `#!` first line naming a shell."""
    if path.suffix in (".sh", ".bash"):
        return True
    if path.suffix in (".json", ".yaml", ".yml"):
        return False
    try:
        with open(path, "rb") as f:
            first = f.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and any(s in first for s in (b"sh", b"bash", b"zsh"))


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Lines with backslash continuations joined, each with its first line number."""
    out, buf, start = [], "", 0
    for i, line in enumerate(text.splitlines(), 1):
        if not buf:
            start = i
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        out.append((start, buf + line))
        buf = ""
    if buf:
        out.append((start, buf))
    return out


def _expand(word: str, env: dict) -> str:
    def sub(m):
        name = m.group(1) or m.group(3)
        if name in env:
            return env[name]
        if m.group(2) is not None:
            return m.group(2)
        raise KeyError(name)
    return _VAR.sub(sub, word)


def _command_start(words: list[str]) -> int | None:
    """Index of the launcher in a shell command (after VAR=value prefixes, `env`, `exec`, `nohup`)."""
    i = 0
    while i < len(words) and (_ASSIGN.match(words[i]) or words[i] in ("env", "exec", "nohup", "time")):
        i += 1
    if i < len(words) and os.path.basename(words[i]) in LAUNCHERS:
        return i
    return None


def read_script(path: Path) -> tuple[list[str], dict]:
    """The launch command a shell script runs (its words, variables expanded from the script's
    own assignments, then the environment) and the variables set for it."""
    from zsim.inputs import read_text
    text = read_text(path, "launch script", "a shell script holding the launch command")
    env = dict(os.environ)
    line_no, words, prefix = find_launch(text, path, env)
    env.update({k: _expand_or_keep(v, env) for k, v in prefix.items()})
    out = []
    for w in words:
        try:
            out.append(_expand(w, env))
        except KeyError as exc:
            raise ZsimInputError(f"{path.name}:{line_no}", w, f"uses ${exc.args[0]}, which the script and the "
                                 "environment do not set; set it or write the value") from None
    return out, {k: env[k] for k in prefix}


def find_launch(text: str, path: Path, env: dict) -> tuple[int, list[str], dict]:
    """(first line number, words as written, VAR=value prefixes) of the one launch command in a
    script's text; `env` gets the script's own assignments made before it."""
    found: list[tuple[int, list[str], dict]] = []
    for line_no, line in _logical_lines(text):
        try:
            words = shlex.split(line, comments=True)
        except ValueError as exc:
            raise ZsimInputError(f"{path.name}:{line_no}", line.strip()[:60], f"cannot be read as a shell line ({exc})") from None
        if not words:
            continue
        if words[0] == "export":
            words = words[1:]
        start = _command_start(words)
        if start is None:
            if all(_ASSIGN.match(w) for w in words):       # NAME=value lines set variables
                for w in words:
                    name, _, value = w.partition("=")
                    env[name] = _expand_or_keep(value, env)
            continue
        if os.path.basename(words[start]) in ("python", "python3") and not _python_launch(words[start:]):
            continue       # a helper `python x.py` line, not the training launch
        prefix = dict(w.partition("=")[::2] for w in words[:start] if _ASSIGN.match(w))
        found.append((line_no, words[start:], prefix))
    if not found:
        raise ZsimInputError("launch script", str(path), "holds no deepspeed, torchrun, accelerate launch, python -m "
                             "torch.distributed.run, llamafactory-cli or axolotl command")
    if len(found) > 1:
        raise ZsimInputError("launch script", str(path), f"holds {len(found)} launch commands (lines "
                             f"{', '.join(str(n) for n, _, _ in found)}); give one with zsim run -- <command>")
    return found[0]


def _expand_or_keep(value: str, env: dict) -> str:
    try:
        return _expand(value, env)
    except KeyError:
        return value


def _python_launch(words: list[str]) -> bool:
    """`python -m <launcher module>`, or `python train.py` with Trainer flags."""
    if "-m" in words:
        i = words.index("-m")
        return i + 1 < len(words) and (words[i + 1] in LAUNCH_MODULES or words[i + 1] in RECIPE_MODULES)
    return any(w.startswith("--deepspeed") or w.startswith("--per_device_train_batch_size") for w in words)


def _options(words: list[str], i: int, known: dict, takes_value: dict) -> tuple[dict, int, list[str]]:
    """A launcher's options from words[i] up to the training script: (name -> value, index of
    the script, options it ignores). `known` names the options zsim reads, with their arity."""
    got: dict[str, str | bool] = {}
    ignored: list[str] = []
    while i < len(words):
        w = words[i]
        if not w.startswith("-") or w == "-":
            break
        name, eq, value = w.partition("=")
        norm = "--" + name[2:].replace("-", "_") if name.startswith("--") else name
        arity = known.get(norm, takes_value.get(norm, takes_value.get(name)))
        if norm in ("-m", "--module"):
            got["module"] = True
            i += 1
            continue
        if arity is None:       # an option zsim does not know: keep it, with a value if one follows
            ignored.append(name)
            arity = 0 if eq or i + 1 >= len(words) or words[i + 1].startswith("-") else 1
        if arity and not eq:
            if i + 1 >= len(words):
                raise ZsimInputError(name, None, "expects a value")
            value, i = words[i + 1], i + 1
        got[norm] = value if arity else True
        i += 1
    return got, i, ignored


def _hostfile(path: Path) -> tuple[int, int | None]:
    """(hosts, slots of the first host) of a DeepSpeed hostfile (runner.py fetch_hostfile)."""
    from zsim.inputs import read_text
    hosts = []
    for line in read_text(path, "--hostfile", "a DeepSpeed hostfile").splitlines():
        line = line.split("#")[0].strip()
        if line:
            m = re.match(r"^(\S+)\s+slots=(\d+)$", line)
            if not m:
                raise ZsimInputError("--hostfile", line, "expected 'hostname slots=N' lines (DeepSpeed's format)")
            hosts.append(int(m.group(2)))
    if not hosts:
        raise ZsimInputError("--hostfile", str(path), "names no host")
    return len(hosts), hosts[0]


def _count(flag: str, value) -> int:
    n = as_int(flag, value)
    if n < 1:
        raise ZsimInputError(flag, value, "give 1 or more")
    return n


def read_launch(words: list[str], cwd: Path, origin: str, env: dict | None = None) -> Recipe:
    """The Recipe of one launch command (its words as the shell splits them)."""
    from zsim.config import recipes
    env = env or {}
    recipe = Recipe(origin=origin, framework="hf_trainer")
    if not words:
        raise ZsimInputError("launch command", "", "give the command after --, e.g. zsim run -- deepspeed "
                             "--num_gpus 8 train.py --deepspeed ds_config.json --model_name_or_path ID")
    prog = os.path.basename(words[0])
    i = 1
    if prog in ("python", "python3"):
        while i < len(words) and words[i] in ("-u", "-O", "-B"):
            i += 1
        if i + 1 < len(words) and words[i] == "-m" and words[i + 1] in LAUNCH_MODULES:
            prog, i = LAUNCH_MODULES[words[i + 1]], i + 2
        else:
            prog = "python"
    elif prog == "accelerate":
        if len(words) < 2 or words[1] != "launch":
            raise ZsimInputError("launch command", " ".join(words[:2]), "zsim reads `accelerate launch ...`")
        i = 2
    elif prog not in LAUNCHERS:
        raise ZsimInputError("launch command", words[0], "not a launcher zsim reads; give deepspeed, torchrun, "
                             "accelerate launch, python -m torch.distributed.run, python, llamafactory-cli or axolotl")
    ignored: list[str] = []
    if prog == "deepspeed":
        opts, i, ignored = _options(words, i, {"--num_gpus": 1, "--num_accelerators": 1, "--num_nodes": 1,
                                               "--hostfile": 1, "-H": 1}, DEEPSPEED_OPTS)
        hostfile = opts.get("--hostfile") or opts.get("-H")
        hosts = slots = None
        if hostfile:
            hosts, slots = _hostfile(_at(cwd, hostfile))
        gpus = opts.get("--num_gpus", opts.get("--num_accelerators"))
        recipe.gpus_per_node = _count("--num_gpus", gpus) if gpus is not None else slots
        nodes = opts.get("--num_nodes")
        recipe.nodes = _count("--num_nodes", nodes) if nodes is not None else (hosts or 1)
    elif prog == "torchrun":
        opts, i, ignored = _options(words, i, {"--nproc_per_node": 1, "--nnodes": 1}, TORCHRUN_OPTS)
        nproc = opts.get("--nproc_per_node", "1")
        if str(nproc) in ("gpu", "auto", "cpu", "xpu"):
            recipe.notes.append(f"--nproc_per_node {nproc}: one process per local device; give --gpus N")
        else:
            recipe.gpus_per_node = _count("--nproc_per_node", nproc)
        nnodes = str(opts.get("--nnodes", "1"))
        if ":" in nnodes:
            raise ZsimInputError("--nnodes", nnodes, "an elastic range; zsim simulates one world size, give --nodes K")
        recipe.nodes = _count("--nnodes", nnodes)
    elif prog == "accelerate":
        opts, i, ignored = _options(words, i, {"--config_file": 1, "--num_processes": 1, "--num_machines": 1,
                                               "--mixed_precision": 1, "--use_deepspeed": 0, "--use_fsdp": 0,
                                               "--deepspeed_config_file": 1, "--zero_stage": 1,
                                               "--offload_optimizer_device": 1, "--offload_param_device": 1,
                                               "--gradient_accumulation_steps": 1, "--gradient_clipping": 1,
                                               "--cpu": 0, "--tpu": 0, "--use_megatron_lm": 0,
                                               "--use_parallelism_config": 0, "--parallelism_config_sp_size": 1,
                                               "--parallelism_config_sp_backend": 1,
                                               "--parallelism_config_sp_attn_implementation": 1},
                                    ACCELERATE_OPTS)
        recipes.accelerate_launch(opts, cwd, recipe)
    elif prog == "python":
        opts = {}
        recipe.gpus_per_node, recipe.nodes = 1, 1
    elif prog == "llamafactory-cli":
        # v0: `train`; v1 (USE_V1=1, v1/launcher.py _DIST_TRAIN_COMMANDS): the command is the trainer
        if len(words) < 3 or words[1] not in ("train", "sft", "dpo", "rm"):
            raise ZsimInputError("launch command", " ".join(words[:3]), "zsim reads `llamafactory-cli train "
                                 "recipe.yaml` (LLaMA-Factory v1: sft, dpo or rm)")
        _torchrun_env(env, recipe)
        out = _recipe_arg(words[2], words[3:], cwd, recipe)
        if words[1] != "train":
            from zsim.config.llama_factory_v1 import apply_command
            apply_command(out, words[1], " ".join(words[:3]))
        return out
    elif prog == "axolotl":
        if len(words) < 3 or words[1] != "train":
            raise ZsimInputError("launch command", " ".join(words[:3]), "zsim reads `axolotl train recipe.yml`")
        return _recipe_arg(words[2], words[3:], cwd, recipe)
    if ignored:
        recipe.ignored += [f"{prog} {o}" for o in ignored]
    module = prog != "python" and bool(opts.get("module"))
    if prog == "python" and i < len(words) and words[i] == "-m":
        module, i = True, i + 1
    if i >= len(words):
        raise ZsimInputError("launch command", " ".join(words), "names no training script")
    script, rest = words[i], words[i + 1:]
    recipe.script_index = i
    first = rest[0] if rest and not rest[0].startswith("-") else None
    if first and ((module and script in RECIPE_MODULES) or first.endswith((".yaml", ".yml", ".json"))):
        return _recipe_arg(first, rest[1:], cwd, recipe)
    recipe.origin = f"{origin} ({script})"
    flags = script_flags(rest)
    if is_dschat_step3(script, flags):
        return read_dschat(flags, recipe)
    read_trainer_args(flags, recipe)
    if recipe.ds_config is not None:
        recipe.ds_config = _at(cwd, str(recipe.ds_config))
    return recipe


def _recipe_arg(file: str, rest: list[str], cwd: Path, recipe: Recipe) -> Recipe:
    """The YAML/JSON a training script is given: an axolotl or LLaMA-Factory recipe, or the
    HF Trainer's arguments as HfArgumentParser.parse_yaml_file / parse_json_file read them;
    `key=value` words after it override its keys (LLaMA-Factory's and axolotl's CLIs)."""
    from zsim.config import recipes
    path = _at(cwd, file)
    overrides = dict(w.lstrip("-").partition("=")[::2] for w in rest if "=" in w)
    return recipes.read_recipe_file(path, cwd, recipe, overrides)


def _torchrun_env(env: dict, recipe: Recipe):
    """llamafactory-cli's torchrun: NNODES and NPROC_PER_NODE (its default: every visible device)."""
    if env.get("NPROC_PER_NODE"):
        recipe.gpus_per_node = _count("NPROC_PER_NODE", env["NPROC_PER_NODE"])
    if env.get("NNODES"):
        recipe.nodes = _count("NNODES", env["NNODES"])


def script_flags(words: list[str]) -> dict:
    """A script's `--name value...`, `--name=value` and bare `--flag` words as name -> value
    (None for a bare flag, a list for several values); positional words are skipped."""
    out: dict = {}
    name = None
    for w in words:
        if w.startswith("--") and len(w) > 2:
            key, eq, value = w[2:].partition("=")
            name = key.replace("-", "_")
            out[name] = value if eq else None
            if eq:
                name = None
        elif name is not None:
            prev = out[name]
            out[name] = w if prev is None else (prev + [w] if isinstance(prev, list) else [prev, w])
    return out


def _at(cwd: Path, ref: str) -> Path:
    p = Path(os.path.expanduser(ref))
    return p if p.is_absolute() else cwd / p


def bool_flag(opts: dict, name: str) -> bool:
    return name in opts and as_bool(name, None if opts[name] is True else opts[name])
