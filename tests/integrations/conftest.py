"""The S3 fixtures of tests/s3 (a real SeaweedFS on 127.0.0.1, started once for this directory)."""

from tests.s3.conftest import _close_runtimes, bucket, memory_dir, s3_client, s3_env, s3_server  # noqa: F401
