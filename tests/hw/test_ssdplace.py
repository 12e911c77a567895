"""Where a node's SSD tier goes (mooncake/hw/ssdplace.py), on a recorded machine: the
workstation's sysfs tree (an NVMe disk, nvme0n1, and a spinning one, sda) and a mount table
naming real directories under tmp_path, so free space and the O_DIRECT probe are real."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from mooncake.config.settings import StoreConfig
from mooncake.config.sizes import Size
from mooncake.errors import ConfigError
from mooncake.hw.ssdplace import check_ssd, place_ssd
from mooncake.native.sysfs import FilesystemInfo, read_filesystems
from tests.fakes.sysfs import build_sysfs, load_machine, with_changes

AUTO = StoreConfig(ssd_bytes=Size(fraction=0.1))  # the default: 10% of the SSD's free space


def _machine(tmp_path: Path, changes: dict[str, object] | None = None) -> Path:
    """The workstation's sysfs under tmp_path/sys and its mount table: the NVMe's second
    partition (ext4) and its first (vfat, the EFI partition), the spinning disk (ext4),
    and a tmpfs; each mount point a real directory."""
    build_sysfs(with_changes(load_machine("workstation"), changes or {}), tmp_path / "sys")
    mounts = {
        "/dev/nvme0n1p2": ("nvme", "ext4"),
        "/dev/nvme0n1p1": ("efi", "vfat"),
        "/dev/sda1": ("hdd", "xfs"),
        "tmpfs": ("run", "tmpfs"),
    }
    lines = []
    for device, (name, fstype) in mounts.items():
        (tmp_path / name).mkdir()
        lines.append(f"{device} {tmp_path / name} {fstype} rw,relatime 0 0")
    table = tmp_path / "mounts"
    table.write_text("\n".join(lines) + "\n")
    return table


def _filesystems(tmp_path: Path, mounts: Path) -> list[FilesystemInfo]:
    return read_filesystems(tmp_path / "sys", mounts)


def test_the_nvme_filesystem_is_found_and_given_a_share_of_its_free_space(tmp_path: Path) -> None:
    mounts = _machine(tmp_path)
    fss = _filesystems(tmp_path, mounts)
    assert [(f.mountpoint, f.disk, f.is_rotational) for f in fss] == [
        (str(tmp_path / "efi"), "nvme0n1", False),
        (str(tmp_path / "hdd"), "sda", True),
        (str(tmp_path / "nvme"), "nvme0n1", False),
    ]  # the tmpfs is no block device: not listed
    place, why = check_ssd(AUTO, fss, mounts, cache_dir=tmp_path / "home" / ".cache")
    assert place is not None and why == ""
    assert place.path == str(tmp_path / "nvme" / "mooncake")
    assert place.num_bytes == int(place.free_bytes * 0.1) > 0
    assert place.source == f"nvme0n1 (ext4) at {tmp_path / 'nvme'}"
    assert os.listdir(place.path) == []  # created, the probe file removed


def test_the_users_cache_dir_is_used_when_it_lies_on_the_ssd(tmp_path: Path) -> None:
    mounts = _machine(tmp_path)
    cache = tmp_path / "nvme" / "home" / "me" / ".cache"
    place, _ = check_ssd(AUTO, _filesystems(tmp_path, mounts), mounts, cache_dir=cache)
    assert place is not None and place.path == str(cache / "mooncake" / "ssd")


def test_a_sata_ssd_is_found_when_the_nvme_spins(tmp_path: Path) -> None:
    """Only sysfs' rotational flag tells an SSD: with nvme0n1 reporting 1 and sda 0, the
    xfs filesystem on sda is the one."""
    changes = {"block/nvme0n1/rotational": 1, "block/sda/rotational": 0}
    mounts = _machine(tmp_path, changes)
    place, _ = check_ssd(AUTO, _filesystems(tmp_path, mounts), mounts, tmp_path / "c")
    assert place is not None and place.source == f"sda (xfs) at {tmp_path / 'hdd'}"


def test_no_ssd_turns_the_tier_off_with_one_log_line_naming_each_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mounts = _machine(tmp_path, {"block/nvme0n1/rotational": 1})
    caplog.set_level(logging.INFO, logger="mooncake.hw.ssdplace")
    assert place_ssd(AUTO, _filesystems(tmp_path, mounts), mounts, tmp_path / "c") is None
    [record] = caplog.records
    line = record.getMessage()
    assert line.startswith("SSD tier off: no local SSD filesystem found (")
    assert f"{tmp_path / 'nvme'}: nvme0n1 is rotational (sysfs queue/rotational)" in line
    assert f"{tmp_path / 'hdd'}: sda is rotational" in line
    assert f"{tmp_path / 'efi'}: nvme0n1 is rotational" in line
    assert not (tmp_path / "nvme" / "mooncake").exists()  # nothing created where refused


def test_a_filesystem_that_is_not_a_disk_filesystem_is_passed_over(tmp_path: Path) -> None:
    mounts = _machine(tmp_path)
    efi = [f for f in _filesystems(tmp_path, mounts) if f.fstype == "vfat"]
    place, why = check_ssd(AUTO, efi, mounts, tmp_path / "c")
    assert place is None
    assert why == f"{tmp_path / 'efi'}: vfat is not one of ext4, xfs, btrfs, f2fs"


def test_an_ssd_too_small_for_an_absolute_size_is_passed_over(tmp_path: Path) -> None:
    mounts = _machine(tmp_path)
    huge = StoreConfig(ssd_bytes=Size.parse("1000TiB"))
    place, why = check_ssd(huge, _filesystems(tmp_path, mounts), mounts, tmp_path / "c")
    assert place is None
    assert f"{tmp_path / 'nvme'}: {tmp_path / 'nvme' / 'mooncake'}: 1024000.0 GiB wanted" in why


def test_ssd_bytes_zero_searches_nothing(tmp_path: Path) -> None:
    """Off by config: with or without a path, nothing is looked at or created."""
    mounts = _machine(tmp_path)
    off = StoreConfig(ssd_bytes=Size())
    assert check_ssd(off, _filesystems(tmp_path, mounts), mounts, tmp_path / "c") == (None, "")
    assert not (tmp_path / "nvme" / "mooncake").exists()
    with_path = StoreConfig(ssd_bytes=Size(), ssd_path=str(tmp_path / "tier"))
    assert place_ssd(with_path, [], mounts) is None
    assert not (tmp_path / "tier").exists()


def test_an_explicit_path_is_used_as_configured(tmp_path: Path) -> None:
    """ssd_path set: no search; the directory is created; a share is of its free space."""
    cfg = StoreConfig(ssd_bytes=Size.parse("1MiB"), ssd_path=str(tmp_path / "tier"))
    place = place_ssd(cfg, [])
    assert place is not None
    assert (place.path, place.num_bytes, place.source) == (cfg.ssd_path, 1 << 20, "store.ssd_path")
    assert (tmp_path / "tier").is_dir()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this host")
def test_an_explicit_path_on_tmpfs_is_refused_naming_why_and_what_is_allowed(
    tmp_path: Path,
) -> None:
    shm = f"/dev/shm/mooncake-test-{os.getpid()}"
    cfg = StoreConfig(ssd_bytes=Size.parse("1MiB"), ssd_path=shm)
    try:
        with pytest.raises(ConfigError) as e:
            place_ssd(cfg, [], Path("/proc/self/mounts"))
    finally:
        os.rmdir(shm)
    assert str(e.value) == (
        f"store.ssd_path: {shm} is on tmpfs: the SSD tier would take RAM; allowed: a "
        "directory on a local SSD or NVMe filesystem (ext4, xfs, btrfs, f2fs) that accepts "
        "O_DIRECT, with room for store.ssd_bytes"
    )


def test_an_explicit_path_without_room_is_refused(tmp_path: Path) -> None:
    cfg = StoreConfig(ssd_bytes=Size.parse("1000TiB"), ssd_path=str(tmp_path))
    with pytest.raises(ConfigError, match=r"store.ssd_path: .* 1024000.0 GiB wanted, .* free"):
        place_ssd(cfg, [])
