"""How an option is declared: a pydantic field that is, at once, a keyword, a flag and a
config-file key.

A field's description is its flag's help and its metadata (`metavar`, `env`) the rest of
the flag; `engine.arg_utils` turns the fields of the engine's config tree into flags. The
declaration lives here, below the engine, so that the store declares its own options
(`kvstore.config.StoreConfig`) once and the engine's tree includes them as they are.
Also the value types options share: sizes, durations, paths.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ByteSize,
    Field,
    PlainSerializer,
    TypeAdapter,
    ValidationError,
)
from pydantic.fields import FieldInfo

GiB = 1024**3
# Upper bounds: a value past one is a typo or an attack, never a deployment. Refused at
# start, they cannot fail (or allocate for) the first request instead.
MAX_SIZE = 1024**5  # 1024 TiB, any memory or disk size
MAX_SECONDS = 365 * 24 * 3600.0  # any duration (threading refuses much larger timeouts)


def option(default: Any, help: str, *, metavar: str | None = None, env: tuple[str, ...] = (),
           secret: bool = False) -> Any:
    """A field that is an option. `env`: environment variables read, the first one set,
    when neither flag nor config file sets it; `secret`: kept out of reprs and help."""
    extra = {"metavar": metavar, "env": list(env)}
    return Field(default, description=help, repr=not secret, json_schema_extra=extra)


def option_meta(field: FieldInfo) -> dict[str, Any]:
    return field.json_schema_extra or {}


def describe_error(exc: ValidationError) -> tuple[str, str]:
    """The option to blame for `exc` (its first error) and why, in one line."""
    error = exc.errors()[0]
    option = str(error["loc"][0]) if error["loc"] else "config"
    if error["type"] == "extra_forbidden":
        return option, "is not an option"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "value_error":
        return option, message
    value = repr(error["input"])  # cut: a config file's value may be a megabyte long
    return option, f"{message}, got {value if len(value) <= 80 else value[:77] + '...'}"


# ---- sizes --------------------------------------------------------------------------------

# The whole value must have this shape: ByteSize reads a number and a unit from the start
# of a string and ignores what follows (`1.GiB` would be one byte).
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_BYTE_SIZE = TypeAdapter(ByteSize)
_IEC_SHORT = ("ki", "mi", "gi", "ti")  # Kubernetes' spelling of KiB, MiB, GiB, TiB
# A bare number this large is a byte count written without its unit, not GiB.
_BARE_GIB_LIMIT = 1024**2
_SIZE_EXAMPLES = "examples: 4 = 4GiB, 512MiB, 2GB, 1048576B"


def parse_size(value: str | int | float) -> int:
    """Bytes of a memory size: a bare number is GiB (as in vLLM: `4` = 4 GiB, `0.5` =
    512 MiB); a unit, read by pydantic's ByteSize, makes it explicit: `512MiB`, `2GB`
    (decimal), `1048576B` (bytes). Raises ValueError with the reason."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 4 (GiB) or 512MiB, got {value!r}")
    if isinstance(value, int | float):
        number, unit = float(value), ""
    else:
        match = _SIZE_RE.match(str(value))
        if match is None:
            raise ValueError(f"cannot parse size {value!r} ({_SIZE_EXAMPLES})")
        number, unit = float(match.group(1)), match.group(2)
    if number < 0:
        raise ValueError(f"size must be >= 0, got {value!r}")
    if not unit:
        if number >= _BARE_GIB_LIMIT:
            raise ValueError(f"a bare number is GiB, so {value!r} is {value} GiB; write bytes as {value}B")
        nbytes = int(number * GiB)
    else:
        unit += "B" if unit.lower() in _IEC_SHORT else ""
        try:
            nbytes = int(_BYTE_SIZE.validate_python(match.group(1).rstrip(".") + unit))
        except ValidationError:
            raise ValueError(f"cannot parse size {value!r} ({_SIZE_EXAMPLES})") from None
    if nbytes > MAX_SIZE:
        raise ValueError(f"{value!r} is more than the largest size, {format_size(MAX_SIZE)}")
    return nbytes


def format_size(nbytes: int) -> str:
    """The shortest exact spelling of `nbytes` that parse_size reads back."""
    for unit, scale in (("TiB", 1024**4), ("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def expand_path(value: str) -> str:
    """`value` with `~` and `$VAR` (or `${VAR}`) expanded, as a shell expands a flag's:
    a config file and an `LLM(...)` keyword get no shell, and `model: ~/models/x` must
    mean the same as the flag."""
    return os.path.expandvars(os.path.expanduser(value))


# dumped as its exact spelling with a unit, so that a dump rebuilds the same config
Size = Annotated[int, BeforeValidator(parse_size), PlainSerializer(format_size, return_type=str)]
Seconds = Annotated[float, Field(gt=0, le=MAX_SECONDS)]
PathOption = Annotated[str, AfterValidator(expand_path)]
