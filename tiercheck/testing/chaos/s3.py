"""The soak's durable storage: a real S3-protocol server (moto) and a TCP proxy in front of it.

Both run as processes of their own (``python -m tiercheck.testing.chaos.s3 server|proxy``), so
the driver can fail them for real: killing the proxy makes the endpoint refuse connections (an
outage) while the server, and every object in it, lives on -- moto keeps its objects in memory,
so stopping the server itself would lose them, which no outage does; ``SIGSTOP`` of the server
makes every request hang (a stalled endpoint). Restarting the proxy on the same port ends the
outage.

:class:`S3` is the driver's handle on both. Credentials are dummies and every client is pointed
at loopback, so nothing can reach real AWS.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["S3", "S3_ENV", "free_port", "main"]

#: The environment every process that talks to the soak's S3 gets: dummy credentials, no
#: metadata lookups, no reading of the developer's AWS configuration.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": "/dev/null",
    "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
}
BUCKET = "tiercheck-chaos"


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


class S3:
    """The driver's S3: the server process, the proxy process, and a client for inventories."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.server_port = free_port()
        self.proxy_port = free_port()
        self.server: subprocess.Popen[bytes] | None = None
        self.proxy: subprocess.Popen[bytes] | None = None
        self.stopped = False  # the server is SIGSTOPped
        self.bucket = BUCKET

    @property
    def endpoint(self) -> str:
        """What the job talks to: the proxy."""
        return f"http://127.0.0.1:{self.proxy_port}"

    def storage_options(self) -> dict[str, Any]:
        """fsspec options for the job's ``persistent=`` URL."""
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
        }

    def url(self, prefix: str) -> str:
        """The ``persistent=`` URL of the soak's job."""
        return f"s3://{BUCKET}/{prefix}"

    def _spawn(self, *args: str, log: str) -> subprocess.Popen[bytes]:
        with (self.log_dir / log).open("ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "tiercheck.testing.chaos.s3", *args],
                env={**os.environ, **S3_ENV},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start(self) -> None:
        """Start the server (with its bucket) and the proxy; return once both listen."""
        self.server = self._spawn("server", str(self.server_port), log="s3-server.log")
        _wait_listening(self.server_port, 60.0)
        self.client().create_bucket(Bucket=BUCKET)
        self.start_proxy()

    def start_proxy(self) -> None:
        """End an outage: the endpoint accepts connections again."""
        if self.proxy is not None and self.proxy.poll() is None:
            return
        self.proxy = self._spawn(
            "proxy", str(self.proxy_port), str(self.server_port), log="s3-proxy.log"
        )
        _wait_listening(self.proxy_port, 30.0)

    def stop_proxy(self) -> None:
        """Begin an outage: every open connection is cut, new ones are refused."""
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.send_signal(signal.SIGKILL)
            self.proxy.wait()

    def pause_server(self) -> None:
        """Every request hangs until :meth:`resume_server`."""
        assert self.server is not None
        self.server.send_signal(signal.SIGSTOP)
        self.stopped = True

    def resume_server(self) -> None:
        """Requests are answered again."""
        assert self.server is not None
        self.server.send_signal(signal.SIGCONT)
        self.stopped = False

    def client(self) -> Any:
        """A boto3 client straight to the server (not through the proxy)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{self.server_port}",
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",  # noqa: S106 -- a dummy for the loopback server
        )

    def objects(self, prefix: str) -> dict[str, str]:
        """Every object under ``prefix``: key -> ETag (the server must not be paused)."""
        found: dict[str, str] = {}
        client = self.client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
            for item in page.get("Contents", []):
                found[item["Key"]] = item["ETag"]
        return found

    def close(self) -> None:
        """Stop both processes."""
        for proc in (self.proxy, self.server):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGKILL)  # SIGKILL works on a stopped process too
                proc.wait()


def _serve(port: int) -> None:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    while True:  # until the driver kills it
        time.sleep(3600)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass  # the other side went away: the connection ends, as it would without a proxy
    finally:
        with contextlib.suppress(ConnectionError, OSError):
            writer.close()


async def _proxy(listen: int, target: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", listen, reuse_address=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    """``server PORT`` or ``proxy LISTEN TARGET``."""
    p = argparse.ArgumentParser(prog="python -m tiercheck.testing.chaos.s3")
    p.add_argument("role", choices=["server", "proxy"])
    p.add_argument("ports", type=int, nargs="+")
    args = p.parse_args()
    if args.role == "server":
        _serve(args.ports[0])
    else:
        asyncio.run(_proxy(args.ports[0], args.ports[1]))


if __name__ == "__main__":
    main()
