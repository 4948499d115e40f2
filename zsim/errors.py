"""User-facing errors: one line naming the field, the value and the fix (exit code 2)."""
from __future__ import annotations


def one_line(text: str) -> str:
    """`text` with control characters escaped (a key or path typed with a newline or a carriage
    return in it must not break the error into two lines)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class ZsimInputError(Exception):
    """Bad user input. The CLI prints str(err) on one line and exits with code 2."""

    def __init__(self, field: str, value: object, fix: str):
        self.field = field
        self.value = value
        self.fix = fix
        super().__init__(one_line(f"{field}: {value!r} is invalid; {fix}"))


class UnknownKeyError(ZsimInputError):
    """A key the schema does not have (no value can make it valid): its own type, so a caller
    can tell it from a bad value without reading the message."""


def did_you_mean(name: str, choices) -> str:
    import difflib   # here: only bad input needs it, and every zsim command imports this module
    close = difflib.get_close_matches(name, sorted(choices), n=3, cutoff=0.6)
    if not close:
        return ""
    # equally close names ("bfp16": bf16 and fp16) go to the one that starts as the name does
    ratio = difflib.SequenceMatcher(None, name, close[0]).ratio()
    ties = [c for c in close if difflib.SequenceMatcher(None, name, c).ratio() == ratio]
    best = next((c for c in ties if c[:1] == name[:1]), close[0])
    return f" (did you mean '{best}'?)"


def unknown_key(path: str, key: str, choices) -> ZsimInputError:
    where = f"{path}.{key}" if path else key
    hint = did_you_mean(key, choices)
    if hint:
        return UnknownKeyError(where, key, f"unknown key{hint}; remove it or fix the spelling")
    if len(choices) <= 12:
        return UnknownKeyError(where, key, f"unknown key; allowed keys: {', '.join(sorted(choices))}")
    return UnknownKeyError(where, key, f"unknown key under '{path or 'the top level'}'; see docs/scenario.md "
                           "for the accepted keys")
