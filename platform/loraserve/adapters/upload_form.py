"""Read `POST /v1/adapters`' multipart form into a name and an upload source for the store.

multipart_reader.py has spooled each file part to a temporary file (on disk past 1 MiB), so nothing
here holds an upload whole in memory; the store then copies from those files with its own byte limits.
Form mistakes are InvalidAdapter (422) with a message showing a correct request.
"""

from __future__ import annotations

from dataclasses import dataclass

from litestar.datastructures import FormMultiDict, UploadFile

from adapters_store import AdapterFiles, InvalidAdapter, UploadSource
from loraserve.inference.tools import PARSERS

NAME_FIELD, FILES_FIELD, ARCHIVE_FIELD = "name", "files", "archive"
PARSER_FIELD = "tool_call_parser"  # optional: the format the adapter writes tool calls in ("auto")
_FIELDS = (NAME_FIELD, FILES_FIELD, ARCHIVE_FIELD, PARSER_FIELD)
EXAMPLE = (
    "curl -F name=my-adapter -F files=@adapter_config.json -F files=@adapter_model.safetensors ... "
    "or -F name=my-adapter -F archive=@adapter.tar.gz"
)


@dataclass(frozen=True)
class AdapterUpload:
    name: str
    source: UploadSource  # AdapterFiles of the two spooled parts, or the spooled archive stream
    tool_call_parser: str | None = None


def read_upload_form(form: FormMultiDict) -> AdapterUpload:
    """Check the form's fields; the caller closes `form` (and with it the spooled files) afterwards."""
    unknown = sorted(set(form.keys()) - set(_FIELDS))
    if unknown:
        raise _bad(
            f"unknown form field(s) {unknown}; the fields are name, files or archive, and optionally "
            f"{PARSER_FIELD}"
        )
    names = form.getall(NAME_FIELD, [])
    if len(names) != 1 or not isinstance(names[0], str):
        raise _bad("the form needs exactly one text field 'name' (the adapter's name)", "missing_name")
    parser = _tool_call_parser(form.getall(PARSER_FIELD, []))
    files = form.getall(FILES_FIELD, [])
    archives = form.getall(ARCHIVE_FIELD, [])
    if files and archives:
        raise _bad("send either 'files' (the two adapter files) or 'archive', not both")
    if archives:
        if len(archives) != 1 or not isinstance(archives[0], UploadFile):
            raise _bad("'archive' must be one uploaded file (.tar.gz or .zip)")
        return AdapterUpload(name=names[0], source=archives[0].file, tool_call_parser=parser)
    if not files:
        raise _bad("the form has no adapter: add the files 'files' or one 'archive'", "missing_files")
    return AdapterUpload(name=names[0], source=_adapter_files(files), tool_call_parser=parser)


def _tool_call_parser(values: list[object]) -> str | None:
    if not values:
        return None
    if len(values) != 1 or values[0] not in PARSERS:
        shown = values[0] if len(values) == 1 else values
        raise _bad(f"{PARSER_FIELD} {shown!r} is not one of the parsers {', '.join(PARSERS)}")
    return values[0]  # type: ignore[return-value]


def _adapter_files(parts: list[object]) -> AdapterFiles:
    named = {}
    for part in parts:
        if not isinstance(part, UploadFile):
            raise _bad("'files' must be uploaded files (curl -F files=@PATH), not text")
        if part.filename in named:
            raise _bad(f"two uploaded files are named {part.filename}", "bad_upload")
        named[part.filename] = part.file
    return AdapterFiles.from_named(named)  # refuses pickles, strays and a missing file by name


def _bad(message: str, code: str = "bad_upload") -> InvalidAdapter:
    return InvalidAdapter(f"{message}. Example: {EXAMPLE}", code)
