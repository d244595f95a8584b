"""Fixtures for the tier tests: a real S3-protocol server on loopback (moto's server mode)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tiercheck.testing.chaos.s3 import S3_ENV


@dataclass(frozen=True)
class S3Server:
    """Where the test S3 server listens, and how to reach it."""

    endpoint: str
    bucket: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    def url(self, prefix: str | None = None) -> str:
        """A unique ``s3://bucket/<prefix>`` URL (a fresh prefix if none is given)."""
        return f"s3://{self.bucket}/{prefix or uuid.uuid4().hex}"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A moto S3 server on 127.0.0.1 (free port) with one bucket, for the whole session.

    Credentials are dummies, set both in the environment and in the storage options, and every
    client is pointed at the loopback endpoint, so nothing ever reaches real AWS. Skipped, with
    the reason shown, where s3fs or moto is not installed.
    """
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'tiercheck[s3]')")
    server_module = pytest.importorskip(
        "moto.server", reason="moto[server] is not installed (pip install 'tiercheck[test]')"
    )
    boto3 = pytest.importorskip("boto3", reason="boto3 (a moto dependency) is not installed")

    with pytest.MonkeyPatch.context() as mp:
        # Dummy credentials, no instance-metadata lookups, no reading of the developer's AWS
        # config: the same environment the chaos soak gives its processes.
        for name, value in S3_ENV.items():
            mp.setenv(name, value)
        # werkzeug logs every request at INFO; the server is an implementation detail here.
        werkzeug_log = logging.getLogger("werkzeug")
        previous_level = werkzeug_log.level
        werkzeug_log.setLevel(logging.ERROR)

        server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            endpoint = f"http://{host}:{port}"
            bucket = "tiercheck-tests"
            client = boto3.client(
                "s3",
                endpoint_url=endpoint,
                region_name="us-east-1",
                aws_access_key_id="testing",
                aws_secret_access_key="testing",  # noqa: S106 -- a dummy for the local server
            )
            client.create_bucket(Bucket=bucket)
            client.close()
            options = {
                "key": "testing",
                "secret": "testing",
                "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            }
            yield S3Server(endpoint=endpoint, bucket=bucket, storage_options=options)
        finally:
            server.stop()
            werkzeug_log.setLevel(previous_level)
