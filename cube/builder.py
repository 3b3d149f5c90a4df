"""cube-builder: one pass's sparse table -> sharded, sorted, memory-mappable cube version.

Streaming: the table is read in blocks; each block's keys are transformed
(``transform_keys`` with meta.json's ``sparse_dim``) and split by shard
(key % N) into per-shard spill files; then each shard alone is loaded,
sorted, de-duplicated (the LAST occurrence in part-file order wins, so the
output is deterministic) and written. Peak memory is one shard, not the table.
Everything is written into a staging folder renamed into place at the end.

Which columns hold the embedding (Paddle 2.6.2, SparseAccessor, text
save): ``key slot unseen_days delta_score show click embed_w [embed state]
embedx_w(d-1) [embedx state]``; the served vector is embed_w + embedx_w
(``ctr_foundation.pass_format.SparseLayout``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import click
import numpy as np

from ctr_foundation.atomic import atomic_write_json, staged_directory
from ctr_foundation.cli_runner import run_cli
from ctr_foundation.errors import DataError, UsageError
from ctr_foundation.pass_format import load_pass
from ctr_foundation.sample import transform_keys
from ctr_foundation.sparse_table_reader import iter_sparse_table_fast
from cube.shard_format import MANIFEST, sha256_file, shard_file_name, write_shard

MAX_SHARDS = 1024


def _dedupe_sorted_last(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort by key (stable) and keep the last of each run of equal keys."""
    order = np.argsort(keys, kind="stable")
    keys, values = keys[order], values[order]
    if len(keys) > 1:
        last = np.empty(len(keys), dtype=bool)
        np.not_equal(keys[1:], keys[:-1], out=last[:-1])
        last[-1] = True
        if not last.all():
            keys, values = keys[last], values[last]
    return keys, values


def build_version(
    *,
    pass_dir: str | os.PathLike,
    shards: int,
    output: str | os.PathLike,
    version: str | None = None,
    overwrite: bool = False,
) -> dict:
    """Build ``output/VERSION/`` (shard files + manifest.json) from a pass; return the manifest."""
    if not 1 <= shards <= MAX_SHARDS:
        raise UsageError(f"--shards {shards} is out of range (1-{MAX_SHARDS})")
    info = load_pass(pass_dir)
    version = version or info.name
    if not version or "/" in version or version.startswith("."):
        raise UsageError(f"version {version!r} is not a valid folder name")
    final = Path(output) / version
    if final.exists() and not overwrite:
        raise UsageError(f"{final} already exists (a built version is never rebuilt; pass --overwrite to replace it)")
    layout, dim, sparse_dim = info.layout, info.embedding_dim, info.sparse_dim
    with staged_directory(final) as stage:
        spill = stage / ".spill"
        spill.mkdir()
        key_files = [open(spill / f"{i}.keys", "wb") for i in range(shards)]
        val_files = [open(spill / f"{i}.values", "wb") for i in range(shards)]
        input_rows = 0
        try:
            for keys, values in iter_sparse_table_fast(info.path, layout):
                keys = transform_keys(keys, sparse_dim)
                input_rows += len(keys)
                shard_of = keys % np.uint64(shards)
                for i in range(shards):
                    sel = shard_of == i
                    if sel.any():
                        key_files[i].write(keys[sel].tobytes())
                        val_files[i].write(np.ascontiguousarray(values[sel]).tobytes())
        finally:
            for f in key_files + val_files:
                f.close()
        files, total = {}, 0
        for i in range(shards):
            keys = np.fromfile(spill / f"{i}.keys", dtype=np.uint64)
            values = np.fromfile(spill / f"{i}.values", dtype=np.float32).reshape(len(keys), dim)
            keys, values = _dedupe_sorted_last(keys, values)
            name = shard_file_name(i)
            write_shard(stage / name, keys, values, version=version, shard=i, shards=shards)
            (spill / f"{i}.keys").unlink()
            (spill / f"{i}.values").unlink()
            files[name] = {
                "shard": i,
                "rows": int(len(keys)),
                "size": (stage / name).stat().st_size,
                "sha256": sha256_file(stage / name),
            }
            total += len(keys)
        shutil.rmtree(spill)
        if total == 0:
            raise DataError(f"{info.path}: the sparse table is empty; nothing to build")
        manifest = {
            "version": version,
            "shards": shards,
            "dim": dim,
            "rows": int(total),
            "input_rows": int(input_rows),
            "files": files,
            "source_pass": {"name": info.name, "path": str(Path(info.path).resolve())},
            "slots": info.slots,
            "sparse_dim": sparse_dim,
            "sparse_layout": layout.to_json(),
            "format": "elastic-ctr-cube-shard/1",
        }
        atomic_write_json(stage / MANIFEST, manifest)
    return manifest


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--model",
    "pass_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="The pass folder (holds meta.json and sparse/).",
)
@click.option("--shards", required=True, type=int, help="Number of shards N (shard = key % N).")
@click.option(
    "--output",
    required=True,
    type=click.Path(file_okay=False),
    help="Cube root; the version is written to OUTPUT/VERSION/.",
)
@click.option("--version", "version", default=None, help="Version name (default: the pass name).")
@click.option("--overwrite", is_flag=True, help="Replace an existing OUTPUT/VERSION/.")
def builder_command(pass_dir, shards, output, version, overwrite):
    """Build cube shard files and manifest.json from one pass's sparse table."""
    manifest = build_version(pass_dir=pass_dir, shards=shards, output=output, version=version, overwrite=overwrite)
    click.echo(
        f"built {Path(output) / manifest['version']}: {manifest['rows']} keys, dim {manifest['dim']}, "
        f"{manifest['shards']} shards"
    )


def main(argv: list[str] | None = None) -> None:
    run_cli(builder_command, "cube-builder", argv)


if __name__ == "__main__":
    main()
