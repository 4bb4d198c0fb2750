"""Fixtures for the deploy tests: moto's S3 server (shared with the store and platform tests)."""

from fixtures_s3 import s3_endpoint  # noqa: F401 (a fixture, used by test_deploy_entrypoint)
