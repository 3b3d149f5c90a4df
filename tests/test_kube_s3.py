"""s3:// data, as pods read it: through fsspec, with the clients the image carries (pyarrow's S3
client when s3fs is absent), pointed at an S3 endpoint by AWS_ENDPOINT_URL.

The endpoint is a local S3 over a folder (helpers_kube_s3.py); the hours are the
synthetic generator's; the lines read through s3:// must be the lines of the same
hours read from the folder.
"""

from __future__ import annotations

import subprocess
import sys

from helpers_kube_s3 import LocalS3

from elastic_control.config.data_config import parse_data_config
from elastic_control.data.readers import HourlyData

WINDOW = "export START_DATE_HR=20191221/00\nexport END_DATE_HR=20191221/01\n"


def read_all(dataset_path: str) -> list[str]:
    data = HourlyData(parse_data_config(WINDOW + f'export DATASET_PATH="{dataset_path}"\n', env={}))
    lines = []
    for part in data.partitions():
        for batch in data.iter_batches(part):
            lines += [batch.line_at(i) for i in range(len(batch))]
    return lines


def test_hours_on_s3_read_like_the_same_hours_on_disk(tmp_path, monkeypatch):
    bucket = tmp_path / "s3" / "ctr-logs"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_control",
            "data",
            "synth",
            "--output",
            str(bucket / "hourly"),
            "--hours",
            "2",
            "--lines-per-hour",
            "300",
            "--seed",
            "5",
        ],  # fmt: skip
        check=True,
        capture_output=True,
    )
    local = read_all(str(bucket / "hourly"))
    assert len(local) == 600
    with LocalS3(tmp_path / "s3") as s3:
        for key, value in {
            "AWS_ENDPOINT_URL": s3.url,
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }.items():
            monkeypatch.setenv(key, value)
        assert read_all("s3://ctr-logs/hourly") == local
        asked = {(m, p) for m, p, _ in s3.requests}
    assert ("HEAD", "/ctr-logs/hourly/20191221/00/donefile") in asked  # the hour's donefile decides, as on disk
    assert ("GET", "/ctr-logs/hourly/20191221/01/part-00001") in asked
