"""Where a node's SSD tier lives and how big it is (`[store]` `ssd_path`, `ssd_bytes`).

- `ssd_path` set: that directory, if the tier can use it (`dir_refusal`: a disk filesystem,
  not tmpfs, O_DIRECT accepted) and it has room; otherwise a `ConfigError` naming why.
- `ssd_path` "" (the default): the node looks through its topology's filesystems for a
  local SSD one (backing disk not rotational in sysfs, as NVMe and SATA SSDs report; ext4,
  xfs, btrfs or f2fs), most free space first, and puts the tier in
  `~/.cache/mooncake/ssd` when that lies on it, else in `<mountpoint>/mooncake`. None
  usable: the tier is off, said in one log line with each filesystem's reason.
- `ssd_bytes`: bytes, or a share of the chosen filesystem's free space (default "10%");
  "0" turns the tier off and skips the search.

`mooncake doctor --config` runs the same checks (`check_ssd`), so what it passes a node
accepts. Pure reads and one probe file per directory tried; no state.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import msgspec

from mooncake.config.settings import StoreConfig
from mooncake.config.sizes import Size
from mooncake.errors import ConfigError
from mooncake.native.sysfs import FilesystemInfo

log = logging.getLogger(__name__)

PROBE_BYTES = 4096  # one O_DIRECT-aligned block written and removed
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
DISK_FILESYSTEMS = ("ext4", "xfs", "btrfs", "f2fs")  # local filesystems that take O_DIRECT
ALLOWED = (
    f"a directory on a local SSD or NVMe filesystem ({', '.join(DISK_FILESYSTEMS)}) that "
    "accepts O_DIRECT, with room for store.ssd_bytes"
)
DEFAULT_MOUNTS = Path("/proc/self/mounts")


class SsdPlace(msgspec.Struct, frozen=True):
    """The SSD tier's directory and size on this node (a runtime fact, never config)."""

    path: str  # directory holding the tier file
    num_bytes: int  # the tier's size, bytes
    free_bytes: int  # free on its filesystem when chosen, bytes
    source: str  # "store.ssd_path" or how it was found ("nvme0n1 (ext4) at /data")

    @property
    def summary(self) -> str:
        """One line for logs and doctor: size, directory, source, free space."""
        return (
            f"{_gib(self.num_bytes)} in {self.path} ({self.source}; {_gib(self.free_bytes)} free)"
        )


def fstype_of(path: str, mounts: Path = DEFAULT_MOUNTS) -> str:
    """The type of the filesystem holding `path` (its longest mount point); "" if unknown."""
    return _mount_of(path, mounts)[1]


def _mount_of(path: str, mounts: Path) -> tuple[str, str]:
    real, best, kind = os.path.realpath(path), "", ""
    try:
        with open(mounts) as f:
            for line in f:
                fields = line.split()
                point = fields[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return "", ""
    return best, kind


def dir_refusal(path: str, fstype: str, create: bool = False) -> str:
    """Why the SSD tier cannot use directory `path` on a filesystem of `fstype` ("" if it
    can): missing (created first when `create`), a memory filesystem, or O_DIRECT refused
    (tried with a probe file, then removed)."""
    if create:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            return f"cannot create {path}: {e.strerror}"
    if not os.path.isdir(path):
        return f"{path} is not a directory"
    if fstype in MEMORY_FILESYSTEMS:
        return f"{path} is on {fstype}: the SSD tier would take RAM"
    probe = os.path.join(path, f".mooncake-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
        try:
            block = mmap.mmap(-1, PROBE_BYTES)  # page-aligned, as O_DIRECT needs
            os.write(fd, block)
        finally:
            os.close(fd)
    except OSError as e:
        why = "refuses O_DIRECT" if e.errno == errno.EINVAL else f"cannot write: {e.strerror}"
        return f"{path} ({fstype or 'unknown filesystem'}) {why}"
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
    return ""


def space_refusal(path: str, want_bytes: int, free_bytes: int) -> str:
    """Why `want_bytes` does not fit in `free_bytes` at `path` ("" when it does)."""
    if want_bytes > free_bytes:
        return f"{path}: {_gib(want_bytes)} wanted, {_gib(free_bytes)} free"
    if want_bytes <= 0:
        return f"{path}: store.ssd_bytes leaves 0 bytes of {_gib(free_bytes)} free"
    return ""


def check_ssd(
    cfg: StoreConfig,
    filesystems: Sequence[FilesystemInfo],
    mounts: Path = DEFAULT_MOUNTS,
    cache_dir: Path | None = None,
) -> tuple[SsdPlace | None, str]:
    """Where the SSD tier goes and, when nowhere, why: (place, "") or (None, reason). An
    empty reason with no place means the tier is off by config. Creates the directory it
    picks; changes nothing else."""
    if cfg.ssd_bytes.is_zero:
        return None, ""
    if cfg.ssd_path:
        path = cfg.ssd_path
        return _fit(path, fstype_of(path, mounts), cfg.ssd_bytes, "store.ssd_path")
    reasons = []
    for fs in sorted(filesystems, key=lambda f: -f.free_bytes):
        why = _fs_refusal(fs)
        for path in [] if why else _dirs_on(fs, mounts, cache_dir):
            found = f"{fs.disk} ({fs.fstype}) at {fs.mountpoint}"
            place, why = _fit(path, fs.fstype, cfg.ssd_bytes, found)
            if place is not None:
                return place, ""
        reasons.append(f"{fs.mountpoint}: {why}")
    return None, "; ".join(reasons) or "no local filesystem mounted"


def _fit(path: str, fstype: str, size: Size, source: str) -> tuple[SsdPlace | None, str]:
    """The tier in directory `path` (created) if usable and `size` fits there."""
    why = dir_refusal(path, fstype, create=True)
    if why:
        return None, why
    free = shutil.disk_usage(path).free
    want = size.resolve(free)
    why = space_refusal(path, want, free)
    return (None, why) if why else (SsdPlace(path, want, free, source), "")


def place_ssd(
    cfg: StoreConfig,
    filesystems: Sequence[FilesystemInfo],
    mounts: Path = DEFAULT_MOUNTS,
    cache_dir: Path | None = None,
) -> SsdPlace | None:
    """This node's SSD tier, or None when it has none (off by config, or no local SSD
    found: logged once). Raises ConfigError when `ssd_path` names a directory the tier
    cannot use, saying why and what is allowed."""
    place, why = check_ssd(cfg, filesystems, mounts, cache_dir)
    if place is not None:
        log.info("SSD tier: %s", place.summary)
    elif not why:  # off by config
        return None
    elif cfg.ssd_path:
        raise ConfigError(f"store.ssd_path: {why}; allowed: {ALLOWED}")
    else:
        hint = 'set store.ssd_path to a directory to use one, or store.ssd_bytes = "0"'
        log.info("SSD tier off: no local SSD filesystem found (%s); %s", why, hint)
    return place


def _fs_refusal(fs: FilesystemInfo) -> str:
    if fs.fstype in MEMORY_FILESYSTEMS:
        return f"{fs.fstype}: the SSD tier would take RAM"
    if not fs.disk:
        return f"{fs.device or fs.fstype} is not a local block device"
    if fs.is_rotational is None:
        return f"{fs.disk}: sysfs does not say whether it is rotational"
    if fs.is_rotational:
        return f"{fs.disk} is rotational (sysfs queue/rotational), not an SSD"
    if fs.fstype not in DISK_FILESYSTEMS:
        return f"{fs.fstype} is not one of {', '.join(DISK_FILESYSTEMS)}"
    return ""


def _dirs_on(fs: FilesystemInfo, mounts: Path, cache_dir: Path | None) -> list[str]:
    """Directories to try on `fs`: the user's cache when it lies there, then the mount's."""
    cache = cache_dir or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    mine = cache / "mooncake" / "ssd"
    on_fs = _mount_of(str(mine), mounts)[0] == fs.mountpoint
    return [str(mine)] * on_fs + [os.path.join(fs.mountpoint, "mooncake")]


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.1f} GiB"
