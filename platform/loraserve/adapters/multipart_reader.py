"""Parse `POST /v1/adapters`' multipart body as it streams in, handing each part's bytes on at once.

Litestar's own form parser keeps every text field in memory and spools every file to a temporary file
before the handler sees it; an adapter would then be written twice before any check. This reader drives
the `multipart` library's push parser (Litestar's own) over the request stream and hands each part to an
UploadForm (upload_form.py) as it arrives, so files go straight to their place and bad ones are refused
while the body is still arriving. The form is capped at 8 parts; the request stream itself still enforces
the route's body limit (413).
"""

from __future__ import annotations

from litestar import Request
from multipart import MultipartSegment, ParserError, ParserLimitReached, PushMultipartParser

from adapters_store import InvalidAdapter
from loraserve.adapters.upload_form import UploadForm

MAX_PARTS = 8  # name, two files (or one archive), and room for a stray field to get a clear message
_HOW = "send a multipart/form-data body, e.g. curl -F name=NAME -F archive=@adapter.tar.gz"


async def read_upload_body(request: Request, form: UploadForm) -> None:
    """Feed the body's parts to `form`; its errors (and the parser's, as InvalidAdapter) stop the reading."""
    content_type, options = request.content_type
    if content_type != "multipart/form-data" or not options.get("boundary"):
        raise InvalidAdapter(f"the upload is {content_type or 'not multipart'}; {_HOW}", "bad_upload")
    try:
        with PushMultipartParser(options["boundary"], max_segment_count=MAX_PARTS) as parser:
            async for chunk in request.stream():  # ends with b"", which tells the parser the body ended
                for event in parser.parse(chunk):
                    if isinstance(event, MultipartSegment):
                        await form.begin(event)
                    elif event:
                        await form.data(event)
                    else:  # the end of one part
                        await form.end()
            if not parser.closed:
                raise InvalidAdapter(f"the multipart body ended early; {_HOW}", "bad_upload")
    except ParserLimitReached:
        raise InvalidAdapter(f"the form has more than {MAX_PARTS} parts; {_HOW}", "bad_upload") from None
    except ParserError as exc:
        raise InvalidAdapter(f"the multipart body is malformed ({exc}); {_HOW}", "bad_upload") from None
    finally:
        form.abort()  # closes a part left open (the staging folder's owner removes the files)
