"""One place that turns a data path into a filesystem: plain paths, file://, hdfs://, s3://.

Everything goes through fsspec, so readers list, test and open files the same
way whatever the storage. HDFS uses pyarrow's HadoopFileSystem (it needs
libhdfs and a Java runtime on the machine); S3 needs ``s3fs``. A missing
driver is reported as a DataError saying what to install.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import fsspec

from ctr_foundation.errors import DataError


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


def open_location(url: str, *, hdfs_ugi: str = "") -> DataLocation:
    """Resolve ``url`` (plain path, file://, hdfs://host:port/path, s3://bucket/path) to a DataLocation."""
    options = hdfs_options(hdfs_ugi) if url.startswith(("hdfs://", "viewfs://")) else {}
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
        raise DataError(f"cannot open {url}: {first}") from e
    return DataLocation(fs, path, url)
