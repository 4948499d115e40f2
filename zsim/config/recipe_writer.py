"""`zsim tune --write` on a recipe: the user's axolotl or LLaMA-Factory YAML with only the keys the
tuned configuration changes, written beside it as NAME.tuned.yaml (the user's file is never
replaced). The keys are edited line by line, so the comments, the order and every other key stay
as written (a PyYAML round trip would drop the comments): a top-level `key: value` line gets the
new value (its trailing comment kept), a key the recipe lacks is appended.

What each recipe calls the tuned settings (axolotl/utils/schemas/config.py; LLaMA-Factory's
Seq2SeqTrainingArguments and ModelArguments): the micro-batch, the gradient accumulation steps,
activation checkpointing (LLaMA-Factory's is on unless disable_gradient_checkpointing) and the
ds_config path.
"""
from __future__ import annotations

import json
import re

RECIPE_KEYS = {
    "axolotl": {"micro_batch": "micro_batch_size", "gas": "gradient_accumulation_steps",
                "checkpointing": "gradient_checkpointing", "deepspeed": "deepspeed"},
    "llama_factory": {"micro_batch": "per_device_train_batch_size", "gas": "gradient_accumulation_steps",
                      "checkpointing": "disable_gradient_checkpointing", "deepspeed": "deepspeed"},
}
WRITABLE = tuple(RECIPE_KEYS)


def _scalar(value) -> str:
    """A YAML scalar: numbers and booleans as YAML writes them, a plain path as is, any other
    string as a JSON string (valid YAML)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    text = str(value)
    return text if re.fullmatch(r"[\w./~-]+", text) else json.dumps(text)


def set_top_level(text: str, key: str, value) -> str:
    """`text` with the top-level `key` set to `value`: its line edited in place (a trailing
    comment kept; an indented block under it replaced), else a line appended."""
    lines = text.splitlines(keepends=True)
    pattern = re.compile(rf"^{re.escape(key)}\s*:(?P<value>[^#\n]*?)(?P<comment>\s+#.*)?(?P<end>\r?\n?)$")
    for i, line in enumerate(lines):
        m = pattern.match(line)
        if not m:
            continue
        end = m.group("end") or "\n"
        lines[i] = f"{key}: {_scalar(value)}{m.group('comment') or ''}{end}"
        if not m.group("value").strip():     # a block value: its indented (or "- ") lines go with it
            j = i + 1
            while j < len(lines) and lines[j].startswith((" ", "\t", "- ")):
                j += 1
            del lines[i + 1:j]
        return "".join(lines)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return "".join(lines) + f"{key}: {_scalar(value)}\n"


def tuned_recipe(text: str, kind: str, micro_batch: int | None = None, gas: int | None = None,
                 checkpointing: str | None = None, deepspeed: str | None = None) -> tuple[str, list[str]]:
    """(the recipe's text with the given settings, the `key: value` written for each); None: unchanged.
    `checkpointing` is none or full (a recipe cannot say selective)."""
    keys = RECIPE_KEYS[kind]
    changes: list[tuple[str, object]] = []
    if micro_batch is not None:
        changes.append((keys["micro_batch"], micro_batch))
    if gas is not None:
        changes.append((keys["gas"], gas))
    if checkpointing is not None:
        on = checkpointing == "full"
        changes.append((keys["checkpointing"], (not on) if kind == "llama_factory" else on))
    if deepspeed is not None:
        changes.append((keys["deepspeed"], deepspeed))
    for key, value in changes:
        text = set_top_level(text, key, value)
    return text, [f"{key}: {_scalar(value)}" for key, value in changes]


def _child_block(lines: list[str], parent: str) -> tuple[int | None, int, str]:
    """(index of the top-level `parent:` line or None, end of its indented block (trailing blank
    and comment lines left after it), the children's indentation ("  " when it has none)."""
    head = re.compile(rf"^{re.escape(parent)}\s*:")
    for i, line in enumerate(lines):
        if not head.match(line):
            continue
        end, indent = i + 1, None
        for j in range(i + 1, len(lines)):
            stripped = lines[j].strip()
            if not lines[j].startswith((" ", "\t")) and stripped and not stripped.startswith("#"):
                break
            if stripped and lines[j].startswith((" ", "\t")):
                end = j + 1
                if indent is None and not stripped.startswith("#"):
                    indent = lines[j][:len(lines[j]) - len(lines[j].lstrip())]
        return i, end, indent or "  "
    return None, len(lines), "  "


def _child_pattern(indent: str, key: str):
    return re.compile(rf"^{re.escape(indent)}{re.escape(key)}\s*:(?P<value>[^#\n]*?)(?P<comment>\s+#.*)?"
                      r"(?P<end>\r?\n?)$")


def set_nested(text: str, parent: str, key: str, value) -> str:
    """`text` with `parent.key` set to `value` (`parent` a top-level block mapping): the key's
    line edited in place (a trailing comment kept), else a line added at the end of the block,
    else the block added. A flow mapping (`parent: {...}`) that is not empty is refused."""
    lines = text.splitlines(keepends=True)
    i, end, indent = _child_block(lines, parent)
    if i is None:
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        return "".join(lines) + f"{parent}:\n{indent}{key}: {_scalar(value)}\n"
    inline = re.match(rf"^{re.escape(parent)}\s*:(?P<value>[^#\n]*?)(?P<comment>\s+#.*)?\r?\n?$", lines[i])
    flow = inline.group("value").strip() if inline else ""
    if flow not in ("", "{}", "null", "~"):
        from zsim.errors import ZsimInputError
        raise ZsimInputError(parent, flow, "is written on one line; write it as an indented block to let zsim tune "
                             "--write edit it line by line")
    if flow and inline is not None:
        lines[i] = f"{parent}:{inline.group('comment') or ''}\n"
    pattern = _child_pattern(indent, key)
    for j in range(i + 1, end):
        m = pattern.match(lines[j])
        if m:
            lines[j] = f"{indent}{key}: {_scalar(value)}{m.group('comment') or ''}{m.group('end') or chr(10)}"
            return "".join(lines)
    if end > 0 and not lines[end - 1].endswith("\n"):
        lines[end - 1] += "\n"
    lines.insert(end, f"{indent}{key}: {_scalar(value)}\n")
    return "".join(lines)


def drop_nested(text: str, parent: str, key: str) -> str:
    """`text` without the `parent.key` line (a scalar value; nothing when it is absent)."""
    lines = text.splitlines(keepends=True)
    i, end, indent = _child_block(lines, parent)
    if i is None:
        return text
    pattern = _child_pattern(indent, key)
    return "".join(line for j, line in enumerate(lines) if not (i < j < end and pattern.match(line)))

