"""`zsim tune --write` on a launch script: the user's script with only the training script's
flags the tuned configuration changes edited in place, written beside it as NAME.tuned.sh (the
user's file is never replaced). Every other byte stays as written: the lines before and after
the command, comments, backslash continuations, the launcher's options and `$VARIABLES`.

The command is the one zsim.config.launch reads (`find_launch`); its words are located in the
text by a scanner that splits as shlex does (quotes, backslash escapes, a `#` word ending the
command), checked against shlex's own split before anything is edited. The flags are the HF
Trainer's (transformers/training_args.py): --per_device_train_batch_size,
--gradient_accumulation_steps, --gradient_checkpointing (a bool HfArgumentParser reads bare, or
with a true/false value) and --deepspeed (or DeepSpeed's own --deepspeed_config).
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from zsim.errors import ZsimInputError

_BLANK = " \t"


def _word_end(text: str, i: int) -> int:
    """The end of the shell word starting at text[i] (quotes and backslash escapes inside it)."""
    while i < len(text):
        c = text[i]
        if c in _BLANK or c in "\r\n":
            return i
        if c == "\\":
            if text[i + 1:i + 2] in ("\n", "\r"):
                return i
            i += 2
        elif c == "'":
            close = text.find("'", i + 1)
            i = len(text) if close < 0 else close + 1
        elif c == '"':
            i += 1
            while i < len(text) and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
        else:
            i += 1
    return len(text)


def word_spans(text: str, start: int) -> list[tuple[int, int]]:
    """(begin, end) of each word of the logical line beginning at text[start]: backslash-newline
    joins lines, a newline ends the command, so does a word beginning with `#` (a comment)."""
    spans, i = [], start
    while i < len(text):
        c = text[i]
        if c == "\\" and text[i + 1:i + 2] == "\n":
            i += 2
        elif c == "\\" and text[i + 1:i + 3] == "\r\n":
            i += 3
        elif c in _BLANK:
            i += 1
        elif c in "\r\n" or c == "#":
            break
        else:
            end = _word_end(text, i)
            spans.append((i, end))
            i = end
    return spans


@dataclass
class Flag:
    """One training-script flag as written: its name word, its value word (None: bare), and
    whether the value is inside the name word (`--name=value`)."""
    name: int                   # index of the `--name` word
    value: int | None = None    # index of the value word (== name for --name=value)
    inline: bool = False


@dataclass
class Edits:
    """Replacements of word spans, and words appended after the command's last word."""
    replace: dict = field(default_factory=dict)     # word index -> new text
    append: list = field(default_factory=list)

    def apply(self, text: str, spans: list[tuple[int, int]]) -> str:
        out = text
        if self.append:
            end = spans[-1][1]
            out = out[:end] + "".join(f" {w}" for w in self.append) + out[end:]
        for i in sorted(self.replace, reverse=True):
            b, e = spans[i]
            out = out[:b] + self.replace[i] + out[e:]
        return out


def script_flags(words: list[str], first: int) -> dict[str, Flag]:
    """The training script's `--name` flags from words[first] on (names with `-` read as `_`, as
    HfArgumentParser's aliases do; zsim.config.launch.script_flags reads the values)."""
    flags: dict[str, Flag] = {}
    for i in range(first, len(words)):
        w = words[i]
        if not (w.startswith("--") and len(w) > 2):
            continue
        key, eq, _ = w[2:].partition("=")
        name = key.replace("-", "_")
        if eq:
            flags[name] = Flag(i, i, True)
        elif i + 1 < len(words) and not words[i + 1].startswith("--"):
            flags[name] = Flag(i, i + 1)
        else:
            flags[name] = Flag(i)
    return flags


def _locate(text: str, line_no: int, launch: list[str], where: str) -> list[tuple[int, int]]:
    """The spans of the launch command's words (the last len(launch) words of its logical line)."""
    offset = sum(len(line) for line in text.splitlines(keepends=True)[:line_no - 1])
    spans = word_spans(text, offset)
    raw = [text[b:e] for b, e in spans]
    try:
        ok = [shlex.split(w)[0] if w else "" for w in raw] == shlex.split(" ".join(raw)) and len(spans) >= len(launch)
    except (ValueError, IndexError):
        ok = False
    if not ok or [shlex.split(w)[0] for w in raw[len(raw) - len(launch):]] != launch:
        raise ZsimInputError(where, "--write", "zsim cannot find the command's words in the script to edit them in "
                             "place (a quoting it does not follow); write the tuned flags by hand from the notes")
    return spans[len(spans) - len(launch):]


def tuned_launch(text: str, line_no: int, launch: list[str], script_index: int, where: str,
                 micro_batch: int | None = None, gas: int | None = None, checkpointing: str | None = None,
                 deepspeed: str | None = None, deepspeed_flag: str = "deepspeed",
                 values: list[str] | None = None, words: dict | None = None) -> tuple[str, list[str], list[str]]:
    """(the script's text with the given flags, the flags written, notes). `launch` is the command's
    words as written (unexpanded; zsim.config.launch.find_launch); `values` its words expanded, for
    naming what a `$VARIABLE` stood for; `words` other words to replace (index -> text). None:
    unchanged. `checkpointing` is none or full."""
    spans = _locate(text, line_no, launch, where)
    flags = script_flags(launch, script_index + 1)
    edits, written, notes = Edits(), [], []
    for i, word in (words or {}).items():
        edits.replace[i] = word
        written.append(word)

    def put(name: str, value: str):
        flag = flags.get(name)
        old = None
        if flag is None:
            edits.append += [f"--{name}", value]
        elif flag.inline:
            head, _, old = launch[flag.name].partition("=")
            edits.replace[flag.name] = f"{head}={value}"
        elif flag.value is None:
            edits.replace[flag.name] = f"{launch[flag.name]} {value}"
        else:
            old = launch[flag.value]
            edits.replace[flag.value] = value
        written.append(f"--{name} {value}")
        # [Note: a shell variable the tuner changes] the tuned value is written literally in place
        # of the variable, which may feed other lines too: zsim does not guess where it is set
        if old and "$" in old and flag is not None and flag.value is not None:
            now = values[flag.value] if values else None
            now = now.partition("=")[2] if now is not None and flag.inline else now
            was = f" (= {now})" if now is not None else ""
            notes.append(f"--{name} was {old}{was} in {where}: written as the value {value}")

    if micro_batch is not None:
        put("per_device_train_batch_size", str(micro_batch))
    if gas is not None:
        put("gradient_accumulation_steps", str(gas))
    flag = flags.get("gradient_checkpointing")
    if checkpointing == "full" and flag is None:
        edits.append.append("--gradient_checkpointing")
        written.append("--gradient_checkpointing")
    elif checkpointing is not None and flag is not None and not (checkpointing == "full" and flag.value is None):
        # HfArgumentParser reads a bool flag bare (on) or with a value; the value keeps the user's case
        old = (launch[flag.value].partition("=")[2] if flag.inline else launch[flag.value]) \
            if flag.value is not None else ""
        on = checkpointing == "full"
        put("gradient_checkpointing", (str(on) if old[:1].isupper() else str(on).lower()))
    if deepspeed is not None:
        put(deepspeed_flag, shlex.quote(deepspeed))
    return edits.apply(text, spans), written, notes


def tuned_path(path: Path) -> Path:
    """NAME.tuned.SUFFIX beside `path` (NAME.tuned without a suffix)."""
    return path.with_name(f"{path.stem}.tuned{path.suffix}") if path.suffix else path.with_name(f"{path.name}.tuned")
