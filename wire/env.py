"""$DATANODE_<KEY> variables: the environment's spelling of a setting, read the same way by a node's config
(datanode/config.py) and a program's client options (``TransportOptions.from_env``).  Pure: it reads the
mapping it is given, never ``os.environ`` itself."""
from __future__ import annotations

from typing import Mapping

__all__ = ["ENV_PREFIX", "env_values"]

ENV_PREFIX = "DATANODE_"     # $DATANODE_<KEY> overrides a key (the node's config, the SDK's default options)
_FLAGS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def env_values(kinds: Mapping[str, str], environ: Mapping[str, str]) -> dict:
    """The keys of ``kinds`` (name -> "int", "float", "bool", or anything else for text) that ``environ``
    sets as $DATANODE_<NAME>, converted.  An empty variable sets a text key to "" and leaves any other unset.
    ValueError names the variable that does not convert."""
    out: dict = {}
    for key, kind in kinds.items():
        name = ENV_PREFIX + key.upper()
        raw = environ.get(name)
        text = (raw or "").strip().lower()
        if raw is None or (not text and kind in ("int", "float", "bool")):
            continue
        if kind == "bool":
            if text not in _FLAGS:
                raise ValueError(f"${name}={raw!r}: expected 1/0, true/false, yes/no or on/off")
            out[key] = _FLAGS[text]
        elif kind in ("int", "float"):
            try:
                out[key] = int(text) if kind == "int" else float(text)
            except ValueError:
                raise ValueError(f"${name}={raw!r}: expected {kind}") from None
        else:
            out[key] = raw
    return out
