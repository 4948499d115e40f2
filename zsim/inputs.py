"""Reading the user's files: text, YAML and JSON, refused in one line when they cannot be read.

Every reader of a user-supplied file (scenario, ds_config, hardware profile, a results file for
`zsim plot`) goes through here, so a binary file, a directory or a pathologically nested document
gives a ZsimInputError naming the file instead of a UnicodeDecodeError or RecursionError.
"""
from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from zsim.errors import ZsimInputError

# The deepest nesting any zsim input needs is about 6 levels (deepspeed.zero_optimization.
# offload_optimizer.device; a profile's efficiency_by_collective table is 5). 64 leaves room for
# ds_config blocks zsim ignores while keeping every recursive reader (yaml, json, deepcopy, the
# strict validator) far from Python's recursion limit (1000 frames).
MAX_NESTING = 64


def mapping_or_empty(value) -> dict:
    """`value` when it is a mapping, else {} (a block a file may leave out or write as null)."""
    return value if isinstance(value, dict) else {}


def read_text(path: Path, field: str, what: str) -> str:
    """The file's text; `field` names the argument or key it came from, `what` the kind of file."""
    if not path.is_file():
        try:
            kind = ("is a directory" if path.is_dir() else "is not a regular file" if path.exists() else "file not found")
        except (OSError, ValueError):
            kind = "file not found"
        raise ZsimInputError(field, str(path), f"{kind}; give the path of {what}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ZsimInputError(field, str(path), f"not a text file (byte {exc.start} is not UTF-8); give {what}") from None


def nesting_depth(data, limit: int = MAX_NESTING) -> int:
    """Depth of nested mappings/lists (iterative, so it cannot itself overflow the stack); stops
    counting once past `limit`."""
    deepest, todo = 0, [(data, 0)]
    while todo:
        node, depth = todo.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        todo.extend((child, depth + 1) for child in children)
    return deepest


def too_deep(field: str, value: object) -> ZsimInputError:
    return ZsimInputError(field, value, f"nested more than {MAX_NESTING} levels deep; zsim inputs need at most 6 "
                          "(the limit keeps every reader within Python's recursion limit)")


def check_nesting(data, field: str, value: object) -> None:
    if nesting_depth(data) > MAX_NESTING:
        raise too_deep(field, value)


def parse_yaml(text: str, field: str, value: object):
    """yaml.safe_load with syntax and nesting errors as one line. Raises yaml.YAMLError's
    position, or RecursionError's, as a ZsimInputError naming `field`. Each text is parsed once
    per process (_safe_load); every call returns a fresh copy."""
    try:
        data = _safe_load(text)
    except DuplicateKey as exc:
        raise ZsimInputError(field, value, f"has the key '{exc.key}' twice (lines {exc.lines[0]} and {exc.lines[1]}); "
                             "keep one (DeepSpeed refuses duplicate keys too)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ZsimInputError(field, value, f"not valid YAML{where}; fix the syntax") from None
    except RecursionError:
        raise too_deep(field, value) from None
    check_nesting(data, field, value)
    return copy.deepcopy(data)   # a copy of the kept parse: callers edit what they are given


# Kept by the document's text, so an edited file is parsed afresh: `zsim run` reads its scenario
# twice (is it a ds_config? then the load), tune, doctor and sweeps resolve hundreds of variants of
# one scenario and its profile, and the pure-Python parser takes about 10 ms for a 4 KB profile.
@functools.lru_cache(maxsize=32)
def _safe_load(text: str):
    return yaml.load(text, Loader=_UniqueKeyLoader)


class DuplicateKey(yaml.YAMLError):
    def __init__(self, key: str, lines: tuple[int, int]):
        super().__init__(f"duplicate key {key!r}")
        self.key, self.lines = key, lines


if TYPE_CHECKING:
    _SafeLoader = yaml.SafeLoader
else:     # libyaml's loader where PyYAML was built with it
    _SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _UniqueKeyLoader(_SafeLoader):
    """yaml.safe_load (libyaml's parser where installed, several times faster than the pure-Python
    one) that refuses a mapping with a key twice, where PyYAML keeps the last silently: a user's
    second `zero_optimization:` block would otherwise replace the first without a word.
    DeepSpeed loads its config with object_pairs_hook=dict_raise_error_on_duplicate_keys
    (runtime/config.py, config_utils.py). Merge keys (<<) may still be overridden, as YAML says."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = (key_node.tag, key_node.value)
                if key in seen:
                    raise DuplicateKey(key_node.value, (seen[key], key_node.start_mark.line + 1))
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


# [Note: trailing commas in a ds_config] Who reads the file decides: DeepSpeed's own loader
# (runtime/config.py DeepSpeedConfig: hjson.load, hjson 3.1) accepts a comma before a closing }
# or ], while the HF Trainer (transformers integrations/deepspeed.py HfDeepSpeedConfig) and
# accelerate read the file with json.load, which refuses it. Measured with hjson 3.1.0: one comma
# after a value before } or ] (whitespace between allowed) parses as if absent; two commas, `{,}`
# and `[,]` are refused. That rule, applied outside strings, is drop_trailing_commas; a ds_config
# read with it is a TrailingCommaJSON, which zsim/config/scenario.py refuses under the HF Trainer
# and notes otherwise. hjson's other extensions (comments, unquoted keys and strings) stay refused.
class TrailingCommaJSON(dict):
    """A JSON object that json.load refuses only for trailing commas; `first` is the first one's
    (line, column), `field`/`value` what the file was given as."""
    first: tuple[int, int]
    field: str
    value: object

    def refusal(self, reader: str) -> ZsimInputError:
        line, column = self.first
        return ZsimInputError(self.field, self.value, f"not valid JSON at line {line}, column {column}: a trailing "
                              f"comma, which json.load refuses ({reader}; DeepSpeed's own hjson reader would accept "
                              "it); remove the comma")


def drop_trailing_commas(text: str) -> tuple[str, tuple[int, int] | None]:
    """`text` without the commas hjson ignores (see [Note: trailing commas in a ds_config]), and the
    first one's (line, column), 1-based; None when there is none."""
    out, first, in_string, escaped, last = [], None, False, False, ""
    for i, ch in enumerate(text):
        if in_string:
            in_string = not (ch == '"' and not escaped)
            escaped = ch == "\\" and not escaped
        elif ch == '"':
            in_string = True
        elif ch == "," and last not in ("", "{", "[", ","):
            rest = text[i + 1:].lstrip()
            if rest[:1] in ("}", "]"):
                if first is None:
                    first = (text.count("\n", 0, i) + 1, i - text.rfind("\n", 0, i))
                last = ","
                continue
        out.append(ch)
        if not ch.isspace():
            last = ch if not in_string or ch == '"' else '"'
    return "".join(out), first


def parse_json(text: str, field: str, value: object, trailing_commas: bool = False):
    """json.loads with its errors as one line naming `field`. `trailing_commas`: the file is a
    ds_config, which hjson (DeepSpeed's reader) may read past trailing commas: such a file comes
    back as a TrailingCommaJSON for the loader to judge by its reader; otherwise it is refused."""
    def non_finite(word: str):
        # Python's json reads NaN/Infinity, which JSON does not have and no zsim number may be
        raise ZsimInputError(field, value, f"holds {word}, which is not JSON; give finite numbers")
    def unique(pairs):
        out = {}
        for k, v in pairs:
            if k in out:
                # DeepSpeed's own loader refuses it (runtime/config_utils.py dict_raise_error_on_duplicate_keys)
                raise ZsimInputError(field, value, f"has the key '{k}' twice in one object; keep one")
            out[k] = v
        return out
    try:
        data = json.loads(text, parse_constant=non_finite, object_pairs_hook=unique)
    except json.JSONDecodeError as exc:
        stripped, first = drop_trailing_commas(text)
        if first is not None:
            try:
                parsed = json.loads(stripped, parse_constant=non_finite, object_pairs_hook=unique)
            except (json.JSONDecodeError, RecursionError):
                parsed = None
            if trailing_commas and isinstance(parsed, dict):
                data = TrailingCommaJSON(parsed)
                data.first, data.field, data.value = first, field, value
                check_nesting(data, field, value)
                return data
            if parsed is not None:
                raise ZsimInputError(field, value, f"not valid JSON at line {first[0]}, column {first[1]}: a trailing "
                                     "comma, which json.load refuses; remove the comma") from None
        raise ZsimInputError(field, value, f"not valid JSON at line {exc.lineno}, column {exc.colno} ({exc.msg}); "
                             "fix the file") from None
    except RecursionError:
        raise too_deep(field, value) from None
    check_nesting(data, field, value)
    return data
