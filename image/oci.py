"""An OCI image archive of the template's root filesystem, for Proxmox VE 9.1's OCI import.

Proxmox takes a `.tar` holding `oci-layout`, `index.json` and `blobs/`. The single layer is the
template's own .tar.zst (zstd layers are accepted), so nothing is compressed twice and the archive is
as reproducible as the template. Debian's docker 20.10 cannot `docker save` this format.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

from dflash_image.digest import sha256_of

LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"


def write(layer_zst: Path, plain_tar_sha256: str, dest: Path, ref: str, labels: dict[str, str],
          env: list[str], created: str) -> str:
    """Write the archive; returns the manifest digest. `created` is an RFC 3339 time (the snapshot's)."""
    layer_sha = sha256_of(layer_zst)
    config = {
        "created": created,
        "architecture": "amd64",
        "os": "linux",
        # /sbin/init: Proxmox sets the container up as a system container, like the .tar.zst template.
        "config": {"Env": env, "Entrypoint": ["/sbin/init"], "Labels": labels, "StopSignal": "SIGRTMIN+3"},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{plain_tar_sha256}"]},
        "history": [{"created": created, "created_by": "dflash_image.build (mmdebstrap base + locked venv)"}],
    }
    config_bytes = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": f"sha256:{hashlib.sha256(config_bytes).hexdigest()}", "size": len(config_bytes)},
        "layers": [{"mediaType": LAYER_ZSTD, "digest": f"sha256:{layer_sha}", "size": layer_zst.stat().st_size}],
        "annotations": {k: v for k, v in labels.items() if k.startswith("org.opencontainers.")},
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    manifest_sha = hashlib.sha256(manifest_bytes).hexdigest()
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{"mediaType": manifest["mediaType"], "digest": f"sha256:{manifest_sha}",
                       "size": len(manifest_bytes), "platform": {"architecture": "amd64", "os": "linux"},
                       "annotations": {"org.opencontainers.image.ref.name": ref}}],
    }
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        def add_bytes(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))

        for d in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(d)
            info.type, info.mtime, info.mode = tarfile.DIRTYPE, 0, 0o755
            tar.addfile(info)
        add_bytes("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add_bytes("index.json", json.dumps(index, sort_keys=True, separators=(",", ":")).encode())
        for data in sorted([config_bytes, manifest_bytes]):
            add_bytes(f"blobs/sha256/{hashlib.sha256(data).hexdigest()}", data)
        info = tarfile.TarInfo(f"blobs/sha256/{layer_sha}")
        info.size, info.mtime, info.mode = layer_zst.stat().st_size, 0, 0o644
        with open(layer_zst, "rb") as f:
            tar.addfile(info, f)
    tmp.rename(dest)
    return f"sha256:{manifest_sha}"
