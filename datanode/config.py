"""node.toml: every key has a default; a bad value is an error that names the key."""
from __future__ import annotations

import dataclasses
import pathlib
import tomllib


class ConfigError(Exception):
    pass


@dataclasses.dataclass
class Config:
    listen: str = "127.0.0.1:17310"
    data_dir: str = "./data"
    pool_mib: int = 256            # registered pool arena
    max_block_kib: int = 4096      # largest pool block (and so the largest single request payload)
    sync: str = "always"           # always: fdatasync before every ack | none: page cache only
    transport: str = "auto"        # auto | verbs | tcp
    rdma_device: str = ""          # e.g. "rxe0"; empty: first active device (only when transport != tcp)
    gid_index: int = 1
    replica_timeout: float = 5.0   # seconds a follower may take to ack a forwarded write
    pool_wait: float = 10.0        # seconds a request may wait for pool memory before NO_SPACE
    slots: int = 64                # preposted control slots per connection
    log_level: str = "info"
    # -- replica health, repair and scrub (datanode/repair.py) --
    heartbeat_s: float = 1.0       # how often a leader probes each follower
    repair_interval_s: float = 60.0  # a full repair pass (sizes and block CRCs) at least this often
    repair_mib_s: float = 64.0     # repair bandwidth cap per node, MiB/s (0: unlimited)
    repair_chunk_kib: int = 1024   # bytes moved per repair write (one extent-lane turn each)
    scrub_interval_s: float = 3600.0  # background scrub pass this often (0: only on demand)
    scrub_mib_s: float = 32.0      # scrub read rate cap per node, MiB/s (0: unlimited)

    @property
    def host(self) -> str:
        return self.listen.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])


def _check(cfg: Config) -> Config:
    def bad(key, why):
        raise ConfigError(f"config key '{key}': {why} (got {getattr(cfg, key)!r})")

    host, sep, port = cfg.listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 <= int(port) <= 65535):
        bad("listen", "expected HOST:PORT, e.g. 127.0.0.1:17310")
    if not cfg.data_dir:
        bad("data_dir", "must be a directory path")
    if not (1 <= cfg.pool_mib <= 64 * 1024):
        bad("pool_mib", "must be between 1 and 65536")
    kib = cfg.max_block_kib
    if kib < 4 or kib & (kib - 1) or kib * 1024 > 64 << 20:
        bad("max_block_kib", "must be a power of two between 4 and 65536")
    if (cfg.pool_mib * 1024) % kib:
        bad("max_block_kib", f"pool_mib ({cfg.pool_mib} MiB) must be a multiple of the max block")
    if cfg.sync not in ("always", "none"):
        bad("sync", "must be 'always' or 'none'")
    if cfg.transport not in ("auto", "verbs", "tcp"):
        bad("transport", "must be 'auto', 'verbs' or 'tcp'")
    if cfg.replica_timeout <= 0:
        bad("replica_timeout", "must be > 0 seconds")
    if cfg.pool_wait <= 0:
        bad("pool_wait", "must be > 0 seconds")
    if not (1 <= cfg.slots <= 4096):
        bad("slots", "must be between 1 and 4096")
    for key in ("heartbeat_s", "repair_interval_s"):
        if getattr(cfg, key) <= 0:
            bad(key, "must be > 0 seconds")
    for key in ("repair_mib_s", "scrub_mib_s", "scrub_interval_s"):
        if getattr(cfg, key) < 0:
            bad(key, "must be >= 0 (0: unlimited / off)")
    rk = cfg.repair_chunk_kib
    if rk < 4 or rk & (rk - 1) or rk > 65536:
        bad("repair_chunk_kib", "must be a power of two between 4 and 65536 (capped at max_block_kib)")
    if cfg.log_level.lower() not in ("debug", "info", "warning", "error"):
        bad("log_level", "must be debug, info, warning or error")
    return cfg


def from_dict(d: dict, source: str = "config") -> Config:
    fields = {f.name: f for f in dataclasses.fields(Config)}
    kwargs = {}
    for key, value in d.items():
        if key not in fields:
            raise ConfigError(f"{source}: unknown key '{key}' (known: {', '.join(sorted(fields))})")
        want = fields[key].type
        ok = {"str": isinstance(value, str), "int": isinstance(value, int) and not isinstance(value, bool),
              "float": isinstance(value, (int, float)) and not isinstance(value, bool)}[want]
        if not ok:
            raise ConfigError(f"config key '{key}': expected {want}, got {value!r}")
        kwargs[key] = float(value) if want == "float" else value
    return _check(Config(**kwargs))


def load(path: str | pathlib.Path | None, **overrides) -> Config:
    d: dict = {}
    if path is not None:
        p = pathlib.Path(path)
        try:
            d = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p}: {e}") from None
    d.update({k: v for k, v in overrides.items() if v is not None})
    return from_dict(d, str(path or "config"))


def to_toml(cfg: Config) -> str:
    lines = []
    for f in dataclasses.fields(Config):
        v = getattr(cfg, f.name)
        lines.append(f'{f.name} = "{v}"' if isinstance(v, str) else f"{f.name} = {v}")
    return "\n".join(lines) + "\n"
