"""Stream `POST /v1/adapters`' multipart body into temporary files, with tight bounds on the rest.

Litestar's own form parser keeps every text field in memory whatever its size. An upload form has one
short text field (`name`), so this reader caps text parts at 1 KiB and the form at 8 parts, and spools
each file part to a temporary file (on disk past 1 MiB) as it arrives; the request stream itself still
enforces the route's body limit (413). The parsing is the `multipart` library's (Litestar's own).
"""

from __future__ import annotations

from litestar import Request
from litestar.datastructures import FormMultiDict, UploadFile
from multipart import MultipartSegment, ParserError, ParserLimitReached, PushMultipartParser

from adapters_store import InvalidAdapter

MAX_TEXT_BYTES = 1024  # `name` is at most 64 characters
MAX_PARTS = 8  # name, two files (or one archive), and room for a stray field to get a clear message
_HOW = "send a multipart/form-data body, e.g. curl -F name=NAME -F archive=@adapter.tar.gz"


async def read_upload_body(request: Request) -> FormMultiDict:
    """The form's fields; the caller closes it (removing the spooled files) when done."""
    content_type, options = request.content_type
    if content_type != "multipart/form-data" or not options.get("boundary"):
        raise InvalidAdapter(f"the upload is {content_type or 'not multipart'}; {_HOW}", "bad_upload")
    fields: list[tuple[str, str | UploadFile]] = []
    segment: MultipartSegment | None = None
    data: UploadFile | bytearray = bytearray()
    try:
        with PushMultipartParser(options["boundary"], max_segment_count=MAX_PARTS) as parser:
            async for chunk in request.stream():  # ends with b"", which tells the parser the body ended
                for event in parser.parse(chunk):
                    if isinstance(event, MultipartSegment):
                        segment, data = event, _new_part(event)
                    elif event:
                        await _append(segment, data, event)
                    else:  # the end of one part
                        fields.append((segment.name or "", await _finish(segment, data)))
                        data = bytearray()
            if not parser.closed:
                raise InvalidAdapter(f"the multipart body ended early; {_HOW}", "bad_upload")
    except ParserLimitReached:
        await _close(fields, data)
        raise InvalidAdapter(f"the form has more than {MAX_PARTS} parts; {_HOW}", "bad_upload") from None
    except ParserError as exc:
        await _close(fields, data)
        raise InvalidAdapter(f"the multipart body is malformed ({exc}); {_HOW}", "bad_upload") from None
    except BaseException:
        await _close(fields, data)
        raise
    return FormMultiDict(fields)


def _new_part(segment: MultipartSegment) -> UploadFile | bytearray:
    if segment.filename is None:
        return bytearray()
    return UploadFile(
        content_type=segment.content_type or "application/octet-stream", filename=segment.filename
    )


async def _append(segment: MultipartSegment, data: UploadFile | bytearray, chunk: bytes | bytearray) -> None:
    if isinstance(data, UploadFile):
        await data.write(chunk)
        return
    if len(data) + len(chunk) > MAX_TEXT_BYTES:
        raise InvalidAdapter(
            f"form field {segment.name!r} is longer than {MAX_TEXT_BYTES} bytes; files must be sent as files "
            "(curl -F files=@PATH)",
            "bad_upload",
        )
    data.extend(chunk)


async def _finish(segment: MultipartSegment, data: UploadFile | bytearray) -> str | UploadFile:
    if isinstance(data, UploadFile):
        await data.seek(0)
        return data
    try:
        return data.decode(segment.charset or "utf-8")
    except (UnicodeDecodeError, LookupError):
        raise InvalidAdapter(f"form field {segment.name!r} is not valid text", "bad_upload") from None


async def _close(fields: list[tuple[str, str | UploadFile]], data: UploadFile | bytearray) -> None:
    for value in [value for _, value in fields] + [data]:
        if isinstance(value, UploadFile):
            await value.close()
