"""moto's S3 server on loopback, shared by the adapter-store and platform tests.

The conftests that need it import the fixtures by name (`from fixtures_s3 import s3_endpoint, ...`);
pytest puts tests/ on sys.path because tests/conftest.py sits there without an __init__.py.
Tests talk real HTTP through boto3 to moto's threaded server; each test gets its own bucket.
"""

from __future__ import annotations

import logging
import socket
import uuid

import boto3
import pytest


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on 127.0.0.1 and a free port, with dummy credentials for the whole session."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.MonkeyPatch.context() as mp:
        for var in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
            mp.delenv(var, raising=False)
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_CONFIG_FILE", "/dev/null")
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.stop()


@pytest.fixture(scope="session")
def s3_admin(s3_endpoint):
    """A plain boto3 client for setting up and inspecting buckets behind the store's back."""
    return boto3.client("s3", endpoint_url=s3_endpoint)


@pytest.fixture
def s3_bucket(s3_admin) -> str:
    """A fresh, empty bucket on the moto server."""
    name = f"adapters-{uuid.uuid4().hex[:12]}"
    s3_admin.create_bucket(Bucket=name)
    return name
