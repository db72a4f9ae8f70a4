"""What every ``tctune`` command shares: parsing list options, and naming library fields by their flags.

The library raises ``UsageError(message, field=...)`` naming a ``TuneConfig`` field (``"batch_sizes"``); only
the CLI knows flags: :func:`flag_message` rewrites the field to its flag (``--batch-sizes``) for the user.
"""
from __future__ import annotations

import re

from ..errors import UsageError

#: Library field -> command-line flag (fields not listed are spelled ``--field-name``).
FLAGS = {"out_dir": "--out", "timeout_s": "--timeout", "compile_budget_s": "--compile-budget"}


def flag_for(field: str) -> str:
    """The flag of a library field: :data:`FLAGS`, else ``--`` + the field with ``-`` for ``_``."""
    return FLAGS.get(field) or "--" + field.replace("_", "-")


def flag_message(exc: UsageError) -> str:
    """``exc``'s message with its field (``exc.field``) written as the flag the user typed."""
    text = str(exc)
    if not getattr(exc, "field", None):
        return text
    return re.sub(rf"(?<![\w-]){re.escape(exc.field)}(?!\w)", flag_for(exc.field), text)


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """``"8,32,128"`` → (8, 32, 128); ``"16-256"`` → 16, 32, ..., 256: doubling from LO, HI included (powers of
    two when LO is one; ``"3-20"`` → 3, 6, 12, 20).

    Raises:
        UsageError: anything else, a value below 1, an empty entry (``8,,32``) or a size given twice; the message
            names the bad item (``'abc' is not a positive integer``, ``entry 2 is empty``, ``8 given more than
            once``) or the reversed range (``the range must go up, e.g. 16-256``). ``tctune.optimize(batch_sizes=
            "8,32")`` parses its string with this function too.
    """
    text = text.strip()

    def bad(why: str) -> UsageError:
        return UsageError(
            f"invalid --batch-sizes {text!r}: {why}\n  fix: a comma list of positive integers (8,32,128) or a range "
            "LO-HI (16-256: doubling from 16, 256 included)")

    def positive(token: str) -> int:
        token = token.strip()
        if not (token.isascii() and token.isdigit()) or int(token) < 1:
            raise bad(f"{token!r} is not a positive integer")
        return int(token)

    if not text:
        raise bad("no batch size given")
    if "-" in text and "," not in text:
        lo_text, hi_text = text.split("-", 1)
        if not lo_text.strip():  # "-4": a negative number, not a range
            raise bad(f"{text!r} is not a positive integer")
        lo, hi = positive(lo_text), positive(hi_text)
        if hi < lo:
            raise bad(f"the range must go up, e.g. {hi}-{lo}")
        sizes, b = [], lo
        while b <= hi:
            sizes.append(b)
            b *= 2
        if sizes[-1] != hi:
            sizes.append(hi)
        return tuple(sizes)
    tokens = [x.strip() for x in text.split(",")]
    if not any(tokens):
        raise bad("no batch size given")
    if "" in tokens:  # "8,,32", "8,32,": a lost number, not something to skip silently
        raise bad(f"entry {tokens.index('') + 1} is empty (two commas in a row, or a comma at an end)")
    sizes = [positive(x) for x in tokens]
    twice = sorted({b for b in sizes if sizes.count(b) > 1})
    if twice:
        raise bad(f"{', '.join(map(str, twice))} given more than once")
    return tuple(sorted(sizes))


def parse_devices(text: str) -> tuple[int, ...]:
    """``"0,1"`` → (0, 1).

    Raises:
        UsageError: not a comma list of non-negative integers.
    """
    try:
        devices = tuple(int(x) for x in text.split(",") if x.strip())
        if not devices or min(devices) < 0:
            raise ValueError
        return devices
    except ValueError:
        raise UsageError(f"invalid --devices {text!r}\n  fix: a comma list of GPU indices, e.g. 0,1") from None


def parse_runtimes(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names:
        from ..runtime import ALL_RUNTIMES

        raise UsageError(f"--runtimes is empty\n  fix: a comma list from {', '.join(ALL_RUNTIMES)}, or leave it out "
                         "for the default")
    return names


def parse_fp8_keep(text: str) -> tuple[str, ...] | None:
    """``--fp8-keep``: ``auto`` -> None (planned), ``none`` -> ``()``, else the comma-separated patterns.

    Raises:
        UsageError: an empty value.
    """
    value = text.strip()
    if value.lower() == "auto":
        return None
    if value.lower() == "none":
        return ()
    patterns = tuple(p.strip() for p in value.split(",") if p.strip())
    if not patterns:
        raise UsageError(f"--fp8-keep: give auto, none or module-path patterns such as '*.output.dense' (got {text!r})")
    return patterns
