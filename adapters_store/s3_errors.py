"""Which S3 failures are worth retrying, and how to say what went wrong.

Retried: 5xx answers (but 501 Not Implemented), 429 and throttling codes, connection failures,
timeouts and bodies cut off mid-read. Not retried: everything a second try cannot fix (missing
keys, access denied, a missing bucket, failed preconditions, no credentials).
"""

from __future__ import annotations

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

NOT_FOUND_CODES = frozenset({"NoSuchKey"})
PRECONDITION_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict"})
_RETRYABLE_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
    }
)
_CREDENTIAL_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
    }
)


def error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def http_status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, ClientError):
        status = http_status(exc)
        return error_code(exc) in _RETRYABLE_CODES or status == 429 or (status >= 500 and status != 501)
    return isinstance(exc, (BotoConnectionError, HTTPClientError, IncompleteReadError))


def describe(exc: BaseException) -> str:
    """One line naming the failure: 'SlowDown (HTTP 503): Please reduce your request rate.'"""
    if isinstance(exc, ClientError):
        message = exc.response.get("Error", {}).get("Message", "")
        return f"{error_code(exc) or 'error'} (HTTP {http_status(exc)})" + (f": {message}" if message else "")
    return f"{type(exc).__name__}: {exc}"


def hint(exc: BaseException, bucket: str) -> str:
    """What the operator should do about a failure that retrying does not fix."""
    if isinstance(exc, NoCredentialsError):
        return "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
    if isinstance(exc, ClientError):
        code = error_code(exc)
        if code in _CREDENTIAL_CODES or http_status(exc) == 403:
            return "check the AWS credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE) and the bucket policy"
        if code in ("NoSuchBucket", "404"):
            return f"bucket {bucket!r} does not exist: create it or fix --adapter-store"
    if isinstance(exc, BotoCoreError):
        return "check the S3 endpoint (endpoint_url / AWS_ENDPOINT_URL) and the AWS settings"
    return "check the adapter store's S3 settings"
