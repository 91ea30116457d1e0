"""Retrying one S3 request: which failures are worth another try, how long to wait, what to raise.

``Retrier.call(fn, what=..., key=...)`` runs ``fn`` until it succeeds, the failure is one that
another try cannot fix (denied, no such bucket, no such key), ``max_attempts`` is spent, or the
next wait would pass ``deadline_s`` since the first try. Waits grow exponentially with jitter.
Every failure leaves as a tierckpt error whose message says what to check.
"""

from __future__ import annotations

import http.client
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from tierckpt import metrics
from tierckpt.errors import CheckpointNotFoundError, StorageError, TierckptError
from tierckpt.observability import get_logger

__all__ = ["Retrier", "ShortReadError", "error_code"]

T = TypeVar("T")
_log = get_logger("s3")

#: codes and statuses that a later try can get past (throttling, server trouble)
_RETRY_CODES = frozenset({
    "SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "RequestTimeoutException",
    "Throttling", "ThrottlingException", "TooManyRequests", "RequestLimitExceeded",
    "BandwidthLimitExceeded", "OperationAborted", "PriorRequestNotComplete",
    "ConditionalRequestConflict",
})
_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_AUTH_CODES = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
    "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem", "403",
})
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


class ShortReadError(Exception):
    """A response body ended before the bytes it promised (a reset mid-body)."""


def error_code(exc: BaseException) -> tuple[str, int]:
    """``(code, http status)`` of a botocore ClientError; ``("", 0)`` for anything else."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return "", 0
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def _transient(exc: BaseException) -> bool:
    from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError, IncompleteReadError
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from urllib3.exceptions import HTTPError as Urllib3Error

    if isinstance(exc, ClientError):
        code, status = error_code(exc)
        return code in _RETRY_CODES or status in _RETRY_STATUS
    if isinstance(exc, (HTTPClientError, BotoConnectionError, IncompleteReadError, Urllib3Error,
                        http.client.HTTPException, ShortReadError, ConnectionError, TimeoutError)):
        return True
    return isinstance(exc, BotoCoreError) and "timeout" in type(exc).__name__.lower()


@dataclass
class Retrier:
    """Retry settings for one endpoint; ``where`` names the bucket for messages."""

    bucket: str
    endpoint: str
    max_attempts: int
    deadline_s: float
    base_delay_s: float = 0.1
    max_delay_s: float = 5.0
    sleep: Callable[[float], None] = time.sleep
    _rng: random.Random = field(default_factory=random.Random, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def delay(self, attempt: int) -> float:
        """Wait before try ``attempt + 1``: half of an exponential step, plus up to as much again."""
        step = min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1))
        with self._lock:
            return step / 2 + self._rng.uniform(0, step / 2)

    def call(
        self,
        fn: Callable[[], T],
        *,
        what: str,
        key: str,
        error: type[StorageError] = StorageError,
        stop: threading.Event | None = None,
    ) -> T:
        """``fn()``, retried on transient failures; ``stop`` set by a sibling ends retries early."""
        start = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except TierckptError:
                raise
            except Exception as exc:
                if not _transient(exc):
                    raise self.translate(exc, what=what, key=key, error=error) from exc
                elapsed = time.monotonic() - start
                wait = self.delay(attempt)
                if attempt >= self.max_attempts or elapsed + wait > self.deadline_s or (stop and stop.is_set()):
                    raise error(
                        f"S3 {what} of {self.url(key)} failed after {attempt} attempt(s) in "
                        f"{elapsed:.1f}s: {_describe(exc)}; the server at {self.endpoint} is failing "
                        "or overloaded (raise s3.max_attempts / s3.retry_deadline_s to wait longer)",
                        tier="durable", path=self.url(key),
                    ) from exc
                _log.warning(
                    "S3 %s of %s failed (%s); try %d of %d in %.2fs",
                    what, self.url(key), _describe(exc), attempt + 1, self.max_attempts, wait,
                )
                metrics.durable_retry(what)
                self.sleep(wait)

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def translate(
        self, exc: BaseException, *, what: str, key: str, error: type[StorageError] = StorageError
    ) -> TierckptError:
        """A tierckpt error for a failure that another try will not fix."""
        from botocore.exceptions import NoCredentialsError, PartialCredentialsError

        url = self.url(key)
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return error(
                f"S3 {what} of {url}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or S3Settings(access_key_id=..., secret_access_key=...)",
                tier="durable", path=url,
            )
        code, status = error_code(exc)
        if code in _AUTH_CODES or status == 403:
            return error(
                f"S3 refused {what} of {url} ({code or status}): check the credentials "
                "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE) and that they may "
                f"read, write, list and delete in bucket {self.bucket!r} at {self.endpoint}",
                tier="durable", path=url,
            )
        if code == "NoSuchBucket":
            return error(
                f"S3 bucket {self.bucket!r} does not exist at {self.endpoint}: check the bucket in "
                "durable_url (and the endpoint / region), or create the bucket",
                tier="durable", path=url,
            )
        if code in _NOT_FOUND_CODES or status == 404:
            return CheckpointNotFoundError(f"{url} does not exist", tier="durable", path=url)
        return error(f"S3 {what} of {url} failed: {_describe(exc)}", tier="durable", path=url)


def _describe(exc: BaseException) -> str:
    code, status = error_code(exc)
    if code:
        return f"{code} (HTTP {status})"
    return f"{type(exc).__name__}: {exc}"
