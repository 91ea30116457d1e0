"""The S3 fixtures (real SeaweedFS on 127.0.0.1, the fault proxy) for the metrics-over-S3 test."""

from tests.s3.conftest import _close_runtimes, bucket, memory_dir, proxy, s3_client, s3_env, s3_server  # noqa: F401
