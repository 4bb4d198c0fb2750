"""The adapter store's one validated configuration, and the store URL it names."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

DEFAULT_URL = "file://./.loraserve/adapters"
ADDRESSING_STYLES = ("auto", "path", "virtual")


@dataclass(frozen=True)
class StoreLocation:
    """Where a store URL points: a local directory, or an S3 bucket and key prefix."""

    scheme: str  # "file" or "s3"
    path: Path | None = None  # file: the root directory (relative paths stay relative to the cwd)
    bucket: str | None = None  # s3
    prefix: str = ""  # s3: key prefix without leading or trailing '/'


def parse_store_url(url: str) -> StoreLocation:
    """`file:///abs/dir`, `file://./rel/dir`, a bare path, or `s3://bucket/prefix`."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(
            "adapter store URL is empty; use file:///abs/dir, file://./rel/dir or s3://bucket/prefix"
        )
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"adapter store URL {url!r} names no bucket; use s3://bucket/prefix")
        return StoreLocation("s3", bucket=parsed.netloc, prefix=parsed.path.strip("/"))
    if parsed.scheme == "file":
        # file://./rel and file://../rel put the relative start in the "host" part; file:///abs has none.
        if parsed.netloc in (".", ".."):
            return StoreLocation("file", path=Path(parsed.netloc + parsed.path))
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(
                f"adapter store URL {url!r} names host {parsed.netloc!r}; file URLs are local: "
                "use file:///abs/dir or file://./rel/dir"
            )
        if not parsed.path:
            raise ValueError(f"adapter store URL {url!r} names no directory")
        return StoreLocation("file", path=Path(parsed.path))
    if parsed.scheme == "":
        return StoreLocation("file", path=Path(url))
    raise ValueError(f"adapter store URL {url!r} has scheme {parsed.scheme!r}; supported: file://, s3://")


@dataclass(frozen=True)
class StoreConfig:
    """Limits, retries and locations of the adapter store; every field is checked in `__post_init__`."""

    url: str = DEFAULT_URL
    # Uploads with a larger LoRA rank are refused (the engine's slots are this wide).
    max_lora_rank: int = 16
    # Whether uploads may carry their own embedding or LM head (modules_to_save, LoRA on embed_tokens /
    # lm_head): true when the engine keeps room for them (its max_vocab_loras > 0).
    vocab_modules_served: bool = False
    # Largest adapter_model.safetensors accepted, counted while the upload streams in.
    max_adapter_bytes: int = 1 * GiB
    # Archives: most members (files, folders, links alike) and most bytes, packed or unpacked.
    max_archive_files: int = 64
    max_archive_bytes: int = 1 * GiB + 64 * MiB
    # S3: extra attempts after the first, each after a random wait in
    # [0, min(max_backoff_s, backoff_s * 2**n)] (see retry.py).
    retries: int = 4
    backoff_s: float = 0.2
    max_backoff_s: float = 10.0
    # No retry starts this long after an operation's first attempt: with the timeouts below, a hung S3
    # fails an operation within about retry_deadline_s + read_timeout_s instead of retries x read_timeout_s.
    retry_deadline_s: float = 10.0
    # Per connection attempt and per socket read (not per download): a hung endpoint fails in seconds.
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 5.0
    # None: boto3's own resolution (AWS_ENDPOINT_URL, AWS_ENDPOINT_URL_S3, ~/.aws/config, then AWS).
    endpoint_url: str | None = None
    region: str | None = None  # None: AWS_REGION / AWS_DEFAULT_REGION / ~/.aws/config
    addressing_style: str = "auto"  # "path" for MinIO-like endpoints without wildcard DNS
    # Where uploads are unpacked and validated before anything is written (None: the system temp dir).
    staging_dir: str | None = None
    # A version folder with no manifest this old is an upload that died: swept, its number freed.
    # Longer than any upload takes, so a live one on another replica is never swept.
    stale_upload_s: float = 3600.0
    # The local disk cache in front of the store (see DiskCache): at most cache_max_bytes of adapters, and
    # evictions to keep cache_min_free_bytes free on its disk beyond the adapter being fetched.
    cache_dir: str = ".loraserve/cache/adapters"
    cache_max_bytes: int = 10 * GiB
    # The served base model's id: an upload's record names it as `base_model` when the adapter's
    # base_model_name_or_path is a local path (see adapters_store.record.recorded_base_model).
    served_model: str | None = None
    cache_min_free_bytes: int = 0

    def __post_init__(self) -> None:
        parse_store_url(self.url)
        for name in (
            "max_lora_rank",
            "max_adapter_bytes",
            "max_archive_files",
            "max_archive_bytes",
            "cache_max_bytes",
        ):
            _positive(name, getattr(self, name))
        free = self.cache_min_free_bytes
        if not isinstance(free, int) or isinstance(free, bool) or free < 0:
            raise ValueError(f"cache_min_free_bytes must be a non-negative integer (got {free!r})")
        if not isinstance(self.retries, int) or isinstance(self.retries, bool) or self.retries < 0:
            raise ValueError(f"retries must be a non-negative integer (got {self.retries!r})")
        for name in ("backoff_s", "max_backoff_s", "retry_deadline_s"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) < 0:
                raise ValueError(
                    f"{name} must be a non-negative number of seconds (got {getattr(self, name)!r})"
                )
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(
                f"max_backoff_s ({self.max_backoff_s}) must be at least backoff_s ({self.backoff_s})"
            )
        for name in ("connect_timeout_s", "read_timeout_s", "stale_upload_s"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive number of seconds (got {getattr(self, name)!r})")
        if self.endpoint_url is not None and not self.endpoint_url.startswith(("http://", "https://")):
            raise ValueError(f"endpoint_url must start with http:// or https:// (got {self.endpoint_url!r})")
        if self.addressing_style not in ADDRESSING_STYLES:
            raise ValueError(
                f"addressing_style must be one of {', '.join(ADDRESSING_STYLES)} (got {self.addressing_style!r})"
            )

    @property
    def location(self) -> StoreLocation:
        return parse_store_url(self.url)


_UNITS = {
    "": 1,
    "B": 1,
    "K": KiB,
    "KIB": KiB,
    "M": MiB,
    "MIB": MiB,
    "G": GiB,
    "GIB": GiB,
    "T": GiB << 10,
    "TIB": GiB << 10,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
}


def parse_size(text: str) -> int:
    """A byte count as people write it: `1073741824`, `512MiB`, `10GiB`, `10G` (binary), `20GB` (decimal)."""
    raw = text.strip().upper().replace(" ", "")
    digits = raw.rstrip("BKMGTI")
    unit = raw[len(digits) :]
    try:
        number = float(digits)
    except ValueError:
        number = None
    if number is None or unit not in _UNITS or not number >= 0 or number * _UNITS[unit] >= 1 << 63:
        raise ValueError(f"expected a size such as 10GiB, 512MiB or a number of bytes (got {text!r})")
    return int(number * _UNITS[unit])


def format_bytes(num_bytes: int) -> str:
    """1073741824 -> '1.0 GiB': limits read better in error messages."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes} bytes"


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer (got {value!r})")
