"""One place that turns a data path into a filesystem: plain paths, file://, hdfs://, s3://.

Everything goes through fsspec, so readers list, test and open files the same
way whatever the storage. HDFS uses pyarrow's HadoopFileSystem (it needs
libhdfs and a Java runtime on the machine: the image's HDFS build, see the
Dockerfile; the default image reads s3:// and local paths only, and says
so). S3 uses ``s3fs`` when it is installed, else pyarrow's own
S3FileSystem behind fsspec's ArrowFSWrapper (no extra dependency: botocore,
which s3fs needs, pins python-dateutil<3 while the kubernetes client needs
>=3); credentials and region come from the usual AWS_* variables, and
AWS_ENDPOINT_URL points it at another S3 (MinIO, Ceph). A missing driver is
reported as a DataError saying what to install.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import fsspec

from ctr_foundation.errors import DataError

# The Hadoop release the Dockerfile's HDFS build is documented with.
HADOOP_VERSION = "3.3.6"


@dataclass(frozen=True)
class DataLocation:
    """A filesystem and a path on it (without the scheme)."""

    fs: Any
    path: str
    url: str

    def join(self, *parts: str) -> DataLocation:
        path = "/".join([self.path.rstrip("/"), *parts])
        url = "/".join([self.url.rstrip("/"), *parts])
        return DataLocation(self.fs, path, url)


def hdfs_options(hdfs_ugi: str) -> dict:
    """fsspec options for HDFS from HDFS_UGI ("user,password": only the user is used by libhdfs)."""
    user = hdfs_ugi.split(",", 1)[0].strip() if hdfs_ugi else ""
    return {"user": user} if user else {}


def _s3_without_s3fs(url: str):
    """(fsspec filesystem, path) for s3://bucket/key through pyarrow's S3 client."""
    import os

    import pyarrow.fs as pafs

    from fsspec.implementations.arrow import ArrowFSWrapper

    options = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        scheme, _, rest = endpoint.partition("://")
        options.update(endpoint_override=rest or scheme, scheme=scheme if rest else "https")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options["region"] = region
    return ArrowFSWrapper(pafs.S3FileSystem(**options)), url.split("://", 1)[1]


def open_location(url: str, *, hdfs_ugi: str = "") -> DataLocation:
    """Resolve ``url`` (plain path, file://, hdfs://host:port/path, s3://bucket/path) to a DataLocation."""
    options = hdfs_options(hdfs_ugi) if url.startswith(("hdfs://", "viewfs://")) else {}
    if url.startswith("s3://"):
        try:
            import s3fs  # noqa: F401
        except ImportError:
            try:
                fs, path = _s3_without_s3fs(url)
            except (ImportError, OSError, ValueError) as e:
                raise DataError(f"cannot open {url}: {type(e).__name__}: {e}") from e
            return DataLocation(fs, path, url)
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as e:
        scheme = url.split("://", 1)[0]
        hint = {
            "s3": "pip install s3fs",
            "hdfs": "install a Java runtime and libhdfs (pyarrow's HadoopFileSystem)",
            "gs": "pip install gcsfs",
        }.get(scheme, f"a filesystem driver for {scheme}://")
        raise DataError(f"cannot open {url}: no driver for {scheme}:// ({hint}): {e}") from e
    except (OSError, ValueError) as e:
        # libhdfs lists every JVM path it tried: the first line says what is missing.
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if url.startswith(("hdfs://", "viewfs://")) and ("libjvm" in first or "libhdfs" in first):
            first += (
                f" (no HDFS client here: hdfs:// needs a Java runtime and Hadoop's libhdfs; the default image has"
                f" neither, its HDFS build has both: docker build --build-arg HADOOP_VERSION={HADOOP_VERSION}, or"
                f" scripts/build-image.sh --hadoop {HADOOP_VERSION})"
            )
        raise DataError(f"cannot open {url}: {first}") from e
    return DataLocation(fs, path, url)
