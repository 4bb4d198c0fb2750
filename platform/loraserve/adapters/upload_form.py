"""`POST /v1/adapters`' multipart form, field by field as its parts stream in: a name and the adapter's files
(or one archive), written straight into the store's staging folder.

The reader (multipart_reader.py) hands each part's bytes here as they arrive; file parts go to the store's
UploadIntake (in a worker thread, a megabyte at a time), which writes them into the upload's staging folder
and refuses bad weights at their header, before their data is written. Nothing is spooled to a temporary
file first, so an upload costs one copy on disk at most. Form mistakes are InvalidAdapter (422) with a
message showing a correct request.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from multipart import MultipartSegment

from adapters_store import InvalidAdapter
from adapters_store.intake import UploadSource
from adapters_store.streams import CHUNK_BYTES
from adapters_store.upload_intake import UploadIntake
from loraserve.inference.tools import PARSERS

NAME_FIELD, FILES_FIELD, ARCHIVE_FIELD = "name", "files", "archive"
PARSER_FIELD = "tool_call_parser"  # optional: the format the adapter writes tool calls in ("auto")
_TEXT_FIELDS = (NAME_FIELD, PARSER_FIELD)
_FIELDS = (NAME_FIELD, FILES_FIELD, ARCHIVE_FIELD, PARSER_FIELD)
MAX_TEXT_BYTES = 1024  # `name` is at most 64 characters, a parser's name less
EXAMPLE = (
    "curl -F name=my-adapter -F files=@adapter_config.json -F files=@adapter_model.safetensors ... "
    "or -F name=my-adapter -F archive=@adapter.tar.gz"
)


@dataclass(frozen=True)
class AdapterUpload:
    name: str
    source: UploadSource  # Staged: the files (or the archive) in the staging folder
    tool_call_parser: str | None = None


class UploadForm:
    """`begin(segment)`, `data(chunk)`s and `end()` for each part in order, then `result()`."""

    def __init__(self, intake: UploadIntake) -> None:
        self._intake = intake
        self._texts: dict[str, list[str]] = {field: [] for field in _TEXT_FIELDS}
        self._fields: set[str] = set()
        self._segment: MultipartSegment | None = None
        self._text: bytearray | None = None  # the current part, if it is text
        self._pending = bytearray()  # file bytes not yet handed to the intake

    async def begin(self, segment: MultipartSegment) -> None:
        field, is_file = segment.name or "", segment.filename is not None
        if field not in _FIELDS:
            raise _bad(
                f"unknown form field {field!r}; the fields are name, and files or archive, and optionally "
                f"{PARSER_FIELD}"
            )
        self._segment, self._text = segment, None
        if field in _TEXT_FIELDS:
            if is_file and field == NAME_FIELD:
                raise _bad(
                    "the form needs exactly one text field 'name' (the adapter's name)", "missing_name"
                )
            if is_file:
                raise _bad(f"'{field}' must be a text field (curl -F {field}=hermes), not a file")
            self._text = bytearray()
            return
        if not is_file:
            raise _bad(f"'{field}' must be uploaded files (curl -F {field}=@PATH), not text")
        if {FILES_FIELD, ARCHIVE_FIELD} <= self._fields | {field}:
            raise _bad("send either 'files' (the two adapter files) or 'archive', not both")
        if field == ARCHIVE_FIELD and ARCHIVE_FIELD in self._fields:
            raise _bad("'archive' must be one uploaded file (.tar.gz or .zip)")
        self._fields.add(field)
        if field == FILES_FIELD:
            await asyncio.to_thread(self._intake.open_file, segment.filename)
        else:
            await asyncio.to_thread(self._intake.open_archive)

    async def data(self, chunk: bytes | bytearray) -> None:
        if self._text is not None:
            if len(self._text) + len(chunk) > MAX_TEXT_BYTES:
                raise InvalidAdapter(
                    f"form field {self._segment.name!r} is longer than {MAX_TEXT_BYTES} bytes; files must be sent "
                    "as files (curl -F files=@PATH)",
                    "bad_upload",
                )
            self._text.extend(chunk)
            return
        self._pending.extend(chunk)
        if len(self._pending) >= CHUNK_BYTES:
            await self._flush()

    async def end(self) -> None:
        if self._text is not None:
            try:
                text = self._text.decode(self._segment.charset or "utf-8")
            except (UnicodeDecodeError, LookupError):
                raise InvalidAdapter(
                    f"form field {self._segment.name!r} is not valid text", "bad_upload"
                ) from None
            self._texts[self._segment.name].append(text)
            return
        await self._flush()
        await asyncio.to_thread(self._intake.close_part)

    def result(self) -> AdapterUpload:
        names = self._texts[NAME_FIELD]
        if len(names) != 1:
            raise _bad("the form needs exactly one text field 'name' (the adapter's name)", "missing_name")
        parser = _tool_call_parser(self._texts[PARSER_FIELD])
        if not self._fields:
            raise _bad("the form has no adapter: add the files 'files' or one 'archive'", "missing_files")
        return AdapterUpload(name=names[0], source=self._intake.source(), tool_call_parser=parser)

    def abort(self) -> None:
        self._intake.abort()

    async def _flush(self) -> None:
        if self._pending:
            chunk, self._pending = bytes(self._pending), bytearray()
            await asyncio.to_thread(self._intake.write, chunk)


def _tool_call_parser(values: list[str]) -> str | None:
    if not values:
        return None
    if len(values) != 1 or values[0] not in PARSERS:
        shown = values[0] if len(values) == 1 else values
        raise _bad(f"{PARSER_FIELD} {shown!r} is not one of the parsers {', '.join(PARSERS)}")
    return values[0]


def _bad(message: str, code: str = "bad_upload") -> InvalidAdapter:
    return InvalidAdapter(f"{message}. Example: {EXAMPLE}", code)
