"""An S3 bucket (AWS, MinIO, Ceph, SeaweedFS) as a snapshot transport (transport.Files): PUT or a
multipart upload with several parts in flight (s3fs's client, or boto3's transfer manager), and
reads in a few large ranged GETs streamed into the caller's memory."""

from __future__ import annotations

import asyncio
import io
import time
from concurrent.futures import ThreadPoolExecutor

import fsspec
import fsspec.asyn

from mingpt.snapshot.transport import Request, ShortFileError, failure, retried

PART_BYTES = 16 * 2**20  # multipart upload part size; ranges closer than this are merged into one GET
READ_BYTES = 64 * 2**20  # the longest ranged GET (benchmarks/s3tune.py chose both on a real server)
GETS_IN_FLIGHT = 4


class S3Objects:
    """An S3 bucket (AWS, MinIO, Ceph, SeaweedFS) through s3fs; the only user of its client calls.

    `uploader` picks how a large object goes up: "s3fs" (its client, `concurrency` parts in flight)
    or "boto3" (boto3's transfer manager, as many threads)."""

    local = False

    def __init__(self, url: str, options: dict, uploader: str = "s3fs", concurrency: int = 8):
        self.url, self.options = url.rstrip("/"), options
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        self.uploader, self.concurrency = uploader, concurrency
        self._boto = None

    def _call(self, method: str, **kwargs):
        return fsspec.asyn.sync(self.fs.loop, self.fs._call_s3, method, **kwargs)

    def check(self) -> None:
        bucket = self.root.split("/", 1)[0]
        try:
            self.fs.info(bucket)
        except FileNotFoundError:  # s3fs says "Not Found": name the bucket and the endpoint asked
            raise FileNotFoundError(f"bucket {bucket} of {self.url} does not exist or is not reachable at "
                                    f"{self.fs.s3.meta.endpoint_url}") from None

    def put(self, path: str, data) -> None:
        view = memoryview(data).cast("B")
        if len(view) < 2 * PART_BYTES:
            self.fs.pipe_file(path, bytes(view))
        elif self.uploader == "boto3":
            self._upload_boto3(path, view)
        else:
            self._upload_s3fs(path, view)
        self.fs.invalidate_cache(path)

    def _upload_s3fs(self, path: str, view: memoryview) -> None:
        fs, (bucket, key, _) = self.fs, self.fs.split_path(path)

        async def upload() -> None:
            mpu = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
            gate = asyncio.Semaphore(self.concurrency)

            async def part(i: int, start: int) -> dict:
                async with gate:
                    out = await fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=mpu["UploadId"],
                                            PartNumber=i + 1, Body=bytes(view[start:start + PART_BYTES]))
                return {"PartNumber": i + 1, "ETag": out["ETag"]}

            # Every part ends (uploaded or failed) before an abort: a part still in flight when the
            # upload is aborted may be stored after it, and would be billed as an orphan.
            results = await asyncio.gather(*(part(i, s) for i, s in enumerate(range(0, len(view), PART_BYTES))),
                                           return_exceptions=True)
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            try:
                if failed is not None:
                    raise failed
                await fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=mpu["UploadId"],
                                  MultipartUpload={"Parts": list(results)})
            except BaseException:
                await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=mpu["UploadId"])
                raise

        fsspec.asyn.sync(fs.loop, upload)

    def _upload_boto3(self, path: str, view: memoryview) -> None:
        """boto3's transfer manager: parts in `concurrency` threads, a failed upload aborted."""
        import boto3
        from boto3.s3.transfer import TransferConfig

        if self._boto is None:
            self._boto = boto3.session.Session().client(
                "s3", endpoint_url=self.options.get("endpoint_url") or self.options.get("client_kwargs", {}).get("endpoint_url"))
        bucket, key = path.split("/", 1)
        config = TransferConfig(multipart_threshold=2 * PART_BYTES, multipart_chunksize=PART_BYTES,
                                max_concurrency=self.concurrency, preferred_transfer_client="classic")
        self._boto.upload_fileobj(_ViewReader(view), bucket, key, Config=config)

    def get(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def fill(self, requests: list[Request]) -> dict[int, str]:
        """A few large ranged GETs (neighbouring requests merged, up to READ_BYTES each), each streamed
        into the requests it covers a few MiB at a time: a GET has a fixed cost, and some servers
        read the whole object to answer any range."""
        failed: dict[int, str] = {}

        def copy(members: list[int], pos: int, data: bytes) -> None:
            for i in members:
                _, offset, view = requests[i]
                lo, hi = max(pos, offset), min(pos + len(data), offset + len(view))
                if lo < hi:
                    view[lo - offset:hi - offset] = data[lo - pos:hi - pos]

        def get(chunk: tuple[str, int, int, list[int]]) -> None:
            path, start, end, members = chunk
            try:
                retried(lambda: fsspec.asyn.sync(self.fs.loop, self._stream, path, start, end,
                                                 lambda pos, data: copy(members, pos, data)))
            except Exception as e:  # noqa: BLE001 - any read failure names the shard
                failed.update(dict.fromkeys(members, failure(path, e)))

        with ThreadPoolExecutor(max_workers=GETS_IN_FLIGHT, thread_name_prefix="snapshot-get") as pool:
            list(pool.map(get, merged_ranges(requests)))
        return failed

    async def _stream(self, path: str, start: int, end: int, sink) -> None:
        """GET bytes [start, end) of an object and hand them to sink(position, bytes) as they arrive."""
        bucket, key, _ = self.fs.split_path(path)
        resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
        body, pos = resp["Body"], start
        try:
            while pos < end:
                data = await body.read(min(8 * 2**20, end - pos))
                if not data:
                    raise ShortFileError(f"{path} ends before byte {end}")
                sink(pos, data)
                pos += len(data)
        finally:
            body.close()

    def names(self, folder: str) -> list[str]:
        self.fs.invalidate_cache()  # another process (the writer) may have changed the bucket
        try:
            return [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(folder, detail=False, refresh=True)]
        except FileNotFoundError:
            return []

    def sizes(self, folder: str) -> dict[str, int]:
        return {e["name"].rsplit("/", 1)[-1]: e["size"] for e in self.fs.ls(folder, detail=True, refresh=True)}

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def remove(self, path: str) -> None:
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        # Servers with real directories (SeaweedFS, MinIO) keep an emptied folder listed until its
        # own key goes; on AWS that key does not exist and the delete is a no-op.
        bucket, key, _ = self.fs.split_path(path)
        if key:
            self._call("delete_object", Bucket=bucket, Key=key.rstrip("/") + "/")
        self.fs.invalidate_cache(path)

    def move(self, folder: str, dest: str) -> None:  # no rename on S3: server-side copies, then deletes
        self.fs.copy(folder, dest, recursive=True)
        self.remove(folder)

    def sync_dir(self, folder: str) -> None:
        pass

    def uploads(self, older_than_s: float) -> list[dict]:
        """Multipart uploads under the root begun more than `older_than_s` ago and never completed nor
        aborted (a process that died mid-upload leaves one: its parts are stored, and billed, until
        it is aborted)."""
        bucket, _, prefix = self.root.partition("/")
        out, marker = [], {}
        while True:
            page = self._call("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/" if prefix else "", **marker)
            for u in page.get("Uploads", []):
                age = time.time() - u["Initiated"].timestamp()
                if age >= older_than_s:
                    out.append({"bucket": bucket, "key": u["Key"], "upload_id": u["UploadId"], "age_s": age})
            if not page.get("IsTruncated"):
                return out
            marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def abort_upload(self, upload: dict) -> None:
        self._call("abort_multipart_upload", Bucket=upload["bucket"], Key=upload["key"], UploadId=upload["upload_id"])


def merged_ranges(requests: list[Request]) -> list[tuple[str, int, int, list[int]]]:
    """(path, start, end, indices of the requests it covers): the byte ranges to GET, requests less
    than a part apart merged, none longer than READ_BYTES (a longer request is cut)."""
    by_path: dict[str, list[int]] = {}
    for i, (path, _, view) in enumerate(requests):
        if len(view):
            by_path.setdefault(path, []).append(i)
    out = []
    for path, idx in by_path.items():
        idx.sort(key=lambda i: requests[i][1])
        start = end = None
        members: list[int] = []
        for i in idx:
            lo = requests[i][1]
            hi = lo + len(requests[i][2])
            if start is not None and lo - end <= PART_BYTES and hi - start <= READ_BYTES:
                end, members = max(end, hi), members + [i]
                continue
            if start is not None:
                out.append((path, start, end, members))
            start, end, members = lo, hi, [i]
            while end - start > READ_BYTES:  # one request larger than a read: its own reads
                out.append((path, start, start + READ_BYTES, [i]))
                start += READ_BYTES
        if start is not None:
            out.append((path, start, end, members))
    return out


class _ViewReader(io.RawIOBase):
    """A read-only file over a memoryview, for boto3's transfer manager (no copy of the whole)."""

    def __init__(self, view: memoryview):
        self.view, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), len(self.view) - self.pos)
        b[:n] = self.view[self.pos:self.pos + n]
        self.pos += n
        return n

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: len(self.view) + offset}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos
