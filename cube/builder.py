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

A delta pass (meta.json ``"kind": "delta"``) becomes a *delta version* on top
of its parent's version, which must already be built in the same cube root:
``shard-I.arrow`` holds the changed rows of shard I, ``deleted-I.arrow`` its
deleted keys, and the manifest says ``kind``, ``parent``, ``base`` and ``depth``
(deltas since the base). ``cube-builder --compact VERSION`` folds a delta
version's chain into a full copy, ``VERSION/compacted/``: a base for shards
that start from nothing, with the same content as the chain.
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
from ctr_foundation.sparse_table_reader import iter_deleted_keys, iter_sparse_table_fast
from cube.delta_merge import contains
from cube.shard_format import (
    MANIFEST,
    deleted_file_name,
    manifest_kind,
    read_manifest,
    sha256_file,
    shard_file_name,
    valid_version_name,
    write_deleted,
    write_shard,
)
from cube.version_store import COMPACTED, ChainLoader

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


def _file_entry(path: Path, shard: int, rows: int) -> dict:
    return {"shard": shard, "rows": int(rows), "size": path.stat().st_size, "sha256": sha256_file(path)}


def build_version(
    *,
    pass_dir: str | os.PathLike,
    shards: int,
    output: str | os.PathLike,
    version: str | None = None,
    overwrite: bool = False,
) -> dict:
    """Build ``output/VERSION/`` (shard files + manifest.json) from a pass; return the manifest.

    A delta pass needs its parent's version already built in ``output``.
    """
    if not 1 <= shards <= MAX_SHARDS:
        raise UsageError(f"--shards {shards} is out of range (1-{MAX_SHARDS})")
    info = load_pass(pass_dir)
    version = version or info.name
    if not valid_version_name(version):
        raise UsageError(f"version {version!r} is not a valid folder name")
    final = Path(output) / version
    if final.exists() and not overwrite:
        raise UsageError(f"{final} already exists (a built version is never rebuilt; pass --overwrite to replace it)")
    layout, dim, sparse_dim = info.layout, info.embedding_dim, info.sparse_dim
    kind, parent = info.kind, info.parent
    lineage: dict = {"kind": "base", "parent": None, "base": version, "depth": 0}
    if kind == "delta":
        try:
            pm = read_manifest(Path(output) / parent)
        except DataError as e:
            raise DataError(f"{info.path} is a delta on {parent}, whose version is not built in {output}: {e}") from e
        if pm["shards"] != shards or pm["dim"] != dim:
            raise DataError(
                f"{info.path} (dim {dim}, {shards} shards) cannot apply on {parent} "
                f"(dim {pm['dim']}, {pm['shards']} shards)"
            )
        lineage = {"kind": "delta", "parent": parent, "base": pm.get("base", parent), "depth": pm.get("depth", 0) + 1}
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
        deleted = np.zeros(0, np.uint64)
        if kind == "delta":
            blocks = [transform_keys(k, sparse_dim) for k in iter_deleted_keys(info.path)]
            deleted = np.unique(np.concatenate(blocks)) if blocks else deleted
        files, total, total_deleted = {}, 0, 0
        for i in range(shards):
            keys = np.fromfile(spill / f"{i}.keys", dtype=np.uint64)
            values = np.fromfile(spill / f"{i}.values", dtype=np.float32).reshape(len(keys), dim)
            keys, values = _dedupe_sorted_last(keys, values)
            name = shard_file_name(i)
            write_shard(stage / name, keys, values, version=version, shard=i, shards=shards, kind=kind, parent=parent)
            (spill / f"{i}.keys").unlink()
            (spill / f"{i}.values").unlink()
            files[name] = _file_entry(stage / name, i, len(keys))
            total += len(keys)
            if kind == "delta":
                gone = deleted[deleted % np.uint64(shards) == i]
                gone = gone[~contains(keys, gone)]  # changed and deleted in one pass: changed
                write_deleted(stage / deleted_file_name(i), gone, version=version, shard=i, shards=shards)
                files[deleted_file_name(i)] = {
                    **_file_entry(stage / deleted_file_name(i), i, len(gone)),
                    "deleted": True,
                }
                total_deleted += len(gone)
        shutil.rmtree(spill)
        if total == 0 and kind == "base":
            raise DataError(f"{info.path}: the sparse table is empty; nothing to build")
        manifest = {
            "version": version,
            **lineage,
            "shards": shards,
            "dim": dim,
            "rows": int(total),
            "input_rows": int(input_rows),
            "files": files,
            # the folder relative to the model folder (passes are MODEL_PATH/NAME): a manifest is published
            # on the file server and must not carry the building host's paths
            "source_pass": {"name": info.name, "path": info.name},
            "slots": info.slots,
            "sparse_dim": sparse_dim,
            "sparse_layout": layout.to_json(),
            "format": "elastic-ctr-cube-shard/1",
        }
        if kind == "delta":
            manifest["deleted"] = int(total_deleted)
        atomic_write_json(stage / MANIFEST, manifest)
    return manifest


def compact_version(*, cube_root: str | os.PathLike, version: str) -> dict:
    """Fold a delta version's chain into ``CUBE_ROOT/VERSION/compacted/`` (a full copy, kind base).

    Reads the chain from the version folders in ``cube_root`` (each file checked against its
    manifest), one shard at a time; returns the compacted manifest.
    """
    root = Path(cube_root)
    manifest = read_manifest(root / version)
    if manifest_kind(manifest) != "delta":
        raise UsageError(f"{version} is a base version: there is nothing to compact")
    shards, total = manifest["shards"], 0
    with staged_directory(root / version / COMPACTED) as stage:
        files = {}
        for i in range(shards):
            data = ChainLoader(root, i).content(version, f"{version}/{shard_file_name(i)}")
            name = shard_file_name(i)
            write_shard(stage / name, data.keys, data.values, version=version, shard=i, shards=shards)
            files[name] = _file_entry(stage / name, i, data.rows)
            total += data.rows
            del data
        compacted = {
            **{k: v for k, v in manifest.items() if k not in ("files", "rows", "deleted", "input_rows")},
            "kind": "base",
            "parent": None,
            "depth": 0,
            "compacted_from": {"base": manifest.get("base"), "depth": manifest.get("depth")},
            "rows": int(total),
            "files": files,
        }
        atomic_write_json(stage / MANIFEST, compacted)
    return compacted


def reshard_version(*, cube_root: str | os.PathLike, source: str, shards: int, version: str) -> dict:
    """Build ``CUBE_ROOT/VERSION/``, a base version of ``shards`` shards holding exactly the rows ``source``
    serves (its whole chain folded), from the built ``source`` in the same cube root; return its manifest.

    Streaming like a pass build: each old shard alone is read and split by new shard into spill files,
    then each new shard alone is sorted and written. The manifest keeps ``source``'s pass, slots and
    layout and says ``resharded_from``.
    """
    if not 1 <= shards <= MAX_SHARDS:
        raise UsageError(f"--shards {shards} is out of range (1-{MAX_SHARDS})")
    if not valid_version_name(version):
        raise UsageError(f"version {version!r} is not a valid folder name")
    root = Path(cube_root)
    old = read_manifest(root / source)
    dim = int(old["dim"])
    with staged_directory(root / version) as stage:
        spill = stage / ".spill"
        spill.mkdir()
        key_files = [open(spill / f"{i}.keys", "wb") for i in range(shards)]
        val_files = [open(spill / f"{i}.values", "wb") for i in range(shards)]
        try:
            for j in range(old["shards"]):
                data = ChainLoader(root, j).content(source, f"{source}/{shard_file_name(j)}")
                shard_of = data.keys % np.uint64(shards)
                for i in range(shards):
                    sel = shard_of == i
                    if sel.any():
                        key_files[i].write(data.keys[sel].tobytes())
                        val_files[i].write(np.ascontiguousarray(data.values[sel], dtype=np.float32).tobytes())
                del data
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
            files[name] = _file_entry(stage / name, i, len(keys))
            total += len(keys)
        shutil.rmtree(spill)
        keep = ("source_pass", "slots", "sparse_dim", "sparse_layout", "format")
        manifest = {
            "version": version,
            "kind": "base",
            "parent": None,
            "base": version,
            "depth": 0,
            "shards": shards,
            "dim": dim,
            "rows": int(total),
            "input_rows": int(total),
            "files": files,
            **{k: old[k] for k in keep if k in old},
            "resharded_from": {"version": source, "shards": old["shards"]},
        }
        atomic_write_json(stage / MANIFEST, manifest)
    return manifest


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--model",
    "pass_dir",
    default=None,
    type=click.Path(file_okay=False),
    help="The pass folder (holds meta.json and sparse/); a delta pass needs its parent built in OUTPUT.",
)
@click.option("--shards", type=int, default=None, help="Number of shards N (shard = key % N).")
@click.option(
    "--output",
    required=True,
    type=click.Path(file_okay=False),
    help="Cube root; the version is written to OUTPUT/VERSION/.",
)
@click.option("--version", "version", default=None, help="Version name (default: the pass name).")
@click.option("--overwrite", is_flag=True, help="Replace an existing OUTPUT/VERSION/.")
@click.option(
    "--compact",
    "compact",
    default=None,
    metavar="VERSION",
    help="Instead of building: fold delta version VERSION's chain into OUTPUT/VERSION/compacted/.",
)
def builder_command(pass_dir, shards, output, version, overwrite, compact):
    """Build cube shard files and manifest.json from one pass's sparse table (or compact a delta chain)."""
    if compact:
        if pass_dir or shards is not None:
            raise UsageError("--compact takes only --output (the cube root holding the chain)")
        m = compact_version(cube_root=output, version=compact)
        click.echo(f"compacted {Path(output) / compact / COMPACTED}: {m['rows']} keys, {m['shards']} shards")
        return
    if pass_dir is None or shards is None:
        raise UsageError("--model and --shards are required (or --compact VERSION)")
    manifest = build_version(pass_dir=pass_dir, shards=shards, output=output, version=version, overwrite=overwrite)
    extra = f", {manifest['deleted']} deleted, on {manifest['parent']}" if manifest["kind"] == "delta" else ""
    click.echo(
        f"built {Path(output) / manifest['version']}: {manifest['kind']}, {manifest['rows']} keys{extra}, "
        f"dim {manifest['dim']}, {manifest['shards']} shards"
    )


def main(argv: list[str] | None = None) -> None:
    run_cli(builder_command, "cube-builder", argv)


if __name__ == "__main__":
    main()
