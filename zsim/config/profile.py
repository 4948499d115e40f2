"""Hardware profile loader: a name in hardware_profiles/ or a path to a YAML file, plus the
scenario's `hardware.override`, -> a HardwareProfile (zsim.specs.hardware)."""
from __future__ import annotations

from pathlib import Path

from zsim.errors import ZsimInputError, did_you_mean
from zsim.inputs import parse_yaml, read_text
from zsim.schema import build
from zsim.specs.hardware import HardwareProfile


def profiles_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "hardware_profiles"


def available_profiles() -> list[str]:
    return sorted(p.stem for p in profiles_dir().glob("*.yaml"))


def read_profile_mapping(ref: str, base_dir: Path | None = None) -> tuple[dict, str]:
    """Return the raw mapping of a profile named `ref` (a name in hardware_profiles/ or a path)."""
    candidates = []
    p = Path(ref)
    if p.suffix in (".yaml", ".yml"):
        candidates.append(p if p.is_absolute() or base_dir is None else base_dir / p)
        candidates.append(p)
    else:
        candidates.append(profiles_dir() / f"{ref}.yaml")
    for c in candidates:
        if c.is_file():
            return _parsed(c) or {}, str(c)
    names = available_profiles()
    if p.suffix not in (".yaml", ".yml") and ("/" in ref or p.exists()):
        raise ZsimInputError("hardware.profile", ref, "a profile is a name or the path of a .yaml/.yml file; give one "
                             f"of {', '.join(names)} or a profile YAML")
    raise ZsimInputError("hardware.profile", ref,
                         f"no such profile{did_you_mean(ref, names)}; available: {', '.join(names)} or a path to a .yaml file")


def _parsed(path: Path) -> dict | None:
    # parse_yaml keeps the parse of each text: tune, doctor and sweeps resolve hundreds of
    # variants of one scenario, and parsing its profile's YAML was most of each resolution
    data = parse_yaml(read_text(path, "hardware.profile", "a hardware profile YAML"), "hardware.profile", str(path))
    if data is not None and not isinstance(data, dict):
        raise ZsimInputError("hardware.profile", str(path), "a profile must be a mapping of keys to values")
    if data and "gpu" not in data and ("model" in data or "training" in data or "deepspeed" in data):
        raise ZsimInputError("hardware.profile", str(path), "is a scenario, not a hardware profile; give a profile "
                             "name or a profile YAML (hardware_profiles/)")
    return data


def deep_merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in (override or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def load_profile(ref: str, override: dict | None = None, base_dir: Path | None = None) -> HardwareProfile:
    data, where = read_profile_mapping(ref, base_dir)
    merged = deep_merge(data or {}, override or {})
    try:
        return build(HardwareProfile, merged, "hardware.override" if override else "hardware.profile")
    except ZsimInputError as err:
        if override:
            raise
        raise ZsimInputError(f"{where}: {err.field}", err.value, err.fix) from None
