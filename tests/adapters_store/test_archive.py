"""Archive uploads: honest layouts unpack; hostile ones are refused, with a reason, before any write."""

from __future__ import annotations

import stat
import tarfile
import zipfile

import pytest

from adapters_store import InvalidAdapter, StoreConfig, UploadTooLarge
from adapters_store.archive import unpack_archive

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def unpack(path, tmp_path, **limits):
    dest = tmp_path / "out"
    dest.mkdir(exist_ok=True)
    unpack_archive(path, dest, StoreConfig(**limits))
    return sorted(p.name for p in dest.iterdir())


def tar_entry(name: str, kind: bytes, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info


def zip_entry(name: str, mode: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name)
    info.external_attr = mode << 16
    return info


@pytest.mark.parametrize("fmt", ["tar_gz", "zip"])
@pytest.mark.parametrize("top", ["my-adapter", None])
def test_a_folder_or_root_files_unpack_to_the_two_adapter_files(archives, adapter_dir, tmp_path, fmt, top):
    path = getattr(archives, fmt)(adapter_dir, top=top)
    assert unpack(path, tmp_path) == [CONFIG, WEIGHTS]  # README.md dropped
    assert (tmp_path / "out" / WEIGHTS).read_bytes() == (adapter_dir / WEIGHTS).read_bytes()


def test_macos_zip_junk_is_skipped(archives, tmp_path):
    path = archives.zip_members(
        [
            ("a/adapter_config.json", b"{}"),
            ("__MACOSX/a/._adapter_config.json", b"junk"),
            ("a/.DS_Store", b"junk"),
        ]
    )
    assert unpack(path, tmp_path) == [CONFIG]


@pytest.mark.parametrize(
    "members, code, message",
    [
        ([("/etc/adapter_config.json", b"{}")], "unsafe_archive", "has an absolute path"),
        ([("C:/x/adapter_config.json", b"{}")], "unsafe_archive", "has an absolute path"),
        ([("../adapter_config.json", b"{}")], "unsafe_archive", r"climbs out of the archive with '\.\.'"),
        ([("a/../../adapter_config.json", b"{}")], "unsafe_archive", "climbs out"),
        ([("a\\..\\adapter_config.json", b"{}")], "unsafe_archive", "backslash"),
        (
            [tar_entry(WEIGHTS, tarfile.SYMTYPE, "/etc/passwd")],
            "unsafe_archive",
            r"is a symbolic link \(to '/etc/passwd'\)",
        ),
        ([tar_entry(WEIGHTS, tarfile.LNKTYPE, "a/x")], "unsafe_archive", "is a hard link"),
        ([tar_entry("dev", tarfile.CHRTYPE)], "unsafe_archive", "is a device, FIFO or other special file"),
        ([tar_entry("fifo", tarfile.FIFOTYPE)], "unsafe_archive", "special file"),
        ([("a/b/adapter_config.json", b"{}")], "bad_archive_layout", "nested too deep"),
        (
            [("a/adapter_config.json", b"{}"), ("b/adapter_model.safetensors", b"")],
            "bad_archive_layout",
            "more than one adapter folder",
        ),
        (
            [("adapter_config.json", b"{}"), ("adapter_config.json", b"{}")],
            "bad_archive_layout",
            "appears twice",
        ),
        ([("a/optimizer.pt", b"")], "pickle_refused", "pickles are never loaded"),
        ([("a/run.sh", b"")], "unexpected_file", "unexpected file a/run.sh"),
    ],
    ids=[
        "absolute",
        "drive",
        "dotdot",
        "dotdot_nested",
        "backslash",
        "symlink",
        "hardlink",
        "device",
        "fifo",
        "too_deep",
        "two_folders",
        "duplicate",
        "pickle",
        "stray",
    ],
)
def test_hostile_tar_members_are_refused(archives, tmp_path, members, code, message):
    with pytest.raises(InvalidAdapter, match=message) as err:
        unpack(archives.tar_members(members), tmp_path)
    assert err.value.code == code


@pytest.mark.parametrize(
    "member, message",
    [
        (("/abs/adapter_config.json", b"{}"), "has an absolute path"),
        (("../adapter_config.json", b"{}"), "climbs out"),
        (zip_entry(WEIGHTS, stat.S_IFLNK | 0o777), "is a symbolic link"),
        (zip_entry(WEIGHTS, stat.S_IFCHR | 0o600), "special file"),
    ],
    ids=["absolute", "dotdot", "symlink", "device"],
)
def test_hostile_zip_members_are_refused(archives, tmp_path, member, message):
    with pytest.raises(InvalidAdapter, match=message) as err:
        unpack(archives.zip_members([member], data=b"/etc/passwd"), tmp_path)
    assert err.value.code == "unsafe_archive"


@pytest.mark.parametrize("fmt", ["tar", "zip"])
def test_too_many_files(archives, tmp_path, fmt):
    members = [(f"a/notes-{i}.txt", b"x") for i in range(20)]
    path = archives.tar_members(members) if fmt == "tar" else archives.zip_members(members)
    with pytest.raises(
        UploadTooLarge,
        match=r"more than 8 entries \(max_archive_files\)|20 entries .*, more than 8 \(max_archive_files\)",
    ) as err:
        unpack(path, tmp_path, max_archive_files=8)
    assert err.value.code == "too_many_files"


@pytest.mark.parametrize("fmt", ["tar", "zip"])
@pytest.mark.parametrize("member", [WEIGHTS, "README.md"])
def test_zip_bomb_of_zeros_is_stopped(archives, tmp_path, fmt, member):
    """16 MiB of zeros packs into a few KiB; limits of 1-2 MiB stop it while (or before) it unpacks."""
    zeros = (f"a/{member}", bytes(16 << 20))
    path = archives.tar_members([zeros]) if fmt == "tar" else archives.zip_members([zeros])
    assert path.stat().st_size < 1 << 20
    with pytest.raises(UploadTooLarge, match="max_archive_bytes|max_adapter_bytes"):
        unpack(path, tmp_path, max_adapter_bytes=1 << 20, max_archive_bytes=2 << 20)
    written = tmp_path / "out" / WEIGHTS
    assert not written.exists() or written.stat().st_size <= 1 << 20


def test_a_zip_whose_header_understates_its_size_is_caught(archives, tmp_path):
    """The central directory says 10 bytes; the data holds a megabyte: never trust the header."""
    path = archives.zip_members([(f"a/{WEIGHTS}", bytes(1 << 20))])
    data = bytearray(path.read_bytes())
    for signature, size_offset in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        at = data.find(signature)
        data[at + size_offset : at + size_offset + 4] = (10).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(InvalidAdapter) as err:
        unpack(path, tmp_path)
    # Refused as a corrupt archive, or even before, by the weights' header (zeros are no safetensors header).
    assert err.value.code in ("bad_archive", "bad_weights")
    written = tmp_path / "out" / WEIGHTS
    assert not written.exists() or written.stat().st_size <= 10


@pytest.mark.parametrize(
    "content, code, message",
    [
        (b"hello, not an archive", "unsupported_archive", "neither a .tar.gz nor a .zip"),
        (b"\x1f\x8b\x08\x00garbage-after-a-gzip-magic", "bad_archive", "corrupt"),
        (b"PK\x03\x04garbage", "bad_archive", "corrupt"),
    ],
    ids=["text", "gzip_garbage", "zip_garbage"],
)
def test_corrupt_or_unknown_archives(tmp_path, content, code, message):
    path = tmp_path / "upload.bin"
    path.write_bytes(content)
    with pytest.raises(InvalidAdapter, match=message) as err:
        unpack(path, tmp_path)
    assert err.value.code == code


def test_truncated_tar_gz(archives, adapter_dir, tmp_path):
    path = archives.tar_gz(adapter_dir)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(InvalidAdapter, match="corrupt") as err:
        unpack(path, tmp_path)
    assert err.value.code == "bad_archive"


def test_hostile_archives_write_nothing_to_the_store(store, keys_of, archives):
    for members in (
        [("../adapter_config.json", b"{}")],
        [tar_entry(WEIGHTS, tarfile.SYMTYPE, "/etc/passwd")],
    ):
        with pytest.raises(InvalidAdapter):
            store.put("acme", "evil", archives.tar_members(members))
    assert keys_of(store) == []


def test_a_zip_end_record_that_understates_the_count_is_still_counted(archives, tmp_path):
    path = archives.zip_members([(f"a/notes-{i}.txt", b"x") for i in range(20)])
    data = bytearray(path.read_bytes())
    at = data.rfind(b"PK\x05\x06")
    data[at + 8 : at + 12] = (1).to_bytes(2, "little") * 2  # entries on this disk, entries in total
    path.write_bytes(bytes(data))
    with pytest.raises(UploadTooLarge, match="more than 1 entries"):
        unpack(path, tmp_path, max_archive_files=1)


def test_a_huge_zip_central_directory_is_refused_before_it_is_read(archives, tmp_path):
    path = archives.zip_members([(f"a/{'n' * 200}-{i}.txt", b"") for i in range(100)])
    with pytest.raises(UploadTooLarge, match="100 entries") as err:
        unpack(path, tmp_path, max_archive_files=2)
    assert err.value.code == "too_many_files"


def test_an_archive_file_over_the_limit_is_refused_by_its_size(archives, adapter_dir, make_store, keys_of):
    path = archives.tar_gz(adapter_dir)
    small = make_store(max_archive_bytes=path.stat().st_size - 1)
    with pytest.raises(UploadTooLarge, match="max_archive_bytes"):
        small.put("acme", "a", path)
    assert keys_of(small) == []
